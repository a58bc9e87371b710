"""No NaN, but AMP deviates from FP32 beyond tolerance on the same state.

Evidence: the loss of both precisions from the same weights and batch at
several points of the FP32 trajectory, the modules ranked by the error their
output adds in AMP, and the smallest set whose fp32 fallback closes the gap.

Where no module set closes it, the operators are attributed instead: every torch call AMP's step at the worst state
ran in half precision is computed again in fp32 from its actual inputs, its rounding error weighted by the loss's
gradient there, and summed by the line of your code that called it, the model's own forward code and the loss
included (a de-standardisation ``h * std + mean`` with a mean near -10,000, which bf16 rounds to multiples of 64).
The lines with the largest shares are computed in fp32 (``overrides.fp32_lines``) until the gap closes; the finding
names them, their module and the code to write there (``h.float() * std + mean``).

Where AMP's step at the worst state made a result past fp16's range inside the closing modules that no module
output shows (an infinity divided away: a linear attention's normaliser, a hand-written variance of large values,
``x / inf = 0``), the finding says so: the gap is range, hidden, not rounding; the fix is the same.

Also named by intervention: modules kept in fp32 repair a NaN that the traced culprit made inside them from
finite inputs within fp16's range (nothing overflowed): rounding drove a value out of its operator's domain, a
variance computed as E[x^2] - E[x]^2 that cancels below 0 under a square root (a module in fp32
repairs it and nothing overflowed: precision-gap).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace
from typing import ClassVar

from ...config import overrides_patch
from ...measure.records import OUTSIDE_MODEL, ROOT, Localisation, OperatorAttribution, SiteShare
from ...measure.thresholds import GAP_ERROR, GAP_TOLERANCE, SITE_SHARE
from .. import rule_cases as fx
from ..findings import (
    Evidence,
    EvidenceRecord,
    Finding,
    Fix,
    GapSearch,
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
    operators: OperatorAttribution | None = omitted_when_none()
    """Where no module set closed the gap: the lines of your code ranked by the share of it their half-precision
    operators make (each recomputed in fp32 from its inputs, its error weighted by the loss's gradient)."""
    fp32_lines: list[str] | None = omitted_when_none()
    """The smallest set of those lines whose operators, computed in fp32, bring the gap within tolerance."""
    lines_closed_gap: float | None = omitted_when_none()
    """The gap left with ``fp32_lines`` in fp32 (``gap`` is the gap before)."""


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
        # bf16 rounds a de-standardisation in the model's own forward (h * std + mean, mean near -10,000): no module
        # holds it, the operators at its line make the gap, and that line in fp32 closes it
        lambda: fx.evidence(
            config={"dtype": "bfloat16"},
            gap=fx.gap(
                28.0,
                tolerance=8e-3,
                operators=fx.attribution(fx.site("model.py:25", 0.99), fx.site("model.py:24", 0.004)),
                closing_lines=["model.py:25"],
                lines_closed_gap=2e-4,
            ),
        ),
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
        lines = gap.closing_lines if not closing else None
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
            operators=gap.operators,
            fp32_lines=lines,
            lines_closed_gap=gap.lines_closed_gap if lines else None,
        )
        if lines:
            return [self._lines_finding(gap, lines, evidence, severity)]
        if closing:
            fix = Fix(
                f"Keep {', '.join(closing)} in fp32 (autocast off inside): that closes the gap to {gap.closed_gap or 0.0:.3%}.",
                code=f"# in {closing[0]}.forward:\nwith torch.autocast('cuda', enabled=False):\n    x = x.float()\n    ...   # the precision-sensitive computation",
                config_patch=overrides_patch(fp32_modules=closing),
            )
        else:  # nothing to propose: the search tries wider sets (every module of the top one's class), the loss, bf16
            fix = Fix(
                "No small set of modules kept in fp32 closes the gap: the intervention search tries wider changes "
                "(every module of the class the top-ranked module belongs to, the loss in fp32, bf16)."
                + _top_lines_sentence(gap.operators),
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

    def _lines_finding(
        self, gap: GapSearch, lines: list[str], evidence: PrecisionGapEvidence, severity: Severity
    ) -> Finding:
        """The gap is made by the operators at ``lines`` of the user's code, and computing them in fp32 closes it."""
        sites = [s for s in (gap.operators.sites if gap.operators else []) if s.site in lines]
        share = sum(s.share for s in sites)
        named = "; ".join(f"{s.site} in {code_owner(s.module)} ({', '.join(s.operators)})" for s in sites)
        fix = Fix(
            f"Compute the operators at {', '.join(lines)} in fp32: that closes the gap to "
            f"{gap.lines_closed_gap or 0.0:.3%} (measured on the same state). Their results rounded to half "
            f"precision make {share:.0%} of the gap (each one's rounding error weighted by the loss's gradient): "
            "cast the line's tensor input up where it starts, as below (a matrix product needs autocast off too). "
            "The config patch does it in the doctor's loop now (overrides.fp32_lines).",
            code="\n".join(fp32_line_code(s) for s in sites),
            config_patch=overrides_patch(fp32_lines=lines),
        )
        title = (
            f"AMP deviates {gap.gap:.2%} from fp32 on the same weights and batch (step {gap.worst_step}) and no "
            f"set of modules in fp32 closes it: the operators at {named} make {share:.0%} of it, and computing "
            "them in fp32 closes it"
        )
        return self.finding(title, evidence, fix, severity=severity)

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


def code_owner(module: str) -> str:
    """Whose code a line is, as prose reads it."""
    if module == ROOT:
        return "the model's own forward code"
    if module == OUTSIDE_MODEL:
        return "the loss"
    return f"module '{module}'"


def _top_lines_sentence(found: OperatorAttribution | None) -> str:
    """Where the operator-level attribution ran and no line set closed the gap: the lines that make most of it."""
    if found is None or not found.sites or found.sites[0].share < SITE_SHARE:
        return ""
    top = ", ".join(f"{s.site} ({s.share:.0%})" for s in found.sites[:3] if s.share >= SITE_SHARE)
    return f" The operators at these lines make the most of it: {top}."


FP32_REGION = "with torch.autocast('cuda', enabled=False):   # autocast would cast the matmul down again\n"


def fp32_line_code(site: SiteShare) -> str:
    """The line rewritten to compute in fp32: its first tensor operand cast up (``h * std + mean`` becomes
    ``h.float() * std + mean``, ``x.sum(-1)`` becomes ``x.float().sum(-1)``), inside a region with autocast off
    where it calls a matrix product; a line that does not parse on its own (a part of a longer statement) is shown
    with a comment saying what to do."""
    head = f"# {site.site}, in {code_owner(site.module)}: computed in fp32\n"
    code = site.code or ""
    rewritten = _first_operand_upcast(code)
    if rewritten is None:
        return (
            head
            + f"# cast this line's tensor inputs with .float(){' under autocast off' if site.lower_precision else ''}\n{code}"
        )
    if site.lower_precision:
        return head + FP32_REGION + "    " + rewritten
    return head + rewritten


def _first_operand_upcast(code: str) -> str | None:
    """``code`` with ``.float()`` after the tensor its first operator computes on, or None where it does not parse."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    if len(tree.body) != 1:
        return None
    stmt = tree.body[0]
    value = getattr(stmt, "value", None)
    if not isinstance(value, ast.expr):
        return None
    leaf = _first_operand(value)
    if leaf.end_col_offset is None:
        return None
    raw = code.encode()
    end = leaf.end_col_offset
    needs_parens = not isinstance(leaf, (ast.Name, ast.Attribute, ast.Subscript, ast.Call))
    start = leaf.col_offset
    if needs_parens:
        return (raw[:start] + b"(" + raw[start:end] + b").float()" + raw[end:]).decode()
    return (raw[:end] + b".float()" + raw[end:]).decode()


TORCH_NAMESPACES = frozenset({"torch", "F", "nn", "functional", "fft", "linalg", "special"})


def _first_operand(node: ast.expr) -> ast.expr:
    """The expression the first operator of ``node`` computes on: a binary operator's left side, a method's
    receiver, a torch function's (or a module call's) first argument."""
    if isinstance(node, ast.BinOp):
        return _first_operand(node.left)
    if isinstance(node, ast.UnaryOp):
        return _first_operand(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        base = node.func.value
        root = base
        while isinstance(root, ast.Attribute):
            root = root.value
        called_on_namespace = isinstance(root, ast.Name) and (root.id in TORCH_NAMESPACES or root.id == "self")
        if called_on_namespace and node.args:  # torch.sum(x), F.gelu(x), self.head(x): its input
            return _first_operand(node.args[0])
        if not called_on_namespace:
            return _first_operand(base)  # x.sum(-1): the tensor it is called on
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
        return _first_operand(node.args[0])
    return node
