"""A literal constant that fp16 cannot hold meets an fp16 tensor.

Evidence: under AMP only, `masked_fill`/`fill_`/`full` refuse the constant
("value cannot be converted to type at::Half without overflow", e.g. an
attention mask filled with -1e9), with the module whose code raised it; or the
localised first non-finite operator is a cast or fill whose input, or whose
Python number argument, holds a constant of constant-like magnitude (|x| >= 1e8,
e.g. `(1 - mask) * torch.finfo(torch.float32).min`) that becomes inf in fp16. fp16's largest finite value is 65504
(a constant out of fp16's range). An input counts as a constant by how the traced step
made it (a fill or arithmetic on a Python number, not an ``exp`` or a matmul); one the step did not make (a
buffer, a batch field) by its values: a few distinct values beyond fp16's range. A parameter's cast is a weight
fp16 cannot hold, not a constant.

A constant can also be too small: a Python number the traced step gave an operator (a ``clamp`` bound, an epsilon
added, a fill value) that is 0 in fp16 (below about 3e-8, half its smallest subnormal: torchaudio's ``amin=1e-10``)
made the localised forward operator's input exactly 0, and a ``log10``, a division or an ``rsqrt`` of it is
non-finite while FP32 stays finite. The tracer names the constant, the operator given it and its line. A divisor
an operator computed (a norm's sum of squares that flushed) is divisor-underflow's.

The fix keeps the module in fp32, and every other module of its class (the blocks of a stack run the same
code, so the constant meets fp16 in each: keeping the first alone moves the fault to the next). A repair the
intervention search measures by keeping modules around such a constant in fp32 is named this cause.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ...config import overrides_patch
from ...measure.records import ExceptionInfo, FlushedConstant, Localisation
from ...measure.thresholds import CONSTANT_MAGNITUDE, CONSTANT_SPREAD
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind, omitted_when_none
from . import Rule
from ._helpers import (
    class_members,
    fp32_finite,
    library_modules,
    localised_inside,
    module_types,
    quoted,
    role_members,
    unheld_constant,
)

OVERFLOW_MESSAGE = "without overflow"
"""The end of PyTorch's message when a Python scalar does not fit the tensor's dtype."""
CAST_OR_FILL = (
    "aten::_to_copy",
    "aten::to",
    "aten::copy_",
    "aten::masked_fill",
    "aten::fill_",
    "aten::full",
    "aten::where",
    "aten::add",
    "aten::sub",
    "aten::mul",
)


@dataclass(frozen=True)
class ConstantCastEvidence(EvidenceRecord):
    """The localised first non-finite operator: a cast or fill that met a constant beyond fp16's range."""

    operator: str
    constant_magnitude: float
    """The largest magnitude of the constants it met (a constant input's or a Python number's)."""
    constant: float | None
    """The Python number it was called with, when one was of constant-like magnitude; None when the constant came
    in as a tensor."""
    output: str
    module: str | None
    step: int
    batch: int
    same_code_in: list[str] | None = omitted_when_none()
    """The modules that run the same code (every module of its class, or of its place in its owner's class)."""


@dataclass(frozen=True)
class FillRefusedEvidence(EvidenceRecord):
    """AMP's exception: a fill refused a Python constant that fp16 cannot hold."""

    exception: ExceptionInfo
    """AMP's exception (this finding accounts for it)."""
    operator: str
    """Always "a fill with a Python constant": the exception names no operator."""
    dtype: str
    """The dtype the constant did not fit (always float16)."""
    module: str | None
    """The module whose forward raised it, when the exception names one."""
    location: str | None
    """``file:line`` of the user's code that raised it."""
    same_code_in: list[str] | None = omitted_when_none()
    """The modules that run the same code (every module of its class, or of its place in its owner's class)."""


@dataclass(frozen=True)
class UnheldConstantEvidence(EvidenceRecord):
    """The localised first non-finite operator, whose input a Python number that is 0 in fp16 made: exactly 0 where
    the number (a clamp bound, an epsilon, a fill value) was meant to keep it away from 0."""

    operator: str
    constant: float
    """The Python number as the code wrote it (``1e-10``)."""
    constant_in_dtype: float
    """What it is in ``dtype``: 0.0."""
    dtype: str
    made_by: str
    """The operator the constant was given, which made the culprit's input (``aten::clamp``)."""
    location: str | None
    """``file:line`` of the code that gave it, when the tracer saw one outside PyTorch."""
    input_range: tuple[float, float]
    """The [low, high] range of the culprit's input that the constant made."""
    output: str
    module: str | None
    step: int
    batch: int
    deterministic: bool | None
    """Whether the localisation's replay reproduced the fault; None where it was not checked."""
    same_code_in: list[str] | None = omitted_when_none()
    """The modules that run the same code (every module of its class, or of its place in its owner's class)."""


class ConstantOutOfRange(Rule):
    code = "constant-out-of-range"
    order = 45
    evidence_type: ClassVar[type[EvidenceRecord]] = ConstantCastEvidence
    explains = ("amp-exception", "nonfinite", "skips")
    triggers = ("mask_fill_constant.py",)
    fires_on = (
        lambda: fx.evidence(
            amp=fx.probe(
                record=fx.records(
                    exception={
                        "step": 0,
                        "type": "RuntimeError",
                        "module": "attn",
                        "message": "value cannot be converted to type c10::Half without overflow",
                    }
                )
            )
        ),
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation("forward", "attn", "aten::_to_copy", [(-3.4e38, 0.0)], "-inf (float16)"),
        ),
        # scores plus an additive finfo(float32).min mask: one value beyond fp16's range
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward", "attn", "aten::add", [(-8.0, 8.0), (-3.4e38, 0.0)], "-inf (float16)", input_spreads=[0, 1]
            ),
        ),
        # the same mask made inside the step: (1 - mask) * finfo(float32).min carries the constant, whatever its spread
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward",
                "attn",
                "aten::add",
                [(-8.0, 8.0), (-3.4e38, 0.0)],
                "-inf (float16)",
                input_spreads=[0, 9],
                input_constants=[False, True],
            ),
        ),
        # 10 * log10(clamp(power, min=1e-10)): the bound is 0 in fp16, silent frames' power stays 0, log10(0) = -inf
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward", "frontend", "aten::log10", [(0.0, 40.5)], "-inf (float32)", flushed_constant=fx.unheld()
            ),
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(exception={"step": 0, "type": "RuntimeError", "message": "shape mismatch"}))
        ),
        lambda: fx.evidence(localisation=fx.localisation("forward", "attn", "aten::_to_copy", [(-7e4, 7e4)])),
        # a hand-written softmax's exp(scores) times a causal mask: past 1e8, but many distinct values (an activation)
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward", "attn", "aten::mul", [(6.2e-8, 4.9e8)], "+inf (float16)", input_spreads=[64]
            ),
        ),
        # cosine attention at head dim 64: only the diagonal's exp(1/tau) passes 65504, one value, but an exp made it
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward",
                "attn",
                "aten::mul",
                [(0.1, 4.9e8)],
                "+inf (float16)",
                input_spreads=[1],
                input_constants=[False],
            ),
        ),
        # a weight fp16 cannot hold, cast by autocast: a parameter, not a constant in the code
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward",
                "head",
                "aten::_to_copy",
                [(-2e8, 2e8)],
                "+inf (float16)",
                input_spreads=[1],
                parameter="head.bias",
            ),
        ),
        # the clamp's constant made an input that never reaches 0 (the log's -inf came from elsewhere)
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
            localisation=fx.localisation(
                "forward", "frontend", "aten::log10", [(0.5, 40.5)], "-inf (float32)", flushed_constant=fx.unheld()
            ),
        ),
    )
    suppresses = ("activation-overflow", "scale-overflow")
    repairs = (RepairKind.FP32_MODULES,)
    names_cases = (
        lambda: (
            fx.repair("fp32-modules", ["blocks.0.attn", "blocks.1.attn"], forward_overflow=True),
            fx.evidence(
                localisation=fx.localisation(
                    "forward", "blocks.0.attn", "aten::mul", [(0.0, 1.0)], "-inf (float16)", scalars=[-3.4e38]
                )
            ),
        ),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if amp is None or not fp32_finite(ev):
            return []
        exc = amp.exception
        if exc is not None and OVERFLOW_MESSAGE in (exc.message or ""):
            return [
                self._finding(
                    ev,
                    FillRefusedEvidence(
                        exception=exc,
                        operator="a fill with a Python constant",
                        dtype="float16",
                        module=exc.module,
                        location=exc.location,
                    ),
                    exc.module,
                )
            ]
        loc = ev.localisation
        unheld = unheld_constant(loc)
        if loc is not None and unheld is not None:
            return [self._unheld_finding(ev, loc, unheld)]
        constant = _constant_met(loc)
        if loc is None or constant is None:
            return []
        module = loc.module if loc.module and not loc.module.startswith("<") else None
        literal = next((v for v in loc.scalars if abs(v) >= CONSTANT_MAGNITUDE), None)
        return [
            self._finding(
                ev,
                ConstantCastEvidence(
                    operator=loc.operator,
                    constant_magnitude=constant,
                    constant=literal,
                    output=loc.output,
                    module=loc.module,
                    step=loc.step,
                    batch=loc.batch_index,
                ),
                module,
            )
        ]

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Modules kept in fp32 repaired it, and the localised fault is a constant out of fp16's range met inside them."""
        loc = ev.localisation
        return (
            repair.kind == RepairKind.FP32_MODULES
            and localised_inside(ev, repair.modules)
            and (_constant_met(loc) is not None or unheld_constant(loc) is not None)
        )

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        loc = ev.localisation
        assert loc is not None
        unheld = unheld_constant(loc)
        if unheld is not None:
            return f"{_unheld_title(loc, unheld)}; keeping {_kept(repair.modules, repair.module_class)} in fp32 repairs the training"
        return (
            f"A constant beyond fp16's range (65504) meets an fp16 tensor in module '{loc.module}' ({loc.operator} at "
            f"step {loc.step} -> {loc.output}); keeping {_kept(repair.modules, repair.module_class)} in fp32 repairs the training"
        )

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        loc = ev.localisation
        unheld = unheld_constant(loc)
        if loc is not None and unheld is not None:
            kept = _kept(repair.modules, repair.module_class)
            return f"{_unheld_fix(unheld)}; or keep {kept} in fp32.", _unheld_code(loc, unheld)
        return (
            f"Use the dtype's own limit instead of a literal, or a boolean mask (`torch.finfo(scores.dtype).min`); "
            f"or keep {_kept(repair.modules, repair.module_class)} in fp32.",
            MASK_CODE,
        )

    def _unheld_finding(self, ev: Evidence, loc: Localisation, unheld: FlushedConstant) -> Finding:
        """A constant that is 0 in fp16 made the culprit's input exactly 0."""
        module = loc.module if loc.module and not loc.module.startswith("<") else None
        members, owner = _same_code(module, module_types(ev), ev)
        keep = members or ([module] if module else [])
        evidence = UnheldConstantEvidence(
            operator=loc.operator,
            constant=unheld.value,
            constant_in_dtype=unheld.in_dtype,
            dtype=unheld.dtype,
            made_by=unheld.operator,
            location=unheld.location,
            input_range=loc.input_ranges[unheld.input],
            output=loc.output,
            module=loc.module,
            step=loc.step,
            batch=loc.batch_index,
            deterministic=ev.localisation_deterministic,
            same_code_in=members or None,
        )
        kept = f"; or keep {_kept(keep, owner)} in fp32" if keep else ""
        return self.finding(
            _unheld_title(loc, unheld),
            evidence,
            Fix(
                _unheld_fix(unheld) + kept + ".",
                code=_unheld_code(loc, unheld),
                config_patch=overrides_patch(fp32_modules=keep) if keep else {},
            ),
            confidence=1.0 if ev.localisation_deterministic else 0.6,
        )

    def _finding(
        self, ev: Evidence, evidence: ConstantCastEvidence | FillRefusedEvidence, module: str | None
    ) -> Finding:
        where = f" in module '{module}'" if module else ""
        types = module_types(ev)
        members, owner = _same_code(module, types, ev)
        keep = members or ([module] if module else [])
        if members:  # the same code runs in every one of them: the constant meets fp16 in each
            evidence = replace(evidence, same_code_in=members)
        kept = _kept(keep, owner)
        literal = evidence.constant if isinstance(evidence, ConstantCastEvidence) else None
        return self.finding(
            f"A constant beyond fp16's range (65504) meets an fp16 tensor{where}: {evidence.operator}"
            + (f" with {literal:.3g}" if literal is not None else ""),
            evidence,
            Fix(
                "Use the dtype's own limit instead of a literal, or a boolean mask: "
                "`torch.finfo(scores.dtype).min`" + (f"; or keep {kept} in fp32" if keep else "") + ".",
                code=MASK_CODE,
                config_patch=overrides_patch(fp32_modules=keep) if keep else {},
            ),
        )


MASK_CODE = (
    "scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)\n"
    "# not -1e9, nor torch.finfo(torch.float32).min: inf in fp16\n"
    "# or: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)"
)


UNHELD_EXPRESSION = {
    "aten::clamp": "torch.clamp(x.float(), min={v})",
    "aten::clamp_min": "torch.clamp(x.float(), min={v})",
    "aten::clamp_max": "torch.clamp(x.float(), max={v})",
    "aten::add": "x.float() + {v}",
    "aten::add_": "x.float() + {v}",
    "aten::sub": "x.float() - {v}",
    "aten::mul": "x.float() * {v}",
    "aten::masked_fill": "x.float().masked_fill(mask, {v})",
    "aten::where": "torch.where(cond, x.float(), {v})",
}
"""The operator the constant was given, written with its input cast up first, where the constant is not 0."""
DIVIDES = ("aten::div", "aten::div_", "aten::true_divide")


def _unheld_title(loc: Localisation, unheld: FlushedConstant) -> str:
    where = f" in module '{loc.module}'" if loc.module and not loc.module.startswith("<") else f" in {loc.place}"
    at = f" at {unheld.location}" if unheld.location else ""
    low, high = loc.input_ranges[unheld.input]
    return (
        f"A constant fp16 cannot hold{where}: {unheld.value:g} ({unheld.operator}{at}) is {unheld.in_dtype:g} in "
        f"{unheld.dtype}, so {loc.operator}'s input [{low:.3g}, {high:.3g}] reaches it -> {loc.output} at step {loc.step}"
    )


def _unheld_fix(unheld: FlushedConstant) -> str:
    return (
        f"Give {unheld.operator} its constant in fp32, casting the input up first, or use a constant {unheld.dtype} "
        f"holds: {unheld.value:g} is {unheld.in_dtype:g} in {unheld.dtype} (fp16's smallest subnormal is 6e-8; a "
        "floor or epsilon of 1e-5 is usual)"
    )


def _unheld_code(loc: Localisation, unheld: FlushedConstant) -> str:
    """The culprit with the constant's operator computed in fp32 from its input: ``torch.log10(torch.clamp(x.float(),
    min=1e-10))``."""
    made = UNHELD_EXPRESSION.get(unheld.operator, f"torch.{unheld.operator.split('::')[-1]}(x.float(), {{v}})")
    made = made.format(v=f"{unheld.value:g}")
    culprit = loc.operator.split("::")[-1]
    use = f"x / ({made})" if loc.operator in DIVIDES else f"torch.{culprit}({made})"
    at = f"at {unheld.location}: " if unheld.location else ""
    return f"# {at}{unheld.value:g} is 0 in {unheld.dtype}, not in fp32\ny = {use}"


def _constant_met(loc: Localisation | None) -> float | None:
    """The magnitude of the constant the localised forward cast or fill met (an input or a Python number of at
    least ``CONSTANT_MAGNITUDE``), or None when the localised fault is something else (a weight fp16 cannot hold,
    an activation that grew)."""
    if loc is None or loc.operator not in CAST_OR_FILL or loc.phase not in ("forward", "loss") or loc.parameter:
        return None
    magnitudes = [max(abs(lo), abs(hi)) for i, (lo, hi) in enumerate(loc.input_ranges) if _holds_constant(loc, i)]
    magnitudes += [abs(v) for v in loc.scalars]  # a Python number is a constant whatever its size
    constant = max(magnitudes, default=0.0)
    return constant if constant >= CONSTANT_MAGNITUDE else None


def _holds_constant(loc: Localisation, i: int) -> bool:
    """Input ``i`` carries a constant: the traced step made it from one (a fill, arithmetic on a Python number),
    or, where the step did not make it (a buffer, a batch field), its values beyond fp16's range are a few."""
    made = loc.input_constants[i] if len(loc.input_constants) == len(loc.input_ranges) else None
    if made is not None:
        return made
    spread = loc.input_spreads[i] if len(loc.input_spreads) == len(loc.input_ranges) else 0
    return spread <= CONSTANT_SPREAD


def _same_code(module: str | None, types: dict[str, str], ev: Evidence) -> tuple[list[str], str | None]:
    """The modules that run the localised module's code, and how to say them: every module of its class (a user
    class: every Attn), or for a library class (an nn.Linear) the one in its place in every module of its owner's
    class; none (``[]``) when it is the only one."""
    if not module:
        return [], None
    if module in library_modules(ev):
        role = role_members(module, types)
        return (role.members, f"{role.owner}'s {role.place}") if role is not None else ([], None)
    members = class_members(module, types)
    return members, types.get(module) if members else None


def _kept(modules: list[str], module_class: str | None) -> str:
    """The modules a fix keeps in fp32, as the report says them."""
    return f"every {module_class} ({quoted(modules)})" if module_class else quoted(modules)
