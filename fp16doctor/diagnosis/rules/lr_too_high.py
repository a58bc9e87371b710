"""The learning rate is too high for the model: FP32 diverges too, and a tenth (or a hundredth) of it repairs it.

Found by intervention, not by a pattern: the FP32 baseline goes non-finite (its
updates grow the weights until the outputs leave fp32's range), no schedule
event is tied to it, and the same training at a tenth of the learning rate, or
else a hundredth (every step's rate capped there, the config patch
``overrides.max_lr``), stays finite in FP32 and in AMP, the two agreeing. The fault is then the rate, not fp16, the data or
the loss's formulation: no precision setting repairs an update too large for
the model. The fix is a lower rate (the one verified, or a warm-up to it), or
the gradient norm clipped after ``scaler.unscale_``.

Evidence: the rate the FP32 baseline diverged at, the rate verified, and FP32's
first non-finite step and where it was made.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ...measure.symptoms import first_nonfinite
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, FoundBy, Repair, RepairKind, Severity
from . import Rule
from ._helpers import highest_lr

LOWER_BY = (10.0, 100.0, 1000.0)
"""The rates the search tries, in turn: the training's highest over each."""


@dataclass(frozen=True)
class LrTooHighEvidence(EvidenceRecord):
    """The rate FP32 diverged at, and the lower one that repaired FP32 and AMP."""

    intervention: str
    """The intervention that repaired FP32 and AMP."""
    symptoms_removed: list[str]
    lr: float
    """The highest rate the FP32 baseline trained at."""
    verified_lr: float
    """The rate every step was capped at: FP32 and AMP finite."""
    fp32_first_nonfinite_step: int | None
    """FP32's first step with a non-finite loss or gradients."""
    fp32_operator: str | None
    """Where FP32's first non-finite value was made (None: not localised)."""


class LrTooHigh(Rule):
    code = "lr-too-high"
    order = 29
    evidence_type: ClassVar[type[EvidenceRecord]] = LrTooHighEvidence
    explains = ("fp32-nonfinite", "nonfinite", "skips", "amp-exception", "trajectory-drift")
    repairs = (RepairKind.LR_LOWER,)
    names_cases = (
        lambda: (
            fx.repair("lr-lower", config_patch={"overrides": {"max_lr": 0.05}}, symptoms=("fp32-nonfinite",)),
            fx.evidence(fp32=fx.probe("fp32", fx.records(nonfinite_loss=range(6, 10)))),
        ),
    )
    suppresses = ("fp32-divergence", "scale-overflow", "scale-growth", "activation-overflow", "backward-overflow")
    training_files = ("sgd_lr_too_high.py",)

    def check(self, ev: Evidence) -> list[Finding]:
        return []  # named only by the intervention search: from what, tried, repairs FP32 and AMP

    def repair_finding(self, repair: Repair, ev: Evidence) -> Finding:
        verified = float(repair.config_patch.get("overrides", {}).get("max_lr", 0.0))
        fp32, loc = ev.fp32, ev.fp32_localisation
        evidence = LrTooHighEvidence(
            intervention=repair.description,
            symptoms_removed=list(repair.symptoms),
            lr=highest_lr(fp32) or verified,
            verified_lr=verified,
            fp32_first_nonfinite_step=first_nonfinite(fp32.records) if fp32 is not None else None,
            fp32_operator=loc.operator if loc is not None else None,
        )
        at = f" at step {evidence.fp32_first_nonfinite_step}" if evidence.fp32_first_nonfinite_step is not None else ""
        title = (
            f"The learning rate {evidence.lr:.3g} is too high for the model: FP32 diverges too (non-finite{at}), and "
            f"{verified:.3g} keeps FP32 and AMP finite"
        )
        fix = Fix(
            f"Train at a learning rate of {verified:.3g} (verified; the rate between it and {evidence.lr:.3g} is not "
            "measured), or warm up to the rate you want, or clip the gradient norm after scaler.unscale_(optimizer). "
            "No precision setting repairs an update too large for the model.",
            code=f"optimizer = ...(model.parameters(), lr={verified:.3g})   # was {evidence.lr:.3g}\n"
            "...\n"
            "scaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            config_patch=dict(repair.config_patch),
        )
        finding = self.finding(title, evidence, fix, severity=Severity.ERROR)
        return replace(finding, found_by=FoundBy.INTERVENTION, verification=repair.verification)
