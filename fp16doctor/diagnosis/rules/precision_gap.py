"""No NaN, but AMP deviates from FP32 beyond tolerance on the same state.

Evidence: the loss of both precisions from the same weights and batch at
several points of the FP32 trajectory, the modules ranked by the error their
output adds in AMP, and the smallest set whose fp32 fallback closes the gap.
"""

from __future__ import annotations

from ...measure.thresholds import GAP_ERROR, GAP_TOLERANCE
from .. import fixtures as fx
from ..model import Evidence, Finding, Fix, Repair
from . import Rule


class PrecisionGap(Rule):
    code = "precision-gap"
    order = 90
    explains = ('same-state-gap', 'trajectory-drift', 'skips')
    repairs = ("fp32-modules",)
    names_cases = (lambda: (fx.repair("fp32-modules", ["norm"], symptoms=("same-state-gap",)), fx.evidence()),)
    triggers = ("fast_variance_norm.py",)
    fires_on = (lambda: fx.evidence(gap=fx.gap(0.5, closing_set=["norm"], closed_gap=1e-4)),)
    quiet_on = (lambda: fx.evidence(gap=fx.gap(5e-4)),
                lambda: fx.evidence(gap=fx.gap(1e7, gap_without_loss_scaling=1e-5, scale_leak=True)))

    def check(self, ev: Evidence) -> list[Finding]:
        gap = ev.gap
        if gap is None or not gap.exceeded or gap.scale_leak:
            return []  # a gap that loss scaling alone makes is no precision gap (scaler-misuse)
        closing = gap.closing_set
        severity = "error" if gap.gap > GAP_ERROR * (gap.tolerance / GAP_TOLERANCE) else "warning"
        evidence = {"gap": gap.gap, "step": gap.worst_step, "tolerance": gap.tolerance,
                    "same_state_rel_dev": gap.same_state_rel_dev, "ranked_modules": (gap.ranked_modules or [])[:5],
                    "closing_set": closing, "closed_gap": gap.closed_gap}
        if closing:
            fix = Fix(
                f"Keep {', '.join(closing)} in fp32 (autocast off inside): that closes the gap to {gap.closed_gap or 0.0:.3%}.",
                code=f"# in {closing[0]}.forward:\nwith torch.autocast('cuda', enabled=False):\n    x = x.float()\n    ...   # the precision-sensitive computation",
                config_patch={"overrides": {"fp32_modules": closing}},
            )
        else:
            fix = Fix("No small set of modules kept in fp32 closes the gap: try bf16, or compute the loss in fp32.",
                      config_patch={})
        return [self.finding(
            f"AMP deviates {gap.gap:.2%} from fp32 on the same weights and batch (step {gap.worst_step})"
            + (f"; {', '.join(closing)} in fp32 closes it" if closing else ""),
            evidence, fix, severity=severity,
        )]

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Modules kept in fp32 repaired it with nothing out of fp16's range: precision, not range (the rules
        before this one in causal order claim the overflows)."""
        return repair.kind == "fp32-modules" and not set(repair.symptoms) & {"nonfinite", "skips", "amp-exception"}
