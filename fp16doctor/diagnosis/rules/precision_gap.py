"""No NaN, but AMP deviates from FP32 beyond tolerance on the same state.

Evidence: the loss of both precisions from the same weights and batch at
several points of the FP32 trajectory, the modules ranked by the error their
output adds in AMP, and the smallest set whose fp32 fallback closes the gap.

Where AMP's step at the worst state made a result past fp16's range inside the closing modules that no module
output shows (an infinity divided away: a linear attention's normaliser, a hand-written variance of large values,
``x / inf = 0``), the finding says so: the gap is range, hidden, not rounding; the fix is the same.

Also named by intervention: modules kept in fp32 repair a NaN that the traced culprit made inside them from
finite inputs within fp16's range (nothing overflowed): rounding drove a value out of its operator's domain, a
variance computed as E[x^2] - E[x]^2 that cancels below 0 under a square root (a module in fp32
repairs it and nothing overflowed: precision-gap).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ...config import overrides_patch
from ...measure.records import Localisation
from ...measure.thresholds import GAP_ERROR, GAP_TOLERANCE
from .. import rule_cases as fx
from ..findings import (
    Evidence,
    EvidenceRecord,
    Finding,
    Fix,
    ModuleGap,
    Repair,
    RepairKind,
    Severity,
    omitted_when_none,
)
from . import Rule
from ._helpers import localised_inside, quoted


@dataclass(frozen=True)
class PrecisionGapEvidence(EvidenceRecord):
    """AMP against fp32 from the same states, the modules ranked by the error they add, and the set that closes it."""

    gap: float
    """AMP's largest relative loss deviation from fp32 from the same weights and batch (at ``step``)."""
    step: int
    tolerance: float
    same_state_rel_dev: dict[int, float]
    """Per FP32 trajectory step compared, AMP's relative loss deviation from fp32's."""
    ranked_modules: list[ModuleGap]
    """The modules adding the most error, the largest first (at most five)."""
    closing_set: list[str] | None
    """The smallest set kept in fp32 that brings the gap within tolerance; None when none did."""
    closed_gap: float | None
    """The gap left with ``closing_set`` in fp32; None when no set closed it."""
    absorbed_overflow: Localisation | None = omitted_when_none()
    """An overflow AMP's step made inside the closing modules that no module output shows (divided away)."""


class PrecisionGap(Rule):
    code = "precision-gap"
    order = 90
    evidence_type: ClassVar[type[EvidenceRecord]] = PrecisionGapEvidence
    explains = ("same-state-gap", "trajectory-drift", "skips")
    repair_explains = ("nonfinite",)
    repairs = (RepairKind.FP32_MODULES,)
    names_cases = (
        lambda: (fx.repair("fp32-modules", ["norm"], symptoms=("same-state-gap",)), fx.evidence()),
        # a one-pass variance rounded below 0 under a square root: NaN inside fp16's range
        lambda: (
            fx.repair("fp32-modules", ["enc.norm"], symptoms=("nonfinite",)),
            fx.evidence(
                localisation=fx.localisation("forward", "enc.norm", "aten::sqrt", [(-16.0, 16.0)], "nan (float16)")
            ),
        ),
    )
    triggers = ("fast_variance_norm.py",)
    fires_on = (
        lambda: fx.evidence(gap=fx.gap(0.5, closing_set=["norm"], closed_gap=1e-4)),
        # a linear attention's normaliser passes 65504 and 1 / inf = 0 hides it: the finding names the operator
        lambda: fx.evidence(
            gap=fx.gap(
                0.016,
                closing_set=["blocks.0.attn"],
                closed_gap=1e-4,
                absorbed_overflow=fx.localisation("forward", "blocks.0.attn.denominator", "aten::bmm", [(0.0, 3.0)]),
            )
        ),
        # no small set closes it: a warning that leaves the symptom to the intervention search
        lambda: fx.evidence(gap=fx.gap(0.45)),
    )
    quiet_on = (
        lambda: fx.evidence(gap=fx.gap(5e-4)),
        lambda: fx.evidence(gap=fx.gap(1e7, gap_without_loss_scaling=1e-5, scale_leak=True)),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        gap = ev.gap
        if gap is None or not gap.exceeded or gap.scale_leak:
            return []  # a gap that loss scaling alone makes is no precision gap (scaler-misuse)
        closing = gap.closing_set
        severity = Severity.ERROR if gap.gap > GAP_ERROR * (gap.tolerance / GAP_TOLERANCE) else Severity.WARNING
        absorbed = absorbed_in(ev, closing or [r.module for r in (gap.ranked_modules or [])[:1]])
        evidence = PrecisionGapEvidence(
            gap=gap.gap,
            step=gap.worst_step,
            tolerance=gap.tolerance,
            same_state_rel_dev=gap.same_state_rel_dev,
            ranked_modules=(gap.ranked_modules or [])[:5],
            closing_set=closing,
            closed_gap=gap.closed_gap,
            absorbed_overflow=absorbed,
        )
        if closing:
            fix = Fix(
                f"Keep {', '.join(closing)} in fp32 (autocast off inside): that closes the gap to {gap.closed_gap or 0.0:.3%}.",
                code=f"# in {closing[0]}.forward:\nwith torch.autocast('cuda', enabled=False):\n    x = x.float()\n    ...   # the precision-sensitive computation",
                config_patch=overrides_patch(fp32_modules=closing),
            )
        else:  # nothing to propose: the search tries wider sets (every module of the top one's class), the loss, bf16
            fix = Fix(
                "No small set of modules kept in fp32 closes the gap: the intervention search tries wider changes "
                "(every module of the class the top-ranked module belongs to, the loss in fp32, bf16).",
                config_patch={},
            )
        found = self.finding(
            f"AMP deviates {gap.gap:.2%} from fp32 on the same weights and batch (step {gap.worst_step})"
            + (
                f"; {', '.join(closing)} in fp32 closes it"
                if closing
                else "; no small set of modules in fp32 closes it"
            )
            + (absorbed_sentence(absorbed) if absorbed is not None else ""),
            evidence,
            fix,
            severity=severity if closing else Severity.WARNING,
        )
        return [replace(found, needs_search=not closing)]

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Modules kept in fp32 repaired it with nothing out of fp16's range: precision, not range (the rules
        before this one in causal order claim the overflows). A NaN counts when the traced culprit made it inside
        those modules from finite inputs within fp16's range: rounding drove a value out of its operator's domain."""
        if repair.kind != RepairKind.FP32_MODULES or repair.forward_overflow:
            return False
        return not set(repair.symptoms) & {"nonfinite", "skips", "amp-exception"} or _rounded_out_of_domain(ev, repair)

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        loc = ev.localisation
        absorbed = absorbed_in(ev, repair.modules)
        if absorbed is not None and not set(repair.symptoms) & {"nonfinite", "skips", "amp-exception"}:
            return f"{self.code}: {repair.description} repairs the training" + absorbed_sentence(absorbed)
        if loc is None or not _rounded_out_of_domain(ev, repair):
            return super().repair_title(repair, ev)
        ranges = ", ".join(f"[{lo:.3g}, {hi:.3g}]" for lo, hi in loc.input_ranges)
        return (
            f"fp16's rounding makes {loc.operator} in {loc.place} non-finite from finite inputs inside fp16's range "
            f"({ranges} -> {loc.output}, step {loc.step}): precision, not range; keeping {quoted(repair.modules)} "
            "in fp32 repairs the training"
        )

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        if not _rounded_out_of_domain(ev, repair):
            return super().repair_fix(repair, ev)
        return (
            f"Keep {quoted(repair.modules)} in fp32 (autocast off inside), or compute the value in a form that "
            "rounding cannot drive out of the operator's domain: a variance as mean((x - mean(x))**2) or x.var() "
            "(not E[x^2] - E[x]^2, which cancels to below 0), a clamp to a bound fp16 holds before sqrt/log/acos "
            "(1 - 1e-7 is 1.0 in fp16; 1 - 1e-3 is not).",
            ROUNDING_CODE,
        )


ROUNDING_CODE = (
    "var = (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)  # not E[x^2] - E[x]^2\n"
    "x = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(var.float() + eps).to(x.dtype)"
)


def _rounded_out_of_domain(ev: Evidence, repair: Repair) -> bool:
    """The traced culprit is inside the repaired modules and made its NaN or inf from finite inputs within fp16's
    range, with nothing past 65504 (the square root of a variance that cancellation drove below 0)."""
    loc = ev.localisation
    return (
        loc is not None
        and loc.phase in ("forward", "backward")
        and localised_inside(ev, repair.modules)
        and not loc.overflowed
    )


def absorbed_in(ev: Evidence, modules: list[str]) -> Localisation | None:
    """The overflow AMP's step made inside ``modules`` that no module output shows (the precision-gap stage's trace),
    if any."""
    absorbed = ev.gap.absorbed_overflow if ev.gap is not None else None
    return absorbed if absorbed is not None and absorbed.inside(modules) else None


def absorbed_sentence(loc: Localisation) -> str:
    """What the absorbed overflow was, as the finding's title ends."""
    size = f" (result max |x| = {loc.peak:.4g})" if loc.peak is not None else ""
    return (
        f"; the gap is an overflow no module output shows: {loc.operator} in {loc.place} made {loc.output}{size} "
        f"at step {loc.step}, and what follows divides it away (x / inf = 0): range, not rounding"
    )
