"""The loss does not change: the FP32 baseline's loss is the same number, to the last bit, at every step.

Evidence: the FP32 probe's per-step losses (every step finite, at least three of them, all equal). Real
trainings on varying batches never repeat a loss bit for bit; a constant one means nothing is trained: a
loss that does not depend on the weights, zero gradients, or the wrong loss. The usual cause is the
doctor's default loss on a model it does not fit: ``cross_entropy(model(x), y)`` over a single output
(a regression head, one logit) is exactly 0, whatever the weights (softmax over one class is 1). Measured,
not guessed: the FP32 baseline shows it. A warning: nothing about precision is wrong, but a diagnosis of a
training that trains nothing says little.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule
from ._helpers import fp32_losses

MIN_STEPS = 3
"""At least this many steps with the same loss: one or two equal values are no evidence."""


@dataclass(frozen=True)
class ConstantLossEvidence(EvidenceRecord):
    """The FP32 baseline's per-step losses, every one the same number to the last bit."""

    probe: str
    """The probe whose losses these are (``fp32``)."""
    steps: int
    loss: float
    """The one value every step's loss has."""
    losses: list[float]
    """The first ten steps' losses."""
    default_loss: bool
    """The doctor computed its default loss (the file defines no ``loss()`` or ``train_step()``)."""


class ConstantLoss(Rule):
    code = "constant-loss"
    severity = Severity.WARNING
    """Measured, but no mixed-precision fault: the warning asks whether the loss is the one meant."""
    order = 6
    evidence_type: ClassVar[type[EvidenceRecord]] = ConstantLossEvidence
    verifiable = False
    fires_on = (
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(losses=[0.0] * 10)), uses_default_loss=True),
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(losses=[0.6931471824645996] * 10))),
    )
    quiet_on = (
        lambda: fx.evidence(),  # a falling loss
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(losses=[0.0] * 9 + [1e-30]))),  # not to the last bit
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(steps=2, losses=[0.0, 0.0]))),  # too short to tell
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(nonfinite_loss=range(10)))),
    )  # NaN throughout: another cause

    nothing_to_try = "the fix is the loss in the training file; no precision setting changes a constant loss"

    def check(self, ev: Evidence) -> list[Finding]:
        losses = fp32_losses(ev, MIN_STEPS)
        if losses is None or any(v != losses[0] for v in losses):
            return []
        value = losses[0]
        evidence = ConstantLossEvidence(
            probe="fp32",
            steps=len(losses),
            loss=value,
            losses=losses[:10],
            default_loss=ev.uses_default_loss,
        )
        summary = (
            "Check that the loss depends on the model's output and the targets the way you meant, and that "
            "the parameters it depends on are trained; then diagnose again."
        )
        code = ""
        if ev.uses_default_loss:
            summary = (
                "The doctor computed its default loss (no loss() or train_step() in the file): "
                "cross_entropy(model(x), y), which is 0 on a model with one output (a regression head). "
                "Define the loss you train with as loss(model, batch); then diagnose again."
            )
            code = "def loss(model, batch):\n    x, y = batch\n    return torch.nn.functional.mse_loss(model(x), y)   # your loss"
        said = "0.0" if value == 0 else f"{value:.6g}"
        return [
            self.finding(
                f"The loss is {said} at every step ({len(losses)} FP32 steps, to the last bit): nothing is trained; "
                "is the loss what you meant?",
                evidence,
                Fix(summary, code=code),
            )
        ]
