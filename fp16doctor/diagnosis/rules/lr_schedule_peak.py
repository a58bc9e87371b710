"""The trouble starts at the LR schedule's peak or largest jump.

Evidence: a dry run of the scheduler (peak and largest jump), AMP's first bad
step right at that event, and the pause: from the same snapshot, the step at
the peak LR goes non-finite while the same step at the pre-peak LR stays
finite (with update-to-weight ratios and activation maxima of both). The FP32
baseline may fail at the peak too: the pause still shows the LR is the cause.
"""

from __future__ import annotations

from .. import rule_cases as fx
from ..findings import Evidence, Finding, Fix, LrPause, LrPeak
from . import Rule
from ._helpers import fp32_finite


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
    explains = ("fp32-nonfinite", "nonfinite", "skips", "trajectory-drift")
    repairs = ("lr-cap",)
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
                {
                    "step": event,
                    "lr_at_event": lrs[event],
                    "lr_before": safe,
                    "peak_step": schedule.peak_step,
                    "jump_step": schedule.jump_step,
                    "jump_ratio": schedule.jump_ratio,
                    "update_to_weight": {
                        "at_peak": pause.update_to_weight_at_peak,
                        "before_peak": pause.update_to_weight_before_peak,
                    },
                    "activation_max": {
                        "at_peak": pause.activation_max_at_peak,
                        "before_peak": pause.activation_max_before_peak,
                    },
                },
                Fix(
                    f"Lower the peak learning rate to at most {safe:.3g} (or lengthen the warm-up, or clip gradients).",
                    code=f"# in scheduler()/optimizer(): peak lr <= {safe:.3g}, e.g. a longer linear warm-up\n"
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # after scaler.unscale_(optimizer)",
                    config_patch={"overrides": {"max_lr": safe}},
                ),
            )
        ]
