"""Stage 1, the data scan: NaN/inf and extreme magnitudes in the batches the probes use."""

from __future__ import annotations

from ...measure.datascan import scan_batches
from ..findings import StageName, StageReport, StageStatus
from .context import StageContext


def stage_data(ctx: StageContext) -> StageReport:
    ctx.evidence.data = scan = scan_batches(ctx.bench.batches)
    bad = [f for f in scan if f.nonfinite]
    extreme = [f for f in scan if f.floating and f.abs_max >= 1e3]
    distinct = len({id(b) for b in ctx.bench.batches})
    parts = [f"{_count(distinct, 'batch', 'batches')}, {_count(len(scan), 'field', 'fields')}"]
    if bad:
        parts.append(
            "non-finite values in "
            + ", ".join(
                f"'{f.field}' ({f.nan} NaN, {f.posinf + f.neginf} inf; first in batch {(f.first_nonfinite or {}).get('batch')})"
                for f in bad
            )
        )
    if extreme:
        parts.append("extreme magnitudes in " + ", ".join(f"'{f.field}' (|x| up to {f.abs_max:.3g})" for f in extreme))
    if not bad and not extreme:
        parts.append("all finite, magnitudes fp16 can carry")
    return StageReport(
        StageName.DATA, StageStatus.RAN, "; ".join(parts), details={"fields": [f.to_json() for f in scan]}
    )


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"
