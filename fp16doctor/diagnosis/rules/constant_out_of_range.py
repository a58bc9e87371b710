"""A literal constant that fp16 cannot hold meets an fp16 tensor.

Evidence: under AMP only, `masked_fill`/`fill_`/`full` refuse the constant
("value cannot be converted to type at::Half without overflow", e.g. an
attention mask filled with -1e9), with the module whose code raised it; or the
localised first non-finite operator is a cast or fill whose input, or whose
Python number argument, holds a constant of constant-like magnitude (|x| >= 1e8,
e.g. `(1 - mask) * torch.finfo(torch.float32).min`) that becomes inf in fp16. fp16's largest finite value is 65504
(mixed-precision-notes.md, "Constants out of fp16 range").
"""

from __future__ import annotations

from typing import Any

from ...measure.thresholds import CONSTANT_MAGNITUDE
from .. import fixtures as fx
from ..model import Evidence, Finding, Fix
from . import Rule
from ._helpers import fp32_finite

OVERFLOW_MESSAGE = "without overflow"
"""The end of PyTorch's message when a Python scalar does not fit the tensor's dtype."""
CAST_OR_FILL = ("aten::_to_copy", "aten::to", "aten::copy_", "aten::masked_fill", "aten::fill_", "aten::full",
                "aten::where", "aten::add", "aten::sub", "aten::mul")


class ConstantOutOfRange(Rule):
    code = "constant-out-of-range"
    order = 45
    explains = ("amp-exception", "nonfinite", "skips")
    triggers = ("mask_fill_constant.py",)
    fires_on = (
        lambda: fx.evidence(amp=fx.probe(record=fx.records(exception={"step": 0, "type": "RuntimeError", "module": "attn",
                                                                     "message": "value cannot be converted to type c10::Half without overflow"}))),
        lambda: fx.evidence(amp=fx.probe(record=fx.records(nonfinite_loss=[0])),
                            localisation=fx.localisation("forward", "attn", "aten::_to_copy", [(-3.4e38, 0.0)], "-inf (float16)")),
    )
    quiet_on = (
        lambda: fx.evidence(amp=fx.probe(record=fx.records(exception={"step": 0, "type": "RuntimeError", "message": "shape mismatch"}))),
        lambda: fx.evidence(localisation=fx.localisation("forward", "attn", "aten::_to_copy", [(-7e4, 7e4)])),
    )
    suppresses = ("activation-overflow", "scale-overflow")

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if amp is None or not fp32_finite(ev):
            return []
        exc = amp.exception
        if exc is not None and OVERFLOW_MESSAGE in (exc.message or ""):
            return [self._finding(ev, {"exception": exc, "operator": "a fill with a Python constant",
                                       "dtype": "float16", "module": exc.module, "location": exc.location},
                                  exc.module)]
        loc = ev.localisation
        if loc is None or loc.operator not in CAST_OR_FILL or loc.phase not in ("forward", "loss"):
            return []
        magnitudes = [max(abs(lo), abs(hi)) for lo, hi in loc.input_ranges] + [abs(v) for v in loc.scalars]
        constant = max(magnitudes, default=0.0)
        if constant < CONSTANT_MAGNITUDE:
            return []
        module = loc.module if loc.module and not loc.module.startswith("<") else None
        literal = next((v for v in loc.scalars if abs(v) >= CONSTANT_MAGNITUDE), None)
        return [self._finding(ev, {"operator": loc.operator, "constant_magnitude": constant, "constant": literal,
                                   "output": loc.output, "module": loc.module, "step": loc.step, "batch": loc.batch_index}, module)]

    def _finding(self, ev: Evidence, evidence: dict[str, Any], module: str | None) -> Finding:
        where = f" in module '{module}'" if module else ""
        patch = {"overrides": {"fp32_modules": [module]}} if module else {}
        return self.finding(
            f"A constant beyond fp16's range (65504) meets an fp16 tensor{where}: {evidence['operator']}"
            + (f" with {evidence['constant']:.3g}" if evidence.get("constant") is not None else ""),
            evidence,
            Fix(
                "Use the dtype's own limit instead of a literal, or a boolean mask: "
                "`torch.finfo(scores.dtype).min`" + (f"; or keep '{module}' in fp32" if module else "") + ".",
                code=("scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)   # not -1e9\n"
                      "# or: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)       # a boolean mask"),
                config_patch=patch,
            ),
        )
