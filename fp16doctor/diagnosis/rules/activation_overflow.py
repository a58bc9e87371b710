"""A module's activations pass fp16's range (65504) while fp32 is fine.

Evidence: the first non-finite AMP operator in the forward pass, its module
and input ranges, and the same module's output magnitude in fp32. The fix
keeps the smallest enclosing module whose fp32 output fits fp16 in fp32; where the
overflow is in the model's own forward code, outside every submodule, the fix is
that arithmetic in fp32 (keeping the root in fp32 is AMP off), and where that
arithmetic is a matrix product with a factor measured in [0, 1] (a masked
mean as bmm(mask, h)), a sum that grows with its length, weighted before
summing. A NaN the culprit
made from finite inputs inside fp16's range (a variance that cancellation drove
below 0, under a square root) is no overflow: rounding's, not this rule's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from ...measure.records import OUTSIDE_MODEL, ROOT, Localisation
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind
from . import Rule
from ._helpers import (
    enclosing_fp32_safe,
    fp32_finite,
    fp32_wrapper_code,
    library_modules,
    module_abs_max,
    quoted,
)


@dataclass(frozen=True)
class ActivationOverflowEvidence(EvidenceRecord):
    """The localised operator whose result passed fp16's range in a submodule, and that module's FP32 output."""

    module: str
    operator: str
    step: int
    batch: int
    operator_input_ranges: list[tuple[float, float]]
    output: str
    fp32_abs_max: float | None
    """The module's largest forward output magnitude in the FP32 run; None where not recorded."""
    overflowing_value: float | None
    """The largest magnitude of the result that overflowed when rounded to fp16; None where it was not seen."""
    deterministic: bool | None
    """Whether the localisation's replay reproduced the fault; None where it was not checked."""
    keep_in_fp32: str
    """The module the fix keeps in fp32: the culprit, or its nearest ancestor whose FP32 output fits fp16."""
    note: str


@dataclass(frozen=True)
class RootCodeOverflowEvidence(EvidenceRecord):
    """The localised operator whose result passed fp16's range in the model's own forward, outside its submodules."""

    module: str
    operator: str
    step: int
    batch: int
    operator_input_ranges: list[tuple[float, float]]
    output: str
    overflowing_value: float | None
    """The largest magnitude of the result that overflowed when rounded to fp16; None where it was not seen."""
    deterministic: bool | None
    """Whether the localisation's replay reproduced the fault; None where it was not checked."""
    note: str


class ActivationOverflow(Rule):
    code = "activation-overflow"
    order = 60
    evidence_type: ClassVar[type[EvidenceRecord]] = ActivationOverflowEvidence
    explains = ("nonfinite", "skips")
    repairs = (RepairKind.FP32_MODULES, RepairKind.BF16)
    names_cases = (
        lambda: (
            fx.repair(
                "fp32-modules", ["blocks.0", "blocks.1"], forward_overflow=True, scope="class", module_class="Block"
            ),
            fx.evidence(localisation=fx.localisation("forward", "blocks.1")),
        ),
    )
    triggers = ("bf16_pretrained_ffn.py",)
    fires_on = (
        lambda: fx.evidence(localisation=fx.localisation("forward", "block.ff")),
        # the model's own forward un-normalises its output: z * 8e4 + 2.4e5 in fp16
        lambda: fx.evidence(
            localisation=fx.localisation("forward", "<root>", "aten::mul", [(-2.0, 2.0)], scalars=[8e4])
        ),
        # a masked mean pooling written as bmm(mask, h): the sum over 2048 tokens passes 65504 in fp16
        lambda: fx.evidence(
            localisation=fx.localisation(
                "forward", "<root>", "aten::bmm", [(1.0, 1.0), (-163.0, 186.0)], "+inf/-inf (float16)", peak=9.56e4
            )
        ),
    )
    quiet_on = (
        lambda: fx.evidence(),
        lambda: fx.evidence(localisation=fx.localisation("loss", "<loss: outside the model>")),
        # a one-pass variance E[x^2] - E[x]^2 rounded below 0, then sqrt: NaN inside fp16's range
        lambda: fx.evidence(
            localisation=fx.localisation("forward", "norm", "aten::sqrt", [(-16.0, 16.0)], "nan (float16)")
        ),
    )
    suppresses = ("scale-overflow", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        loc = ev.localisation
        if (
            loc is None
            or loc.phase != "forward"
            or loc.module in (None, OUTSIDE_MODEL)
            or not loc.overflowed
            or not fp32_finite(ev)
        ):
            return []  # a NaN made inside fp16's range is rounding's (precision-gap, divisor-underflow)
        if loc.module == ROOT:
            return [self._in_root_code(ev, loc)]
        keep = enclosing_fp32_safe(ev, loc.module)
        peak = module_abs_max(ev.fp32, loc.module)
        if loc.peak is not None:
            size = f": its result reaches {loc.peak:.3g} (fp16 holds 65504)"
        else:
            size = f": the module's fp32 output reaches {peak:.3g}" if peak else ""
        return [
            self.finding(
                f"Activations overflow fp16 in module '{loc.module}' ({loc.operator}) at step {loc.step}{size}",
                ActivationOverflowEvidence(
                    module=loc.module,
                    operator=loc.operator,
                    step=loc.step,
                    batch=loc.batch_index,
                    operator_input_ranges=loc.input_ranges,
                    output=loc.output,
                    fp32_abs_max=peak,
                    overflowing_value=loc.peak,
                    deterministic=ev.localisation_deterministic,
                    keep_in_fp32=keep,
                    note=loc.note,
                ),
                Fix(
                    f"Run '{keep}' in fp32 (autocast off inside it), or rescale what overflows (e.g. attention scores by 1/sqrt(d)), or train in bf16.",
                    code=fp32_wrapper_code(keep),
                    config_patch=overrides_patch(fp32_modules=[keep]),
                ),
                confidence=1.0 if ev.localisation_deterministic else 0.6,
            )
        ]

    def _in_root_code(self, ev: Evidence, loc: Localisation) -> Finding:
        """The overflow is in the model's own forward, outside every submodule: no module can be kept in fp32 short
        of the whole model (AMP off), so the fix is the arithmetic there, in fp32."""
        size = f": its result reaches {loc.peak:.3g} (fp16 holds 65504)" if loc.peak is not None else ""
        summing = sums_by_product(loc)
        fix = (
            Fix(
                f"The product ({loc.operator.split('::')[-1]}) sums many values: one of its operands holds only values "
                "in [0, 1] (a mask, weights), so fp16 accumulates a sum it cannot hold. Weight before summing (a "
                "masked mean as (mask / mask.sum(1, keepdim=True)) @ h adds averages, not values), or run the "
                "product on fp32 values and keep its result fp32; or train in bf16.",
                code=SUM_BY_PRODUCT_CODE,
            )
            if summing
            else Fix(
                f"Compute that arithmetic ({loc.operator.split('::')[-1]}) in fp32: cast up before it and keep the "
                "result fp32 (a model whose outputs pass 65504 cannot return them in fp16), or bound what grows: a "
                "learnable scale or temperature is clamped (CLIP clamps logit_scale.exp() to 100), outputs in "
                "raw units are un-normalised outside the model; or train in bf16.",
                code=ROOT_FP32_CODE,
            )
        )
        return self.finding(
            f"Activations overflow fp16 in {loc.place} ({loc.operator} at step {loc.step}){size}",
            RootCodeOverflowEvidence(
                module=ROOT,  # loc.module, which check() tested
                operator=loc.operator,
                step=loc.step,
                batch=loc.batch_index,
                operator_input_ranges=loc.input_ranges,
                output=loc.output,
                overflowing_value=loc.peak,
                deterministic=ev.localisation_deterministic,
                note=loc.note,
            ),
            fix,
            confidence=1.0 if ev.localisation_deterministic else 0.6,
        )

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Modules kept in fp32 repaired it, and their forward output had left fp16's range under AMP (or bf16,
        fp32's range, repaired a forward fault)."""
        loc = ev.localisation
        if repair.kind == RepairKind.BF16:
            return loc is not None and loc.phase == "forward"
        return repair.kind == RepairKind.FP32_MODULES and repair.forward_overflow

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        loc = ev.localisation
        where = f" ({loc.operator} in {loc.place} at step {loc.step})" if loc is not None and loc.module else ""
        if repair.kind == RepairKind.BF16:
            return f"Activations overflow fp16{where}; bf16, with fp32's range, repairs the training"
        what = (
            f"every {repair.module_class} ({len(repair.modules)} modules)"
            if repair.module_class
            else quoted(repair.modules)
        )
        return f"Activations overflow fp16{where}; keeping {what} in fp32 repairs the training"

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        loc = ev.localisation
        if repair.kind == RepairKind.BF16 and loc is not None and loc.module == ROOT:
            return (
                "Train in bfloat16 (fp32's range; no loss scaling), or compute the arithmetic in the model's own "
                "forward that overflows in fp32 (cast up before it and keep the result fp32).",
                ROOT_FP32_CODE,
            )
        if repair.kind == RepairKind.BF16:
            return "Train in bfloat16 (fp32's range; no loss scaling), or keep the overflowing blocks in fp32.", ""
        if repair.module_class:
            return (
                f"Run every {repair.module_class} in fp32: autocast off inside its forward, inputs cast up (the one "
                "that overflowed first alone did not repair: another overflowed in its place). Or rescale what grows (a residual gain, attention scores by "
                "1/sqrt(d)), or train in bf16.",
                fp32_wrapper_code(
                    repair.module_class, per_class=True, library=repair.modules[0] in library_modules(ev)
                ),
            )
        keep = quoted(repair.modules)
        several = len(repair.modules) > 1
        return (
            f"Run {keep} in fp32 (autocast off inside {'each' if several else 'it'}), or rescale what overflows, or train in bf16.",
            fp32_wrapper_code(f"each of {keep}" if several else repair.modules[0]),
        )


PRODUCT_FACTORS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1}
"""The aten matrix products (what ``@``, ``matmul``, ``einsum`` and ``linear`` dispatch to), by where their
factors start: the ``add*`` forms take the term they add first."""


def sums_by_product(loc: Localisation) -> bool:
    """The overflowing operator is a matrix product one of whose factors held only values in [0, 1], not all
    zero, measured (a 0/1 mask, averaging weights): a sum written as a product, that grows with the length it
    sums over. The term an ``addmm`` adds (a bias, zero at initialisation) is no factor."""
    first = PRODUCT_FACTORS.get(loc.operator.split("::")[-1].split(".")[0])
    if first is None:
        return False
    return any(0.0 <= low and 0.0 < high <= 1.0 for low, high in loc.input_ranges[first : first + 2])


SUM_BY_PRODUCT_CODE = (
    "# a masked sum as a product grows with the length: weight first, so it sums averages\n"
    "weights = mask / mask.sum(1, keepdim=True)\n"
    "pooled = torch.bmm(weights.unsqueeze(1).to(h.dtype), h).squeeze(1)   # not bmm(mask, h) / lengths"
)

ROOT_FP32_CODE = (
    "# in the model's own forward, where it overflows: cast up first, keep fp32\n"
    "y = z.float() * scale + shift   # in fp16, z * scale passes 65504"
)
