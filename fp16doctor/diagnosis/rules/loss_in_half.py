"""The loss (softmax, log, exp) computed in half precision.

Evidence: the first non-finite operator ran in the loss, outside the model,
on half-precision tensors (or the loss came out in half, or CUDA autocast
refused binary_cross_entropy), while fp32 is finite.
"""

from __future__ import annotations

from .. import fixtures as fx
from ..model import Evidence, Finding, Fix
from . import Rule
from ._helpers import LOW_DTYPES, fp32_finite


class LossInHalf(Rule):
    code = "loss-in-half"
    order = 50
    explains = ('nonfinite', 'skips', 'same-state-gap', 'trajectory-drift')
    triggers = ("loss_in_half.py",)
    fires_on = (lambda: fx.evidence(amp=fx.probe(record=fx.records(nonfinite_loss=[0]), loss_dtypes=["float16"]),
                                    localisation=fx.localisation("loss", "<loss: outside the model>", "aten::exp", output="+inf (float16)")),)
    quiet_on = (lambda: fx.evidence(localisation=fx.localisation("loss", "<loss: outside the model>", "aten::exp", output="+inf (float32)")),)
    suppresses = ("activation-overflow", "scale-overflow", "precision-gap", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        amp, loc = ev.amp, ev.localisation
        if amp is None or not fp32_finite(ev):
            return []
        evidence = {"loss_dtypes": amp.loss_dtypes}
        if loc is not None and loc.phase == "loss" and any(d in loc.output for d in LOW_DTYPES):
            evidence.update({"operator": loc.operator, "step": loc.step, "batch": loc.batch_index,
                             "operator_input_ranges": loc.input_ranges, "output": loc.output})
            title = f"The loss overflows in half precision: {loc.operator} outside the model at step {loc.step} -> {loc.output}"
        elif amp.exception and "unsafe to autocast" in (amp.exception["message"] or ""):
            evidence["exception"] = amp.exception
            title = "binary_cross_entropy on half-precision probabilities: CUDA autocast refuses it"
        elif any(d in LOW_DTYPES for d in amp.loss_dtypes) and ev.gap and ev.gap["gap"] > ev.gap["tolerance"]:
            evidence.update({"same_state_gap": ev.gap["gap"]})
            title = f"The loss is computed in {'/'.join(amp.loss_dtypes)} and AMP deviates {ev.gap['gap']:.2%} from fp32"
        else:
            return []
        return [self.finding(
            title, evidence,
            Fix(
                "Compute the loss in fp32, outside autocast: cast the logits up first.",
                code=(
                    "with torch.autocast('cuda', dtype=torch.float16):\n"
                    "    logits = model(x)\n"
                    "loss = loss_fn(logits.float(), y)   # softmax/log/exp in fp32"
                ),
                config_patch={"overrides": {"loss_in_fp32": True}},
            ),
        )]
