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
from typing import Any, Callable, ClassVar

from ..model import Evidence, Finding, Fix


class Rule:
    """Base class. Subclasses set the class attributes and implement :meth:`check`."""

    code: ClassVar[str]
    """The stable cause code (part of the JSON contract)."""
    severity: ClassVar[str] = "error"
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
    """Small evidence fixtures (:mod:`fp16doctor.diagnosis.fixtures`) on which this rule must report its cause."""
    quiet_on: ClassVar[tuple[Callable[[], Evidence], ...]] = ()
    """Fixtures on which it must stay quiet: the near misses that tell the cause apart."""
    verifiable: ClassVar[bool] = True
    """Whether the fix's config patch can repair the training (false for data causes and model bugs)."""

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
        return Intervention("the config patch " + _flat(finding.fix.config_patch), config_patch=finding.fix.config_patch)

    def finding(self, title: str, evidence: dict[str, Any], fix: Fix, confidence: float = 1.0, severity: str | None = None) -> Finding:
        return Finding(cause=self.code, severity=severity or self.severity, title=title, evidence=evidence,
                       fix=fix, confidence=confidence, order=self.order)

    @classmethod
    def doc(cls) -> str:
        """The rule's documentation: its module's docstring (one rule per file)."""
        import sys

        return (sys.modules[cls.__module__].__doc__ or "").strip()


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


class _Unexplained(Rule):
    """Symptoms no rule explains (made by the engine, not by a check)."""

    nothing_to_try = "no rule recognises the pattern, so there is no fix to try"

    def check(self, ev: Evidence) -> list[Finding]:
        return []


def all_rules() -> list[Rule]:
    """Instantiate every Rule subclass defined in this package's modules, in causal order."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    rules = [cls() for cls in _subclasses(Rule) if "code" in cls.__dict__]
    return sorted(rules, key=lambda r: (r.order, r.code))


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out
