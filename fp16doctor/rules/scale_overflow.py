"""The loss scale is too high: gradients overflow in backward step after step.

Evidence: the share of AMP steps skipped (or with non-finite gradients when
the training scales by hand) while the loss stays finite and fp32 gradients
are finite, the scale's trajectory, and the derived largest safe scale.
"""

from __future__ import annotations

from ..diagnosis.model import Evidence, Finding, Fix
from . import Rule
from ._helpers import fp32_finite, scale_patch, skip_runs

SKIP_SHARE = 0.25
"""A quarter of the steps lost to overflow is past any settling phase."""


class ScaleOverflow(Rule):
    code = "scale-overflow"
    order = 70
    triggers = ("scale_too_high.py",)

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if amp is None or amp.exception is not None or amp.first_nonfinite_loss is not None or not fp32_finite(ev):
            return []
        rec = amp.records
        overflowing = rec["skipped"].astype(bool) | rec["nonfinite_grads"].astype(bool)
        share = float(overflowing.mean()) if len(rec) else 0.0
        if share < SKIP_SHARE:
            return []
        steps = [int(s) for s in rec.loc[overflowing, "step"]]
        runs = skip_runs(steps)
        patch = scale_patch(ev)
        return [self.finding(
            f"Gradients overflow in {share:.0%} of AMP steps ({len(steps)} of {len(rec)}; longest run {max(map(len, runs))}): the loss scale is too high",
            {"overflow_share": share, "overflow_steps": steps[:30], "scale_first": float(rec["loss_scale"].iloc[0]),
             "scale_last": float(rec["loss_scale"].iloc[-1]), "scaler_enabled": amp.scaler_enabled,
             "max_safe_scale": ev.window.high if ev.window is not None else None,
             "recommended": patch["scaler"]},
            Fix(
                f"Use dynamic loss scaling from init_scale {patch['scaler']['init_scale']:.0f} with backoff 0.5.",
                code=f"scaler = torch.amp.GradScaler('cuda', init_scale={patch['scaler']['init_scale']:.0f}, backoff_factor=0.5)",
                config_patch=patch,
            ),
        )]
