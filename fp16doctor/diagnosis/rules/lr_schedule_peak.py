"""The trouble starts at the LR schedule's peak or largest jump.

Evidence: a dry run of the scheduler (peak and largest jump); the trouble tied to
that event by the measured trajectory, in AMP or in FP32: its first non-finite
step follows the event within the next forwards, or the gradient norm or the
loss grows step after step from the event up to it (the growth, per step, is
evidence); and the pause: from the same state, the steps from the event to the
trouble go non-finite at the schedule's rate and stay finite with the rate
capped at the rate before the event (with update-to-weight ratios and
activation maxima of both). Where the growth began while a warm-up climbed to
its peak, the cap that holds may be lower: half that rate, a quarter, down to a sixteenth. The FP32 baseline
may fail there too: the pause still shows the LR is the cause, and the fix, a
lower peak or a gentler warm-up, is verified in FP32 and AMP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from .. import rule_cases as fx
from ..findings import (
    Evidence,
    EvidenceRecord,
    Finding,
    Fix,
    LrPause,
    LrPeak,
    LrTrajectory,
    RepairKind,
    omitted_when_none,
)
from . import Rule
from ._helpers import fp32_finite


@dataclass(frozen=True)
class PeakAndBefore(EvidenceRecord):
    """One quantity the pause measured, at the peak LR and at the LR of the step before."""

    at_peak: float
    before_peak: float


@dataclass(frozen=True)
class TrajectoryGrowth(EvidenceRecord):
    """What the failing probe measured from before the event up to its first non-finite step."""

    probe: str
    """``amp`` or ``fp32``: the probe whose trouble the event is tied to."""
    first_nonfinite_step: int
    growing: str | None
    """``grad_norm`` or ``loss``: the quantity that grew step after step up to the trouble; None where the trouble
    followed the event within the next forwards, before any growth could show."""
    growth: float
    """Its last value before the trouble over its value before the growth began."""
    growth_step: int | None
    """The first grown step."""
    steps: list[int]
    grad_norm: list[float]
    """The unscaled gradient norm at each of ``steps``."""
    loss: list[float]
    """The loss at each of ``steps``."""

    @classmethod
    def of(cls, t: LrTrajectory) -> TrajectoryGrowth:
        return cls(
            probe=t.mode,
            first_nonfinite_step=t.trouble_step,
            growing=t.growing,
            growth=t.growth,
            growth_step=t.growth_step,
            steps=list(t.steps),
            grad_norm=list(t.grad_norms),
            loss=list(t.losses),
        )


@dataclass(frozen=True)
class LrPeakEvidence(EvidenceRecord):
    """The step where training breaks at the schedule's LR, and the pause that shows the step before's LR is safe."""

    step: int
    """The schedule's event (peak or jump) the trouble is tied to, where the pause starts."""
    lr_at_event: float
    """The schedule's LR at ``step``."""
    lr_before: float
    """The cap at which the same steps stay finite: the LR of the step before the event, or where the growth began
    during the climb to the peak, half of it, a quarter, down to a sixteenth."""
    peak_step: int
    jump_step: int
    jump_ratio: float
    """The schedule's largest jump: the LR's ratio to the step before, at ``jump_step``."""
    update_to_weight: PeakAndBefore
    """The update's size relative to the weights', the paused step taken at each LR."""
    activation_max: PeakAndBefore
    """The largest activation in the step after, the paused step taken at each LR."""
    capped_from: int | None = omitted_when_none()
    """Where the capped steps start, when not at ``step``: the first step of the climb to the peak whose LR passes
    the cap."""
    growth: TrajectoryGrowth | None = omitted_when_none()
    """The trajectory that ties the trouble to the event."""


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
        safe = pause.lr_cap if pause.lr_cap is not None else lrs[event - 1]
        start = pause.capped_from if pause.capped_from is not None else event
        trajectory = ev.lr_peak.trajectory
        also = "" if fp32_finite(ev) else " (FP32 breaks there too)"
        title = (
            f"Training breaks at step {event}, where the schedule reaches lr {lrs[event]:.3g}{also}; "
            f"the same step at {safe:.3g} stays finite"
            if start == event
            else f"Training breaks as the warm-up climbs to lr {lrs[event]:.3g} at step {event}{also}; "
            f"capped at {safe:.3g} from step {start} on, the same steps stay finite"
        )
        if trajectory is not None and trajectory.growing is not None:
            title += (
                f" ({trajectory.mode}'s {'gradient norm' if trajectory.growing == 'grad_norm' else 'loss'} grows "
                f"{trajectory.growth:.3g}x from step {trajectory.growth_step} to its first non-finite step "
                f"{trajectory.trouble_step})"
            )
        return [
            self.finding(
                title,
                LrPeakEvidence(
                    step=event,
                    lr_at_event=lrs[event],
                    lr_before=safe,
                    peak_step=schedule.peak_step,
                    jump_step=schedule.jump_step,
                    jump_ratio=schedule.jump_ratio,
                    update_to_weight=PeakAndBefore(pause.update_to_weight_at_peak, pause.update_to_weight_before_peak),
                    activation_max=PeakAndBefore(pause.activation_max_at_peak, pause.activation_max_before_peak),
                    capped_from=start if start != event else None,
                    growth=TrajectoryGrowth.of(trajectory) if trajectory is not None else None,
                ),
                Fix(
                    f"Lower the peak learning rate to at most {safe:.3g} (or lengthen the warm-up, or clip gradients).",
                    code=f"# in scheduler()/optimizer(): peak lr <= {safe:.3g}, e.g. a longer linear warm-up\n"
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # after scaler.unscale_(optimizer)",
                    config_patch=overrides_patch(max_lr=safe),
                ),
            )
        ]
