"""A module's activations pass fp16's range (65504) while fp32 is fine.

Evidence: the first non-finite AMP operator in the forward pass, its module
and input ranges, and the same module's output magnitude in fp32. The fix
keeps the smallest enclosing module whose fp32 output fits fp16 in fp32.
"""

from __future__ import annotations

from ...measure.localise import OUTSIDE_MODEL
from .. import fixtures as fx
from ..model import Evidence, Finding, Fix
from . import Rule
from ._helpers import enclosing_fp32_safe, fp32_finite, module_abs_max


class ActivationOverflow(Rule):
    code = "activation-overflow"
    order = 60
    explains = ('nonfinite', 'skips')
    triggers = ("bf16_pretrained_ffn.py",)
    fires_on = (lambda: fx.evidence(localisation=fx.localisation("forward", "block.ff")),)
    quiet_on = (lambda: fx.evidence(), lambda: fx.evidence(localisation=fx.localisation("loss", "<loss: outside the model>")))
    suppresses = ("scale-overflow", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        loc = ev.localisation
        if loc is None or loc.phase != "forward" or loc.module in (None, OUTSIDE_MODEL) or not fp32_finite(ev):
            return []
        keep = enclosing_fp32_safe(ev, loc.module)
        peak = module_abs_max(ev.fp32, loc.module)
        if loc.peak is not None:
            size = f": its result reaches {loc.peak:.3g} (fp16 holds 65504)"
        else:
            size = f": the module's fp32 output reaches {peak:.3g}" if peak else ""
        return [self.finding(
            f"Activations overflow fp16 in module '{loc.module}' ({loc.operator}) at step {loc.step}{size}",
            {"module": loc.module, "operator": loc.operator, "step": loc.step, "batch": loc.batch_index,
             "operator_input_ranges": loc.input_ranges, "output": loc.output, "fp32_abs_max": peak,
             "overflowing_value": loc.peak,
             "deterministic": ev.localisation_deterministic, "keep_in_fp32": keep, "note": loc.note},
            Fix(
                f"Run {keep} in fp32 (autocast off inside it), or rescale what overflows (e.g. attention scores by 1/sqrt(d)), or train in bf16.",
                code=(
                    f"class Fp32Block(torch.nn.Module):   # wrap model.{keep}\n"
                    "    def __init__(self, inner):\n        super().__init__(); self.inner = inner\n"
                    "    def forward(self, *args):\n"
                    "        with torch.autocast('cuda', enabled=False):\n"
                    "            return self.inner(*(a.float() for a in args))"
                ),
                config_patch={"overrides": {"fp32_modules": [keep]}},
            ),
            confidence=1.0 if ev.localisation_deterministic else 0.6,
        )]
