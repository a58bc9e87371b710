"""Diagnosis rules: one cause per file, found by walking this package.

Each rule module defines one :class:`Rule` subclass with a stable ``code``
(the cause), a severity, a causal ``order`` (data before model before
precision settings), a ``check`` that turns measured :class:`Evidence` into
findings, and its own cases: the sample models that must get this cause on
top (``triggers``) and the healthy ones that must not get it. The cases become
tests (tests/test_rules.py) and the rule's docstring its documentation
(``fp16doctor rules``). Adding a rule touches one file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ...measure.records import ExceptionInfo
from ...measure.symptoms import Symptom
from ..findings import (
    Evidence,
    EvidenceRecord,
    Finding,
    Fix,
    FoundBy,
    LocalisedAt,
    LocalisedOutputAt,
    Repair,
    RepairEvidence,
    RepairKind,
    Severity,
    omitted_when_none,
)


class Rule:
    """Base class. Subclasses set the class attributes and implement :meth:`check`."""

    code: ClassVar[str]
    """The stable cause code (part of the JSON contract)."""
    severity: ClassVar[Severity] = Severity.ERROR
    order: ClassVar[int] = 100
    """Causal order: lower runs earlier in the chain of causes and ranks first."""
    explains: ClassVar[tuple[str, ...]] = ()
    """The measured symptoms (:mod:`fp16doctor.measure.symptoms` codes) an error finding of this rule accounts for."""
    suppresses: ClassVar[tuple[str, ...]] = ()
    """Causes that are symptoms when this one is found (an error finding of this rule hides them)."""
    triggers: ClassVar[tuple[str, ...]] = ()
    """Sample models (file names in sample_models/) whose top cause is this rule's."""
    passes: ClassVar[tuple[str, ...]] = ("mlp.py", "cnn_batchnorm.py", "transformer_encoder.py")
    """Sample models that must not get this cause as an error."""
    fires_on: ClassVar[tuple[Callable[[], Evidence], ...]] = ()
    """Small evidence fixtures (:mod:`fp16doctor.diagnosis.rule_cases`) on which this rule must report its cause."""
    quiet_on: ClassVar[tuple[Callable[[], Evidence], ...]] = ()
    """Fixtures on which it must stay quiet: the near misses that tell the cause apart."""
    evidence_type: ClassVar[type[EvidenceRecord]]
    """The frozen record this rule's findings carry as evidence (its main shape; a rule with several shapes
    declares each in its file). Its fields are the finding's JSON evidence keys (the docs' reference reads it)."""
    verifiable: ClassVar[bool] = True
    """Whether the fix's config patch can repair the training (false for data causes and model bugs)."""
    training_files: ClassVar[tuple[str, ...]] = ()
    """The tests' training files (tests/training_files/) whose top cause is this rule's, where no sample model
    shows it (a compiled training's fault needs a compiler: its files are the tests')."""
    settles_suppressed: ClassVar[bool] = False
    """Where this rule's error finding stands, the causes it suppresses are dropped before any fix is tried, even
    one that would repair the probes: the probes start from a state this cause has already broken (a capsule of a
    model an update broke), so what repairs them there repairs its symptom, not the training."""
    capsule_only: ClassVar[bool] = False
    """The rule reads what only a watch's capsule records: its end-to-end cases are watched scripts, not sample
    models (``triggers`` stays empty)."""

    repairs: ClassVar[tuple[RepairKind, ...]] = ()
    """The kinds of intervention (:class:`fp16doctor.diagnosis.findings.Repair` ``kind``) whose measured repair
    names this cause in the intervention search; :meth:`names_repair` may narrow it down by the evidence."""
    repair_explains: ClassVar[tuple[str, ...]] = ()
    """Symptoms a measured repair this rule names may remove beyond :attr:`explains` (which its check's findings
    are tied to): precision-gap's check measures a gap on finite runs, its repairs also a NaN rounding made."""
    names_cases: ClassVar[tuple[Callable[[], tuple[Any, Evidence]], ...]] = ()
    """(repair, evidence) fixtures this rule must name (:meth:`names_repair`): its cases as the search sees them."""

    nothing_to_try: ClassVar[str] = "the fix is a code change; the doctor has nothing it can apply for it"
    """What the verification says when :meth:`intervention` offers nothing to try."""

    def check(self, ev: Evidence) -> list[Finding]:
        raise NotImplementedError

    def intervention(self, finding: Finding, ev: Evidence) -> Any:
        """What trying this finding's fix means (:class:`fp16doctor.diagnosis.verify.Intervention`), or None.

        By default: its config patch, applied by the doctor's own loop.
        """
        from ..verify import Intervention

        if not finding.fix.config_patch:
            return None
        return Intervention(
            "the config patch " + _flat(finding.fix.config_patch), config_patch=finding.fix.config_patch
        )

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Whether ``repair`` (an intervention that removed the symptoms) is this cause: by default, its kind."""
        return repair.kind in self.repairs

    def repair_finding(self, repair: Repair, ev: Evidence) -> Finding:
        """The finding for a repair this rule names: the measured repair is the evidence and the fix."""
        loc = ev.localisation
        amp_exception = ev.amp.exception if ev.amp is not None else None
        evidence = RepairEvidence(
            intervention=repair.description,
            symptoms_removed=list(repair.symptoms),
            fp32_modules=list(repair.modules) or None,
            # this finding accounts for AMP's exception: no longer "unexplained"
            exception=amp_exception if "amp-exception" in repair.symptoms else None,
            localisation=LocalisedOutputAt.of(loc) if loc is not None else None,
        )
        summary, code = self.repair_fix(repair, ev)
        title = self.repair_title(repair, ev)
        if repair.also:  # the rule names the cause; the measured repair also needed this
            title += f" (together with {repair.also})"
            summary += f" Together with {repair.also} (config patch below): without it the loss scale still calibrates too slowly."
        finding = self.finding(
            title, evidence, Fix(summary, code=code, config_patch=dict(repair.config_patch)), severity=Severity.ERROR
        )
        return replace(finding, found_by=FoundBy.INTERVENTION, verification=repair.verification)

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        where = ""
        loc = ev.localisation
        if loc is not None:
            where = f"; it starts at {loc.operator} in {loc.place}, step {loc.step}"
        return f"{self.code}: {repair.description} repairs the training{where}"

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        """The fix sentence and code for a repair this rule names (rules with a better formulation override it)."""
        return f"Make the change that was measured to repair the training: {repair.description}.", ""

    def finding(
        self,
        title: str,
        evidence: EvidenceRecord,
        fix: Fix,
        confidence: float = 1.0,
        severity: Severity | None = None,
    ) -> Finding:
        return Finding(
            cause=self.code,
            severity=severity or self.severity,
            title=title,
            evidence=evidence,
            fix=fix,
            confidence=confidence,
            order=self.order,
        )

    @classmethod
    def doc(cls) -> str:
        """The rule's documentation: its module's docstring (one rule per file); a rule of this package's own
        (``unexplained``) has its class docstring."""
        import sys

        own = cls.__module__ == __name__
        return ((cls.__doc__ if own else sys.modules[cls.__module__].__doc__) or "").strip()


def _flat(patch: dict[str, Any], prefix: str = "") -> str:
    parts = []
    for key, value in patch.items():
        name = f"{prefix}{key}"
        parts.append(_flat(value, name + ".") if isinstance(value, dict) else f"{name}={value}")
    return ", ".join(parts)


def rules_by_code() -> dict[str, Rule]:
    """Every rule by its cause code (the `unexplained` finding has a rule of its own: nothing to try)."""
    rules = {rule.code: rule for rule in all_rules()}
    rules.setdefault("unexplained", _Unexplained())
    return rules


@dataclass(frozen=True)
class UnexplainedEvidence(EvidenceRecord):
    """What was measured that no rule or intervention explains, and where it starts."""

    symptoms: list[Symptom]
    """The unexplained symptoms, each in its own JSON shape."""
    localisation: LocalisedAt | None = omitted_when_none()
    exception: ExceptionInfo | None = omitted_when_none()
    """AMP's exception, when the probe raised one."""
    interventions_tried: list[dict[str, Any]] | None = omitted_when_none()
    """The intervention search's trials, when it ran and none repaired."""


class _Unexplained(Rule):
    """Symptoms no rule explains (made by the triage, not by a check)."""

    code = "unexplained"
    evidence_type = UnexplainedEvidence

    nothing_to_try = "no rule recognises the pattern, so there is no fix to try"

    def check(self, ev: Evidence) -> list[Finding]:
        return []

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        """A repair no rule names: the measured symptoms, and what repaired them."""
        measured = "; ".join(s.description for s in ev.symptoms if s.code in repair.symptoms)
        where = ""
        if ev.amp is not None and ev.amp.exception:
            exc = ev.amp.exception
            where = f" ({exc.type} in {f'module {exc.module!r}' if exc.module else exc.location}: {exc.message})"
        return f"No rule names this cause: {measured}{where}; {repair.description} repairs the training"

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        summary = (
            f"Make the change that was measured to repair the training, {repair.description}, permanent in your "
            "code (the config patch applies it in the doctor's loop now)."
        )
        exc = ev.amp.exception if ev.amp is not None else None
        if exc is not None and repair.kind == "fp32-modules" and any(m in (exc.message or "") for m in DTYPE_MISMATCH):
            return (
                summary + " The exception is a dtype mismatch under AMP: code that runs outside autocast (a region "
                "with autocast disabled, a hand-written kernel) receives the fp16 tensors autocast made. Cast its "
                "inputs up where that code starts, which is what keeping the module in fp32 does.",
                "with torch.autocast('cuda', enabled=False):\n    out = self.proj(h.float())   # h is fp16 under autocast",
            )
        return summary, ""


DTYPE_MISMATCH = (
    "must have the same dtype",
    "expected scalar type",
    "Half and Float",
    "Float and Half",
    "expected both vectors to have same dtype",
    "to have the same dtype",  # matmul: "expected m1 and m2 to have the same dtype, but got: c10::Half != float"
    "should be the same",
)
"""Parts of PyTorch's messages for an operator given tensors of two dtypes (a matmul of fp16 and fp32)."""


def name_repair(repair: Repair, ev: Evidence) -> Finding:
    """The finding for what the intervention search repaired: the first rule, in causal order, that names it."""
    for rule in all_rules():
        if set(repair.symptoms) & {*rule.explains, *rule.repair_explains} and rule.names_repair(repair, ev):
            return rule.repair_finding(repair, ev)
    return _Unexplained().repair_finding(repair, ev)


def all_rules() -> list[Rule]:
    """Instantiate every Rule subclass defined in this package's modules, in causal order."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    rules = [cls() for cls in _subclasses(Rule) if "code" in cls.__dict__ and not cls.__name__.startswith("_")]
    return sorted(rules, key=lambda r: (r.order, r.code))


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    subclasses: list[type] = cls.__subclasses__()
    for subclass in subclasses:
        out.append(subclass)
        out.extend(_subclasses(subclass))
    return out
