"""The loss (softmax, log, exp) computed in half precision.

Evidence: the first non-finite operator ran in the loss, outside the model,
on half-precision tensors, in its forward or in its backward before the
gradient reached the model, there with a result past 65504 even divided by
the loss scale its backward ran with (a focal loss's 1 / p_t of a probability fp16 rounded to its
smallest subnormal: no scale carries it, where the scaler's calibration
overflows only by its scale), or the loss came out in half, or CUDA
autocast refused binary_cross_entropy, while fp32 is finite. In a capsule of a watched
script, whose loss code the replay does not hold: the watch saw a finite loss
whose gradient w.r.t. the model's outputs held inf/NaN (made in the loss's
backward), or a non-finite loss, and the model itself replays finite in FP32
and under AMP on the same weights and batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ...config import overrides_patch
from ...measure.records import OUTSIDE_MODEL, ExceptionInfo, Localisation
from ...measure.symptoms import excess_skips, first_nonfinite, skip_profile
from ...tensors import FP16_MAX
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind
from . import Rule
from ._helpers import LOW_DTYPES, fp32_finite

OUTSIDE_AUTOCAST_FIX = (
    "Compute the loss in fp32 with autocast off: outside the autocast block, or inside "
    "torch.autocast('cuda', enabled=False), and on the model's outputs cast up to fp32. Casting up alone is not "
    "enough where autocast is still on: it runs the loss's own matrix products in fp16 again (a Gram matrix, "
    "an InfoNCE similarity divided by its temperature).",
    "with torch.autocast('cuda', dtype=torch.float16):\n"
    "    out = model(x)\n"
    "with torch.autocast('cuda', enabled=False):  # the loss's products, divisions, exp/log in fp32\n"
    "    loss = loss_fn(out.float(), y)",
)
"""The fix for a loss that breaks on half-precision values, whatever operator broke."""
BCE_FIX = (
    "Drop the sigmoid and use F.binary_cross_entropy_with_logits (or nn.BCEWithLogitsLoss) on the logits: it is "
    "stable in any precision and autocast runs it in fp32. CUDA autocast refuses F.binary_cross_entropy. "
    "The fix the doctor tried (the config patch) computes the loss outside autocast instead (loss_in_fp32).",
    "logits = model(x)              # no torch.sigmoid at the end\n"
    "loss = F.binary_cross_entropy_with_logits(logits, y)   # not F.binary_cross_entropy(torch.sigmoid(logits), y)",
)
"""The fix for CUDA autocast's refusal of binary_cross_entropy."""
BCE_REFUSAL = "unsafe to autocast"
"""Part of the message CUDA autocast (and the doctor's CPU emulation of it) raises for binary_cross_entropy."""


@dataclass(frozen=True)
class HalfLossEvidence(EvidenceRecord):
    """The dtypes the AMP probe's loss came out in (each shape of this rule's evidence adds what broke)."""

    loss_dtypes: list[str]
    """The dtypes of the loss the AMP probe's steps returned."""


@dataclass(frozen=True)
class LossOverflowEvidence(HalfLossEvidence):
    """The first non-finite operator, traced to the loss computation outside the model, on half-precision values."""

    operator: str
    step: int
    batch: int
    phase: str
    """``loss`` (the loss's forward) or ``backward`` (its backward, before the gradient reached the model)."""
    operator_input_ranges: list[tuple[float, float]]
    """The (min, max) of each of the operator's inputs."""
    output: str
    """What came out: inf/NaN and its dtype."""


@dataclass(frozen=True)
class BceRefusedEvidence(HalfLossEvidence):
    """CUDA autocast (or the doctor's emulation of it) refused binary_cross_entropy on half probabilities."""

    exception: ExceptionInfo
    """AMP's exception: the refusal (this finding accounts for it)."""


@dataclass(frozen=True)
class HalfLossGapEvidence(HalfLossEvidence):
    """A loss computed in half precision, and AMP deviating from fp32 past tolerance from the same states."""

    same_state_gap: float
    """AMP's largest relative loss deviation from fp32 from the same states."""


@dataclass(frozen=True)
class RecordedLossEvidence(EvidenceRecord):
    """A capsule's watch recorded a non-finite loss or loss gradient, from loss code the replay does not hold."""

    recorded: str | None
    """What the watch saw, in a sentence."""


class LossInHalf(Rule):
    code = "loss-in-half"
    order = 50
    evidence_type: ClassVar[type[EvidenceRecord]] = LossOverflowEvidence
    explains = ("nonfinite", "skips", "amp-exception", "same-state-gap", "trajectory-drift")
    repairs = (RepairKind.LOSS_FP32, RepairKind.BF16)
    names_cases = (
        lambda: (
            fx.repair("loss-fp32"),
            fx.evidence(
                localisation=fx.localisation("loss", "<loss: outside the model>", "aten::log", output="-inf (float32)")
            ),
        ),
    )
    triggers = ("loss_in_half.py",)
    fires_on = (
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(nonfinite_loss=[0]), loss_dtypes=["float16"]),
            localisation=fx.localisation("loss", "<loss: outside the model>", "aten::exp", output="+inf (float16)"),
        ),
        # a focal loss on fp16 probabilities: its backward divides by p_t, which fp16 rounded to 6e-8; at
        # scale 2 its result reached 5.2e5, past 65504 even unscaled
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(skipped=range(16), scales=[2.0] * 16)),
            localisation=fx.localisation(
                "backward",
                "<loss: outside the model>",
                "aten::div",
                [(5.96e-08, 0.64)],
                output="-inf (float16)",
                peak=5.2e5,
                loss_scale=2.0,
            ),
        ),
        # the same loss in a step that never calls scaler.scale: the configured 65536 is not what it ran at
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(skipped=range(16)), scaler_called=False),
            localisation=fx.localisation(
                "backward",
                "<loss: outside the model>",
                "aten::div",
                [(5.96e-08, 0.64)],
                output="-inf (float16)",
                peak=1e5,
                loss_scale=1.0,
            ),
        ),
        lambda: fx.evidence(
            recorded_loss_finding="the loss is finite but its gradient w.r.t. the model's outputs is not"
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            localisation=fx.localisation("loss", "<loss: outside the model>", "aten::exp", output="+inf (float32)")
        ),
        # a capsule of a compiled run: eager replays finite, but the model as the run compiled it does not
        lambda: fx.evidence(
            recorded_loss_finding="the loss is NaN",
            compiled=fx.compiled_comparison(compiled_with="team.fusing_backend"),
        ),
        # the scaler's calibration: the loss's backward overflows at 65536 and the skips stop, no symptom
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(skipped=[0])),
            localisation=fx.localisation(
                "backward", "<loss: outside the model>", "aten::div_", [(0.0, 65536.0)], output="+inf (float16)"
            ),
        ),
        # the calibration overflow at 2^24 in a run a stray plain optimizer step made non-finite: unscaled,
        # its result is 0.009; the loss is not what broke
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(skipped=range(10), nonfinite_loss=range(10), scales=[2.0**24] * 10)),
            localisation=fx.localisation(
                "backward",
                "<loss: outside the model>",
                "aten::div_",
                [(8.6e6, 9.4e6)],
                output="+inf (float16)",
                peak=1.47e5,
                loss_scale=2.0**24,
            ),
        ),
        # a backward that overflows inside the model: the model's, not the loss's
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(skipped=range(16))),
            localisation=fx.localisation("backward", "head", "aten::mm", output="+inf (float16)"),
        ),
    )
    suppresses = ("activation-overflow", "scale-overflow", "precision-gap", "scheduler-skip-drift")

    nothing_to_try = (
        "the loss code is not in what the doctor runs (a capsule replays the model, driven by the recorded "
        "gradient of the loss), so there is nothing it can apply"
    )

    def check(self, ev: Evidence) -> list[Finding]:
        amp, loc = ev.amp, ev.localisation
        if amp is None or not fp32_finite(ev):
            return []
        if (
            ev.recorded_loss_finding
            and not amp.exception
            and amp.finite
            and not amp.skip_steps
            and not ev.only_compiled_fails()  # the model as the run compiled it fails: its inf, not the loss's
        ):
            return [self._recorded(ev)]  # the model replays finite: what failed is the loss (else the model's own
            # fault is for the other rules, and the note still says what the loss gradient held)
        evidence: HalfLossEvidence
        if (
            loc is not None
            and in_the_loss(loc)
            and any(d in loc.output for d in LOW_DTYPES)
            and (loc.phase == "loss" or loss_backward_fault(amp.records, loc))
        ):
            evidence = LossOverflowEvidence(
                loss_dtypes=amp.loss_dtypes,
                operator=loc.operator,
                step=loc.step,
                batch=loc.batch_index,
                phase=loc.phase,
                operator_input_ranges=loc.input_ranges,
                output=loc.output,
            )
            title = (
                f"The loss overflows in half precision: {loc.operator} outside the model"
                f"{'' if loc.phase == 'loss' else ', in its backward,'} at step {loc.step} -> {loc.output}"
            )
        elif amp.exception and BCE_REFUSAL in (amp.exception.message or ""):
            evidence = BceRefusedEvidence(loss_dtypes=amp.loss_dtypes, exception=amp.exception)
            title = "binary_cross_entropy on half-precision probabilities: CUDA autocast refuses it"
        elif any(d in LOW_DTYPES for d in amp.loss_dtypes) and ev.gap is not None and ev.gap.exceeded:
            evidence = HalfLossGapEvidence(loss_dtypes=amp.loss_dtypes, same_state_gap=ev.gap.gap)
            title = f"The loss is computed in {'/'.join(amp.loss_dtypes)} and AMP deviates {ev.gap.gap:.2%} from fp32"
        else:
            return []
        summary, code = self._fix_for(ev)
        return [self.finding(title, evidence, Fix(summary, code=code, config_patch=overrides_patch(loss_in_fp32=True)))]

    def _recorded(self, ev: Evidence) -> Finding:
        """A capsule's loss gradient, non-finite as the watch recorded it, from a loss the replay cannot run."""
        return self.finding(
            "The loss computation, outside the model, makes the step non-finite: the watch recorded inf/NaN in the "
            "loss or its gradient w.r.t. the model's outputs, and the model itself replays finite under AMP",
            RecordedLossEvidence(recorded=ev.recorded_loss_finding),
            Fix(
                "Compute the loss from the model's outputs in fp32 and in a stable form: F.cross_entropy or F.log_softmax "
                "instead of log(softmax(z) + eps) (an eps of 1e-8 is 0 in fp16), torch.logsumexp instead of "
                "log(sum(exp(z))), F.binary_cross_entropy_with_logits instead of a hand-written BCE; cast the outputs up first.",
                code="with torch.autocast('cuda', dtype=torch.float16):\n    logits = model(x)\n"
                "loss = F.cross_entropy(logits.float(), y)   # not torch.log(torch.softmax(logits, -1) + 1e-8)",
            ),
            confidence=0.6,
        )  # no config patch: the loss code is not in the capsule, so the verification has nothing to try

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """The loss computed in fp32 repaired it, also when the op that made the inf ran in fp32 itself: the
        damage was done before it, by half-precision values rounded on their way into the loss."""
        loc = ev.localisation
        return repair.kind == RepairKind.LOSS_FP32 or (
            repair.kind == RepairKind.BF16 and loc is not None and loc.phase == "loss"
        )

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        loc = ev.localisation
        where = (
            f": {loc.operator} in the loss{'' if loc.phase == 'loss' else ' (backward)'} at step {loc.step} -> "
            f"{loc.output}"
            if loc is not None and in_the_loss(loc)
            else ""
        )
        return f"The loss breaks on half-precision values{where}; computing the loss in fp32 repairs the training"

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        return self._fix_for(ev)

    @staticmethod
    def _fix_for(ev: Evidence) -> tuple[str, str]:
        """The fix for the operator that broke (a log of a rounded probability, an exp past 11.09, CUDA's refusal
        of binary_cross_entropy), else the loss in fp32 with autocast off."""
        if ev.amp is not None and ev.amp.exception and BCE_REFUSAL in (ev.amp.exception.message or ""):
            return BCE_FIX
        loc = ev.localisation
        op = (loc.operator if loc is not None else "").split("::")[-1].split(".")[0]
        if op in ("log", "log1p", "log2", "log10", "xlogy"):
            return (
                "Compute the loss from the logits in a numerically stable form: fp16 rounds a probability near 1 to "
                "exactly 1 (and near 0 to 0), so log(p) or log(1 - p) meets log(0). Use F.logsigmoid(z) for "
                "log(sigmoid(z)) and F.logsigmoid(-z) for log(1 - sigmoid(z)), F.binary_cross_entropy_with_logits "
                "instead of a hand-written BCE, F.log_softmax / F.cross_entropy instead of log(softmax(z)); at the "
                "least cast the logits to fp32 first. An epsilon added to a half probability must be one fp16 holds "
                "(>= 6.1e-5 near 0; near 1 there is no room below 4.9e-4).",
                "logits = model(x)                     # under autocast\n"
                "# binary: not -(y*log(p) + (1-y)*log(1-p))\n"
                "loss = F.binary_cross_entropy_with_logits(logits.float(), y)\n"
                "# multi-class, or an entropy: not torch.log(softmax(logits)) or log(p + eps)\n"
                "logp = F.log_softmax(logits.float(), dim=-1)   # then F.nll_loss(logp, y), -(logp.exp() * logp).sum(-1)",
            )
        if op in ("exp", "expm1", "pow"):
            return (
                "Compute the loss in fp32 and in a stable form: torch.logsumexp instead of log(sum(exp(z))), "
                "F.softplus instead of log(1 + exp(z)); exp overflows fp16 past 11.09.",
                "loss = torch.logsumexp(logits.float(), dim=-1).mean()",
            )
        return OUTSIDE_AUTOCAST_FIX


def in_the_loss(loc: Localisation) -> bool:
    """The traced culprit ran in the loss computation: its forward, or its backward before the gradient reached the
    model's output (the tracer names no module there)."""
    return loc.phase == "loss" or (loc.phase == "backward" and loc.module == OUTSIDE_MODEL)


def loss_backward_fault(records: Any, loc: Localisation) -> bool:
    """A loss's backward that overflowed is the loss's fault only where the scaler did not push it there,
    measured: its result divided by the scale the traced step's backward ran with (1 for a plain
    ``loss.backward()``) still overflows fp16, so even unscaled fp16 cannot hold it (a focal loss's 1 / p_t of a
    probability rounded to 6e-8), and the run shows it (non-finite, or skips beyond the scale's calibration). A
    result that only the scale pushed past 65504 is the scaler's calibration (its first gradients times 2^16 or
    2^24), whatever else turned the run non-finite (a stray plain optimizer step). Without a measured peak or
    scale, the run's symptoms alone decide."""
    if not (first_nonfinite(records) is not None or excess_skips(skip_profile(records))):
        return False
    peak, scale = loc.peak, loc.loss_scale
    if peak is None or not math.isfinite(peak) or scale is None or not scale > 0:
        return True
    return peak / scale >= FP16_MAX
