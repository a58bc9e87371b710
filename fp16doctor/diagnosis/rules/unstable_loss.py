"""The loss is computed in a form that leaves fp32's range: FP32 fails in the loss, and float64 repairs it.

Found by intervention, not by a pattern: the FP32 baseline goes non-finite,
its first non-finite value is made in the loss computation (outside the
model), and computing the loss in float64 (the model's outputs cast up where
they leave it) repairs FP32 and AMP. The loss's formulation is then unstable,
not the model, the data or the learning rate: a softmax or sigmoid whose
probabilities underflow to 0 before a ``log``, an ``exp`` of logits past 88.7.
The fix is the stable form: ``log_softmax``/``cross_entropy`` on the logits,
``logsigmoid``/``binary_cross_entropy_with_logits``, ``logsumexp``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ...measure.records import OUTSIDE_MODEL
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, FoundBy, Repair, RepairKind, Severity
from . import Rule


@dataclass(frozen=True)
class UnstableLossEvidence(EvidenceRecord):
    """Where FP32's first non-finite value was made in the loss, and the float64 loss that repaired it."""

    intervention: str
    """The intervention that repaired FP32 and AMP."""
    symptoms_removed: list[str]
    operator: str
    """The loss's operator that made FP32's first non-finite value."""
    phase: str
    """``loss`` (the loss's forward) or ``backward`` (its backward, before the gradient reached the model)."""
    step: int
    batch: int
    operator_input_ranges: list[tuple[float, float]]
    output: str


STABLE_FORMS = (
    "Compute the loss in a form that stays in range: cross_entropy / log_softmax on the logits instead of "
    "log(softmax(...)), binary_cross_entropy_with_logits or logsigmoid instead of log(sigmoid(...)), "
    "torch.logsumexp instead of log(sum(exp(...))). FP32 fails there too; float64 repaired it, which shows the "
    "formulation, not the model, the data or the learning rate, is at fault (the config patch computes the loss "
    "in float64 in the doctor's loop now)."
)
STABLE_CODE = (
    "loss = F.cross_entropy(logits, y)                        # not F.nll_loss(torch.log(torch.softmax(logits, -1)), y)\n"
    "loss = F.binary_cross_entropy_with_logits(logits, y)     # not F.binary_cross_entropy(torch.sigmoid(logits), y)"
)


class UnstableLoss(Rule):
    code = "unstable-loss"
    order = 25
    evidence_type: ClassVar[type[EvidenceRecord]] = UnstableLossEvidence
    explains = ("fp32-nonfinite", "nonfinite", "skips", "amp-exception", "trajectory-drift")
    repairs = (RepairKind.LOSS_FP64,)
    names_cases = (
        lambda: (
            fx.repair("loss-fp64", symptoms=("fp32-nonfinite", "nonfinite")),
            fx.evidence(fp32_localisation=fx.localisation("loss", OUTSIDE_MODEL, "aten::log", output="-inf (float32)")),
        ),
    )
    suppresses = ("fp32-divergence", "loss-in-half", "scale-overflow", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        return []  # named only by the intervention search: from what, tried, repairs FP32

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """The loss in float64 repaired a training whose FP32 baseline failed in the loss."""
        loc = ev.fp32_localisation
        return repair.kind == RepairKind.LOSS_FP64 and loc is not None

    def repair_finding(self, repair: Repair, ev: Evidence) -> Finding:
        loc = ev.fp32_localisation
        assert loc is not None
        evidence = UnstableLossEvidence(
            intervention=repair.description,
            symptoms_removed=list(repair.symptoms),
            operator=loc.operator,
            phase=loc.phase,
            step=loc.step,
            batch=loc.batch_index,
            operator_input_ranges=loc.input_ranges,
            output=loc.output,
        )
        title = (
            f"The loss leaves fp32's range: FP32 goes non-finite at {loc.operator} in the loss computation "
            f"(step {loc.step}, -> {loc.output}); {repair.description} repairs FP32 and AMP"
        )
        finding = self.finding(
            title,
            evidence,
            Fix(STABLE_FORMS, code=STABLE_CODE, config_patch=dict(repair.config_patch)),
            severity=Severity.ERROR,
        )
        return replace(finding, found_by=FoundBy.INTERVENTION, verification=repair.verification)
