"""Gradients flush to zero in fp16: loss scaling off or too small.

Evidence: the share of gradients non-zero in fp32 but zero in AMP (same
weights and batch), per parameter and per activation gradient; and the share
predicted from fp32 gradients at the configured scale. Over 5% calls for a
higher scale (mixed-precision-notes.md).
"""

from __future__ import annotations

from ..diagnosis.model import Evidence, Finding, Fix
from . import Rule
from ._helpers import fp32_finite, scale_patch

ALARM = 0.05


class GradUnderflow(Rule):
    code = "grad-underflow"
    order = 71
    triggers = ("no_loss_scaling.py",)

    def check(self, ev: Evidence) -> list[Finding]:
        if ev.config.dtype != "float16" or not fp32_finite(ev) or ev.observed_underflow is None or ev.observed_underflow.empty:
            return []
        if ev.amp is None or ev.amp.first_nonfinite_loss is not None:
            return []  # a forward that overflows zeroes gradients for other reasons
        observed = ev.observed_underflow.sort_values("observed_underflow", ascending=False)
        worst = observed.iloc[0]
        if worst["observed_underflow"] <= ALARM:
            return []
        flagged = observed[observed["observed_underflow"] > ALARM]
        patch = scale_patch(ev)
        configured = ev.config.scaler.init_scale if ev.config.scaler.enabled else None
        return [self.finding(
            f"{worst['observed_underflow']:.0%} of {worst['kind']} gradients of '{worst['name']}' flush to zero in fp16"
            + (" (loss scaling is off)" if configured is None else f" at loss scale {configured:.0f}"),
            {"worst": {"kind": worst["kind"], "name": worst["name"], "observed_underflow": float(worst["observed_underflow"])},
             "tensors_over_5pct": len(flagged), "scaler_enabled": ev.config.scaler.enabled, "configured_scale": configured,
             "scale_window": [ev.window.low, ev.window.high] if ev.window is not None else None,
             "recommended": patch["scaler"]},
            Fix(
                f"Enable GradScaler with init_scale {patch['scaler']['init_scale']:.0f} (the smallest scale keeping 99.9% of gradients is {ev.window.low:.3g})."
                if ev.window is not None else "Enable GradScaler.",
                code=(f"scaler = torch.amp.GradScaler('cuda', init_scale={patch['scaler']['init_scale']:.0f})\n"
                      "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()"),
                config_patch=patch,
            ),
        )]
