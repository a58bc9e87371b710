"""A divisor (or a log's or rsqrt's argument) underflows to 0 in fp16 while fp32 keeps it positive.

Evidence: the first non-finite AMP operator in the forward pass divides (``div``, ``reciprocal``,
``rsqrt``, ``log``, ``addcdiv``), its finite divisor's range reaches 0 in fp16, and nothing overflowed:
no result past 65504 was seen, and the same module's FP32 output stays inside fp16's range. So it is
not an activation overflow: 0/0 or x/0 made the NaN or inf. The usual source is an epsilon below fp16's
smallest subnormal (about 6e-8: a norm's ``sqrt(mean(x*x) + 1e-8)``, ``F.normalize``'s eps) that is
0 in fp16, on rows that are exactly 0 (padding), or squares of small values that flush to zero
(an epsilon below fp16's smallest subnormal is 0). The fix: the module in fp32
(verified by the doctor), or an epsilon fp16 holds (1e-5 is usual). In the backward pass (the derivative
of acos, sqrt or a division at a value fp16 rounded onto its bound: ArcFace's clamp to 1 - 1e-7, which is 1.0 in
fp16) the divisor rounds to 0 the same way, with the FP32 run finite.

A divisor (or argument) made directly by an operator given a Python number that is 0 in fp16, such as a log of
``clamp(power, min=1e-10)``, is constant-out-of-range's: the constant fp16 cannot hold is the cause, not a divisor
the code computed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ...config import overrides_patch
from ...engine.records import Reading, Table
from ...measure.records import OUTSIDE_MODEL, ROOT, Localisation
from ...tensors import FP16_MAX
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, ProbeSummary, Repair, RepairKind
from . import Rule
from ._helpers import (
    enclosing_fp32_safe,
    fp32_finite,
    fp32_wrapper_code,
    localised_inside,
    module_abs_max,
    quoted,
    unheld_constant,
)

DIVISOR_INPUT = {
    "aten::div": 1,
    "aten::div_": 1,
    "aten::true_divide": 1,
    "aten::reciprocal": 0,
    "aten::rsqrt": 0,
    "aten::log": 0,
    "aten::log2": 0,
    "aten::log10": 0,
    "aten::addcdiv": 2,
}
"""Operators that are non-finite at 0, and which of their inputs is then the divisor (or the argument)."""


DIVISOR_IN_FP32 = {
    "aten::reciprocal": (
        "# fp32 until multiplied: 1 / eps passes 65504\ny = (x.float() * torch.reciprocal(d.float() + eps)).to(x.dtype)"
    ),
    "aten::rsqrt": (
        "# fp32 until multiplied: 1 / sqrt(eps) can pass 65504\n"
        "y = (x.float() * torch.rsqrt(v.float() + eps)).to(x.dtype)"
    ),
    "aten::log": "y = torch.log(p.float() + eps).to(p.dtype)",
    "aten::log2": "y = torch.log2(p.float() + eps).to(p.dtype)",
    "aten::log10": "y = torch.log10(p.float() + eps).to(p.dtype)",
    "aten::addcdiv": "y = torch.addcdiv(x.float(), a.float(), d.float() + eps).to(x.dtype)",
}
"""The localised operator with its divisor (or argument) computed in fp32; a division is the default."""
BACKWARD_BOUND = (
    " In backward the divisor is a derivative's: a value fp16 rounds onto a bound makes it 0 (a clamp to "
    "1 - 1e-7 is 1.0 in fp16, so acos's or sqrt's derivative divides by 0): clamp to a bound fp16 holds "
    "(1 - 1e-3) or compute that part in fp32."
)


FLUSHED_DIVISOR_CODE = (
    "x32 = x.float()   # before the squares, sums or products that make d\n"
    "d = ...           # from x32, e.g. torch.linalg.vector_norm(x32, dim=-1, keepdim=True)\n"
    "y = (x32 / (d + eps)).to(x.dtype)"
)
"""A divisor made from fp32 values: where it flushed to 0 before the division, casting it up comes too late."""
DIVIDES = ("aten::div", "aten::div_", "aten::true_divide")


def divisor_in_fp32_code(loc: Localisation) -> str:
    """The operator the doctor localised, rewritten so that its divisor is fp32 when the epsilon is added (or, where
    it flushed to 0 before the division, made from fp32 values): the snippet names the operator the measurement
    saw, not a norm the module may not be."""
    owner = "the model's forward" if loc.module == ROOT else f"'{loc.module}'.forward"
    if flushed_before_division(loc):
        return (
            f"# in {owner}, at its {loc.operator.split('::')[-1]}: the divisor made from fp32 values.\n"
            "# Squares of values under 2.4e-4 are 0 in fp16, and a divisor that\n"
            f"# already flushed to 0 stays 0 when cast up:\n{FLUSHED_DIVISOR_CODE}"
        )
    line = DIVISOR_IN_FP32.get(loc.operator, "y = (x.float() / (d.float() + eps)).to(x.dtype)")
    return (
        f"# in {owner}, at its {loc.operator.split('::')[-1]}: the divisor in fp32, where an\n"
        f"# epsilon such as 1e-8 is not 0 (in fp16 it is):\n{line}"
    )


def flushed_before_division(loc: Localisation) -> bool:
    """A division made +-inf: values that are not 0 over a divisor that is (0/0 alone is NaN). The divisor flushed to
    0 before the division, from squares or products of small values fp16 cannot hold, where the values it divides
    did not: an epsilon added afterwards, or a cast up, cannot bring it back. (A zero padding row gives 0/0.)"""
    return loc.operator in DIVIDES and "inf" in loc.output


def _fix_summary(loc: Localisation, keep: str, in_root: bool) -> str:
    """What to change: the module in fp32, and the divisor's own fix (an epsilon fp16 holds, or a divisor made
    from fp32 values where it flushed before the division)."""
    where = "Compute the division in fp32" if in_root else f"Run '{keep}' in fp32 (autocast off inside it)"
    if flushed_before_division(loc):
        return (
            where + ", making the divisor from fp32 values: it is 0 where the values it divides are not, so it "
            "flushed to 0 before the division (squares or products of values fp16 cannot hold: a square of "
            "anything under 2.4e-4 is 0 in fp16). Cast the input up before the squares and sums that make it "
            "(torch.linalg.vector_norm and F.normalize run in fp32 under autocast); casting the finished divisor "
            "up, or adding an epsilon to it, cannot bring back what flushed."
        )
    return (
        where + ", or use an epsilon fp16 holds: fp16's smallest subnormal is 6e-8, so an eps of 1e-8 is 0 in "
        "fp16 (1e-5 is usual), or add it after casting up to fp32."
        + (BACKWARD_BOUND if loc.phase == "backward" else "")
    )


def _reaches_zero(loc: Localisation) -> str:
    """How the divisor got to 0: in backward, usually a value fp16 rounded to a bound (a clamp to 1 - 1e-7 is
    1.0 in fp16, and acos's derivative divides by sqrt(1 - x^2) = 0)."""
    return "rounds to 0 in fp16" if loc.phase == "backward" else "underflows to 0 in fp16"


def _where(loc: Localisation) -> str:
    if loc.module == ROOT:
        return loc.place
    return f"the backward of module '{loc.module}'" if loc.phase == "backward" else f"module '{loc.module}'"


def _operator(loc: Localisation) -> str:
    """The operator, with the autograd node that ran it in backward (``AcosBackward0's aten::rsqrt``)."""
    return f"{loc.autograd_node}'s {loc.operator}" if loc.phase == "backward" and loc.autograd_node else loc.operator


def _fp32_forward(module: str, abs_max: float) -> ProbeSummary:
    return fx.probe("fp32", tables={Table.FORWARD: pd.DataFrame([{Reading.MODULE: module, Reading.ABS_MAX: abs_max}])})


@dataclass(frozen=True)
class DivisorUnderflowEvidence(EvidenceRecord):
    """The localised operator whose divisor (or argument) reached 0 in fp16, and the module's FP32 output."""

    module: str | None
    operator: str
    step: int
    batch: int
    operator_input_ranges: list[tuple[float, float]]
    divisor_range: list[float]
    """The [low, high] range of the operator's divisor (or argument) input: low is 0."""
    output: str
    fp32_abs_max: float | None
    """The module's largest forward output magnitude in the FP32 run (inside fp16's range)."""
    keep_in_fp32: str
    """The module the fix keeps in fp32: the culprit's, or its nearest ancestor whose FP32 output fits fp16."""
    deterministic: bool | None
    """Whether the localisation's replay reproduced the fault; None where it was not checked."""


class DivisorUnderflow(Rule):
    code = "divisor-underflow"
    order = 58
    evidence_type: ClassVar[type[EvidenceRecord]] = DivisorUnderflowEvidence
    explains = ("nonfinite", "skips")
    repairs = (RepairKind.FP32_MODULES,)
    triggers = ("eps_underflow_norm.py",)
    fires_on = (
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 40.9),
            localisation=fx.localisation("forward", "norm", "aten::div", [(-26.0, 24.8), (0.0, 0.74)], "nan (float16)"),
        ),
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 3.0),
            localisation=fx.localisation("forward", "norm", "aten::rsqrt", [(0.0, 2.5)], "+inf (float16)"),
        ),
        # x / (x.norm() + 1e-8) in the model's own forward: a code fix, no module to keep in fp32
        lambda: fx.evidence(
            fp32=_fp32_forward("<root>", 1.0),
            localisation=fx.localisation("forward", "<root>", "aten::div", [(-2.0, 2.0), (0.0, 3.0)], "nan (float16)"),
        ),
        # f / sqrt((f * f).sum()) on dark pixels: the squares flushed, the values did not (x/0 = inf): the fix makes
        # the divisor from fp32 values (casting it up afterwards brings nothing back)
        lambda: fx.evidence(
            fp32=_fp32_forward("<root>", 0.67),
            localisation=fx.localisation(
                "forward", "<root>", "aten::div", [(-0.067, 0.071), (0.0, 0.167)], "nan/+inf/-inf (float32)"
            ),
        ),
        # a constant fp16 cannot hold made the numerator, not the divisor: the divisor the code computed flushed
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 40.9),
            localisation=fx.localisation(
                "forward",
                "norm",
                "aten::div",
                [(0.0, 24.8), (0.0, 0.74)],
                "nan (float16)",
                flushed_constant=fx.unheld(operator="aten::clamp", input=0),
            ),
        ),
        # ArcFace: clamp(cos, -1 + 1e-7, 1 - 1e-7) is 1.0 in fp16; acos's backward takes rsqrt(1 - cos^2) = rsqrt(0)
        lambda: fx.evidence(
            fp32=_fp32_forward("head", 1.0),
            localisation=fx.localisation("backward", "head", "aten::rsqrt", [(0.0, 1.0)], "+inf (float32)"),
        ),
    )
    quiet_on = (
        # a divisor that never reaches 0: the NaN comes from elsewhere
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 40.9),
            localisation=fx.localisation(
                "forward", "norm", "aten::div", [(-26.0, 24.8), (0.01, 0.74)], "nan (float16)"
            ),
        ),
        # the module's FP32 output passes 65504: an overflow, activation-overflow's
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 1e6),
            localisation=fx.localisation("forward", "norm", "aten::div", [(-1e6, 1e6), (0.0, 0.74)], "+inf (float16)"),
        ),
        # a log of negative values: NaN in any precision
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 3.0),
            localisation=fx.localisation("forward", "norm", "aten::log", [(-1.0, 2.0)], "nan (float16)"),
        ),
        # not a dividing operator
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 40.9),
            localisation=fx.localisation("forward", "norm", "aten::mm", [(0.0, 0.74)], "+inf (float16)"),
        ),
        # in the loss: loss-in-half's
        lambda: fx.evidence(
            localisation=fx.localisation("loss", "<loss: outside the model>", "aten::log", [(0.0, 1.0)])
        ),
        # a custom Function's hand-written backward: backward-overflow names it (custom_fwd/custom_bwd)
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 3.0),
            localisation=dataclasses.replace(
                fx.localisation("backward", "norm", "aten::reciprocal", [(0.0, 2.0)], "+inf (float16)"),
                custom_function="InvSquare",
            ),
        ),
        # log10(clamp(power, min=1e-10)): the clamp's bound made the argument 0, a constant fp16 cannot hold
        # (constant-out-of-range's), not a divisor the code computed
        lambda: fx.evidence(
            fp32=_fp32_forward("frontend", 1.5),
            localisation=fx.localisation(
                "forward", "frontend", "aten::log10", [(0.0, 40.5)], "-inf (float32)", flushed_constant=fx.unheld()
            ),
        ),
        # x / (d + 1e-10) where the epsilon added made the divisor 0
        lambda: fx.evidence(
            fp32=_fp32_forward("norm", 3.0),
            localisation=fx.localisation(
                "forward",
                "norm",
                "aten::div",
                [(-2.0, 2.0), (0.0, 3.0)],
                "nan (float16)",
                flushed_constant=fx.unheld(operator="aten::add", input=1),
            ),
        ),
    )
    names_cases = (
        lambda: (
            fx.repair("fp32-modules", ["norm"], forward_overflow=True),
            fx.evidence(
                fp32=_fp32_forward("norm", 40.9),
                localisation=fx.localisation(
                    "forward", "norm", "aten::div", [(-26.0, 24.8), (0.0, 0.74)], "nan (float16)"
                ),
            ),
        ),
    )
    suppresses = ("activation-overflow", "scale-overflow", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        loc = ev.localisation
        if loc is None or not fp32_finite(ev) or not self._divides_by_zero(ev, loc):
            return []
        keep = enclosing_fp32_safe(ev, loc.module or "")
        in_root = loc.module == ROOT  # the model's own forward code: no module to keep in fp32 short of all of it
        low, high = loc.input_ranges[DIVISOR_INPUT[loc.operator]]
        peak = module_abs_max(ev.fp32, loc.module or "")
        return [
            self.finding(
                f"A divisor {_reaches_zero(loc)} in {_where(loc)} ({_operator(loc)} at step {loc.step}: its range "
                f"[{low:.3g}, {high:.3g}] reaches 0 -> {loc.output}) while the module's fp32 output stays at {peak:.3g}",
                DivisorUnderflowEvidence(
                    module=loc.module,
                    operator=loc.operator,
                    step=loc.step,
                    batch=loc.batch_index,
                    operator_input_ranges=loc.input_ranges,
                    divisor_range=[low, high],
                    output=loc.output,
                    fp32_abs_max=peak,
                    keep_in_fp32=keep,
                    deterministic=ev.localisation_deterministic,
                ),
                Fix(
                    _fix_summary(loc, keep, in_root),
                    code=(
                        divisor_in_fp32_code(loc)
                        if in_root
                        else fp32_wrapper_code(keep)
                        if loc.phase == "backward"
                        else divisor_in_fp32_code(loc) + "\n\n# or keep the module in fp32:\n" + fp32_wrapper_code(keep)
                    ),
                    config_patch={} if in_root else overrides_patch(fp32_modules=[keep]),
                ),
                confidence=1.0 if ev.localisation_deterministic else 0.6,
            )
        ]

    @staticmethod
    def _divides_by_zero(ev: Evidence, loc: Localisation) -> bool:
        """The localised forward operator divides by a finite range that reaches 0, and nothing overflowed."""
        index = DIVISOR_INPUT.get(loc.operator)
        if (
            loc.phase not in ("forward", "backward")
            or not loc.module
            or loc.module == OUTSIDE_MODEL
            or index is None
            or index >= len(loc.input_ranges)
        ):
            return False
        if loc.phase == "backward" and (loc.custom_function or loc.module == ROOT):
            return False  # a custom Function's hand-written backward: backward-overflow's custom_fwd/custom_bwd fix
        found = unheld_constant(loc)
        if found is not None and found.input == index:
            return False  # a constant fp16 cannot hold made the divisor 0, not a computation: constant-out-of-range's
        low, high = loc.input_ranges[index]
        peak = module_abs_max(ev.fp32, loc.module)
        # a non-negative divisor whose smallest value is 0 (a negative one, or a log's negative argument, is NaN in
        # FP32 as well: not an underflow)
        return low == 0.0 <= high and loc.peak is None and peak is not None and peak < FP16_MAX

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Modules kept in fp32 repaired it, and the fault is a division by a divisor that reached 0 inside them."""
        loc = ev.localisation
        return (
            repair.kind == RepairKind.FP32_MODULES
            and localised_inside(ev, repair.modules)
            and loc is not None
            and self._divides_by_zero(ev, loc)
        )

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        loc = ev.localisation
        assert loc is not None
        return (
            f"A divisor {_reaches_zero(loc)} in {_where(loc)} ({_operator(loc)} at step {loc.step} -> "
            f"{loc.output}); keeping {quoted(repair.modules)} in fp32 repairs the training"
        )

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        keep = quoted(repair.modules)
        return (
            f"Run {keep} in fp32 (autocast off inside it), or use an epsilon fp16 holds (1e-5; 1e-8 is 0 in fp16).",
            fp32_wrapper_code(repair.modules[0]),
        )
