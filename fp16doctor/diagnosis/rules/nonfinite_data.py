"""NaN or inf in the training data.

Evidence: the data scan's counts per field, with the first batch and position.
Any numerical trouble downstream (a skipping scaler, a diverging loss) is a
symptom of it, in fp32 as in AMP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, RepairKind, evidence_of, omitted_when_none
from ..sharded import batch_place, ranks_of
from ..verify import Intervention, drop_rows
from . import Rule


@dataclass(frozen=True)
class NonfiniteDataEvidence(EvidenceRecord):
    """The data scan's counts of NaN and inf in one field, and where they are."""

    field: str
    """The field's name in the batch (what the intervention drops rows by)."""
    nan: int
    posinf: int
    neginf: int
    first: dict[str, Any]
    """The first non-finite value: ``{"batch": i, "position": [...], "value": "nan"}`` (empty when unknown)."""
    batches: list[int]
    """The first twenty batches that carry non-finite values."""
    batches_affected: int
    ranks: list[int] | None = omitted_when_none()
    """The ranks whose micro-batches those are, where the replay emulates a sharded run's ranks (its capsule)."""


class NonfiniteData(Rule):
    code = "nonfinite-data"
    order = 10
    evidence_type: ClassVar[type[EvidenceRecord]] = NonfiniteDataEvidence
    explains = ("fp32-nonfinite", "nonfinite", "skips", "amp-exception", "trajectory-drift")
    repairs = (RepairKind.DROP_NONFINITE_ROWS,)
    names_cases = (lambda: (fx.repair("drop-nonfinite-rows"), fx.evidence()),)
    verifiable = False
    triggers = ("nan_in_data.py",)
    fires_on = (
        lambda: fx.evidence(
            data=[
                fx.field(nan=3, first_nonfinite={"batch": 1, "position": [0, 2], "value": "nan"}, nonfinite_batches=[1])
            ]
        ),
    )
    quiet_on = (lambda: fx.evidence(data=[fx.field(abs_max=3.0)]),)
    suppresses = (
        "fp32-divergence",
        "scale-overflow",
        "scale-growth",
        "activation-overflow",
        "loss-in-half",
        "grad-underflow",
        "lr-schedule-peak",
        "precision-gap",
        "scheduler-skip-drift",
        "bf16-advice",
        "fp32-loss-rises",
    )

    def intervention(self, finding: Finding, ev: Evidence) -> Intervention:
        field = evidence_of(finding, NonfiniteDataEvidence).field
        return Intervention(f"the batches without the rows whose '{field}' is non-finite", batches=drop_rows(field))

    def check(self, ev: Evidence) -> list[Finding]:
        findings = []
        for field in ev.data:
            if not field.nonfinite:
                continue
            first = field.first_nonfinite or {}
            batches = field.nonfinite_batches
            where = batch_place(first.get("batch"), ev.config.sharding)
            findings.append(
                self.finding(
                    f"Field '{field.field}' holds {field.nan} NaN and {field.posinf + field.neginf} inf values (first: {where}, position {first.get('position')})",
                    NonfiniteDataEvidence(
                        field=field.field,
                        nan=field.nan,
                        posinf=field.posinf,
                        neginf=field.neginf,
                        first=first,
                        batches=batches[:20],
                        batches_affected=len(batches),
                        ranks=ranks_of(batches, ev.config.sharding),
                    ),
                    Fix(
                        f"Clean or filter the data: batch(es) {batches[:10]} of field '{field.field}' carry non-finite values.",
                        code=_drop_rows_code(field.field),
                    ),
                )
            )
        return findings


def _drop_rows_code(field: str) -> str:
    """Code that drops a batch's rows whose ``field`` (a path such as ``0``, ``input_ids`` or ``args.1``) holds a
    non-finite value, written for the batch's own structure."""
    access = "".join(f"[{int(part)}]" if part.isdigit() else f"[{part!r}]" for part in field.split("."))
    return (
        "# in data(): drop (or repair) the samples with non-finite values\n"
        f"x = batch{access}\n"
        "keep = torch.isfinite(x).flatten(1).all(1)\n"
        "# then keep those rows of every field: [t[keep] for t in batch], or {k: v[keep] for k, v in batch.items()}\n"
        "# or repair them: x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)"
    )
