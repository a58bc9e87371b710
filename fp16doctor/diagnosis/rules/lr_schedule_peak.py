"""The trouble starts at the LR schedule's peak or largest jump.

Evidence: a dry run of the scheduler (peak and largest jump), AMP's first bad
step right at that event, and the pause: from the same snapshot, the step at
the peak LR goes non-finite while the same step at the pre-peak LR stays
finite (with update-to-weight ratios and activation maxima of both). The FP32
baseline may fail at the peak too: the pause still shows the LR is the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, LrPause, LrPeak, RepairKind
from . import Rule
from ._helpers import fp32_finite


@dataclass(frozen=True)
class PeakAndBefore(EvidenceRecord):
    """One quantity the pause measured, at the peak LR and at the LR of the step before."""

    at_peak: float
    before_peak: float


@dataclass(frozen=True)
class LrPeakEvidence(EvidenceRecord):
    """The step where training breaks at the schedule's LR, and the pause that shows the step before's LR is safe."""

    step: int
    """The paused step: AMP's trouble starts there."""
    lr_at_event: float
    """The schedule's LR at ``step``."""
    lr_before: float
    """The LR of the step before, at which the same step stays finite."""
    peak_step: int
    jump_step: int
    jump_ratio: float
    """The schedule's largest jump: the LR's ratio to the step before, at ``jump_step``."""
    update_to_weight: PeakAndBefore
    """The update's size relative to the weights', the paused step taken at each LR."""
    activation_max: PeakAndBefore
    """The largest activation in the step after, the paused step taken at each LR."""


def paused(finite_at_peak: bool) -> LrPeak:
    """A schedule jumping x1000 at step 4, paused there: the step before the jump stays finite."""
    pause = LrPause(
        pause_step=4,
        finite_at_peak=finite_at_peak,
        finite_before_peak=True,
        update_to_weight_at_peak=0.5,
        update_to_weight_before_peak=1e-4,
        activation_max_at_peak=7e4,
        activation_max_before_peak=30.0,
    )
    return fx.lr_peak([1e-4] * 4 + [1e-1] * 6, peak_step=4, jump_ratio=1000.0, pause=pause)


class LrSchedulePeak(Rule):
    code = "lr-schedule-peak"
    order = 80
    evidence_type: ClassVar[type[EvidenceRecord]] = LrPeakEvidence
    explains = ("fp32-nonfinite", "nonfinite", "skips", "trajectory-drift")
    repairs = (RepairKind.LR_CAP,)
    names_cases = (lambda: (fx.repair("lr-cap"), fx.evidence(has_scheduler=True)),)
    triggers = ("warmup_peak.py",)
    fires_on = (lambda: fx.evidence(has_scheduler=True, lr_peak=paused(finite_at_peak=False)),)
    quiet_on = (lambda: fx.evidence(has_scheduler=True, lr_peak=paused(finite_at_peak=True)),)
    suppresses = ("scale-overflow", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        if ev.lr_peak is None or ev.lr_peak.pause is None:
            return []
        schedule, pause = ev.lr_peak.schedule, ev.lr_peak.pause
        if pause.finite_at_peak or not pause.finite_before_peak:
            return []
        event = pause.pause_step
        lrs = schedule.lrs
        safe = lrs[event - 1]
        also = "" if fp32_finite(ev) else " (FP32 breaks there too)"
        return [
            self.finding(
                f"Training breaks at step {event}, where the schedule reaches lr {lrs[event]:.3g}{also}; the same step at {safe:.3g} stays finite",
                LrPeakEvidence(
                    step=event,
                    lr_at_event=lrs[event],
                    lr_before=safe,
                    peak_step=schedule.peak_step,
                    jump_step=schedule.jump_step,
                    jump_ratio=schedule.jump_ratio,
                    update_to_weight=PeakAndBefore(pause.update_to_weight_at_peak, pause.update_to_weight_before_peak),
                    activation_max=PeakAndBefore(pause.activation_max_at_peak, pause.activation_max_before_peak),
                ),
                Fix(
                    f"Lower the peak learning rate to at most {safe:.3g} (or lengthen the warm-up, or clip gradients).",
                    code=f"# in scheduler()/optimizer(): peak lr <= {safe:.3g}, e.g. a longer linear warm-up\n"
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # after scaler.unscale_(optimizer)",
                    config_patch=overrides_patch(max_lr=safe),
                ),
            )
        ]
