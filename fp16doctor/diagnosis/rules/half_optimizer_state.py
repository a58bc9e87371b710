"""Optimizer state kept in half precision.

Evidence: the precision map (optimizer state dtypes per module), and where the
first non-finite value appeared (the optimizer step). Adam's eps of 1e-8 is 0
in fp16, and its second moment (squared gradients) underflows: m / (sqrt(v) + eps)
then divides by zero. A static fact: a warning of what it can lead to, an error
once a symptom it explains is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from ...engine.records import Inventory
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind, Severity, omitted_when_none
from . import Rule
from ._helpers import half_optimizer_state_modules


@dataclass(frozen=True)
class HalfOptimizerStateEvidence(EvidenceRecord):
    """The modules whose optimizer state is stored in half precision, and where the first non-finite value came from."""

    modules: list[str]
    """The first twelve such modules."""
    state_dtypes: list[str]
    param_dtypes: list[str]
    """The dtypes of those modules' parameters."""
    first_nonfinite_phase: str | None = omitted_when_none()
    """The localisation's phase (``optimizer``: the step that divides by a zero second moment), when it ran."""
    operator: str | None = omitted_when_none()
    step: int | None = omitted_when_none()


class HalfOptimizerState(Rule):
    code = "half-optimizer-state"
    severity = Severity.WARNING
    """A static fact: the triage makes it an error when a symptom it explains is measured."""
    order = 42
    evidence_type: ClassVar[type[EvidenceRecord]] = HalfOptimizerStateEvidence
    explains = ("nonfinite", "skips", "lost-updates", "trajectory-drift", "same-state-gap")
    repairs = (RepairKind.FP32_WEIGHTS,)
    names_cases = (
        lambda: (
            fx.repair("fp32-weights", symptoms=("lost-updates",)),
            fx.evidence(amp=fx.probe(precision=fx.precision(("0", "Linear", "float32", None, "float16")))),
        ),
    )

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """fp32 master weights and state repaired it, and the optimizer state was stored in half precision."""
        return repair.kind == RepairKind.FP32_WEIGHTS and not half_optimizer_state_modules(ev.amp).empty

    triggers = ("half_optimizer_state.py",)
    fires_on = (lambda: fx.evidence(amp=fx.probe(precision=fx.precision(("0", "Linear", "float32", None, "float16")))),)
    quiet_on = (lambda: fx.evidence(),)

    def check(self, ev: Evidence) -> list[Finding]:
        if ev.amp is None:
            return []
        half = half_optimizer_state_modules(ev.amp)
        if half.empty:
            return []
        loc = ev.localisation
        evidence = HalfOptimizerStateEvidence(
            modules=half[Inventory.MODULE].tolist()[:12],
            state_dtypes=sorted(set(",".join(half[Inventory.OPTIMIZER_STATE_DTYPES]).split(","))),
            param_dtypes=sorted(set(",".join(half[Inventory.PARAM_DTYPES].fillna("")).split(",")) - {""}),
            first_nonfinite_phase=loc.phase if loc is not None else None,
            operator=loc.operator if loc is not None else None,
            step=loc.step if loc is not None else None,
        )
        return [
            self.finding(
                f"Optimizer state is kept in {'/'.join(evidence.state_dtypes)} for {len(half)} module(s)"
                + (
                    f"; the first non-finite value came from the {loc.phase} ({loc.operator})"
                    if loc is not None
                    else "; Adam's eps and small second moments round to 0 there, which can divide by zero in the optimizer step"
                ),
                evidence,
                Fix(
                    "Keep parameters and optimizer state in fp32 (autocast for the compute); do not cast optimizer state to half.",
                    code="optimizer = torch.optim.AdamW(model.parameters(), lr=lr)   # fp32 params -> fp32 state; no state .half()",
                    config_patch=overrides_patch(fp32_weights=True),
                ),
                confidence=1.0 if loc is not None and loc.phase == "optimizer" else 0.7,
            )
        ]
