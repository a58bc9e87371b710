"""Empty targets: a batch in which every label equals the ignore_index.

Evidence: an integer field of the data whose values, in some batch, all equal
-100 (PyTorch's default `ignore_index`, Hugging Face's label padding), and the
first non-finite loss (FP32 or AMP) on such a batch: a mean cross-entropy over
zero valid targets is 0/0 = NaN by design. Reported with the count of valid targets per batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ...engine.records import Column
from ...measure.thresholds import IGNORE_INDEX
from ...userfile.batches import iter_tensors
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, ProbeSummary, evidence_of
from ..verify import Intervention, apply_batches
from . import Rule


@dataclass(frozen=True)
class EmptyTargetsEvidence(EvidenceRecord):
    """An integer field with batches of no valid target, and the first non-finite loss on such a batch."""

    field: str
    """The data field (the label) whose every value is -100 in those batches."""
    empty_batches: list[int]
    """The batches without a valid target, in order."""
    valid_targets_per_batch: list[int]
    """Per scanned batch (the first 40), the values that are not -100."""
    first_nonfinite_batch: int
    """The first batch on which a probe's loss went non-finite (FP32 or AMP, the earlier)."""


class EmptyTargets(Rule):
    code = "empty-targets"
    order = 15
    evidence_type: ClassVar[type[EvidenceRecord]] = EmptyTargetsEvidence
    verifiable = False
    explains = ("fp32-nonfinite", "nonfinite", "skips", "trajectory-drift")
    triggers = ("empty_targets.py",)
    fires_on = (
        lambda: fx.evidence(
            data=[fx.field("1", floating=False, ignored_only_batches=[2], valid_counts=[5, 5, 0])],
            fp32=fx.probe("fp32", fx.records(nonfinite_loss=[2, 3])),
        ),
    )
    quiet_on = (
        lambda: fx.evidence(data=[fx.field("1", floating=False, ignored_only_batches=[2], valid_counts=[5, 5, 0])]),
        lambda: fx.evidence(
            data=[fx.field("1", floating=False, valid_counts=[5, 5, 5])],
            fp32=fx.probe("fp32", fx.records(nonfinite_loss=[2])),
        ),
    )
    suppresses = (
        "fp32-divergence",
        "scale-overflow",
        "scale-growth",
        "lr-schedule-peak",
        "scheduler-skip-drift",
        "bf16-advice",
    )

    def check(self, ev: Evidence) -> list[Finding]:
        fields = [f for f in ev.data if not f.floating and f.ignored_only_batches]
        if not fields:
            return []
        batches = {b for f in fields for b in f.ignored_only_batches}
        failing = [b for b in (_failing_batch(ev.fp32), _failing_batch(ev.amp)) if b is not None]
        if not any(b in batches for b in failing):
            return []
        field = fields[0]
        return [
            self.finding(
                f"Batch {sorted(batches)[0]} has no valid target in '{field.field}' (every value is -100): its mean loss is 0/0 = NaN",
                EmptyTargetsEvidence(
                    field=field.field,
                    empty_batches=sorted(batches),
                    valid_targets_per_batch=field.valid_counts[:40],
                    first_nonfinite_batch=min(failing),
                ),
                Fix(
                    "Skip batches without a valid target, or normalise the summed loss by max(n_valid, 1).",
                    code=(
                        "n_valid = (labels != -100).sum()\n"
                        "if n_valid == 0:\n    continue                       # nothing to learn from this batch\n"
                        "# or: loss = F.cross_entropy(logits, labels, reduction='sum') / n_valid.clamp_min(1)"
                    ),
                ),
            )
        ]

    def intervention(self, finding: Finding, ev: Evidence) -> Intervention:
        field = evidence_of(finding, EmptyTargetsEvidence).field
        return Intervention(
            f"the batches without those whose '{field}' has no valid target", batches=_skip_empty(field)
        )


def _failing_batch(summary: ProbeSummary | None) -> int | None:
    if summary is None:
        return None
    rows = summary.records[summary.records[Column.NONFINITE_LOSS].astype(bool)]
    return int(rows[Column.BATCH_INDEX].iloc[0]) if len(rows) else None


def _skip_empty(field: str) -> Callable[[list[Any]], list[Any]]:
    """Each batch without a valid target replaced by the next one that has one (the run keeps its length)."""

    def has_targets(batch: Any) -> bool:
        labels = dict(iter_tensors(batch)).get(field)
        return labels is None or bool((labels != IGNORE_INDEX).any())

    def edit(batches: list[Any]) -> list[Any]:
        kept = [b for b in batches if has_targets(b)] or batches
        return apply_batches([kept[i % len(kept)] for i in range(len(batches))], lambda b: b)

    return edit
