"""Stage 8, the bf16 check: does bfloat16 avoid fp16's range trouble?"""

from __future__ import annotations

import torch

from ...measure.thresholds import UNDERFLOW_ALARM
from ..findings import StageName, StageReport, StageStatus
from .context import (
    StageContext,
    probe_details,
    probe_sentence,
    run_mode,
    worst_underflow,
)


def stage_bf16(ctx: StageContext) -> StageReport:
    ev = ctx.evidence
    amp = ev.amp
    under = ev.observed_underflow
    range_trouble = amp is not None and (
        amp.first_nonfinite_loss is not None
        or len(amp.skip_steps) > max(2, 0.1 * len(amp.records))  # more than a settling scale's few skips
        or (under is not None and len(under) and worst_underflow(under) > UNDERFLOW_ALARM)
    )
    if ctx.config.dtype == "bfloat16" or not range_trouble:
        return StageReport(
            StageName.BF16,
            StageStatus.SKIPPED,
            "no fp16 range trouble to compare against" if ctx.config.dtype != "bfloat16" else "already bfloat16",
        )
    ev.bf16 = summary = run_mode(ctx, "bf16", instruments=None)  # the bf16 advice reads the records only
    ev.bf16_supported = torch.cuda.is_bf16_supported() if ctx.bench.device.type == "cuda" else True
    return StageReport(StageName.BF16, StageStatus.RAN, probe_sentence(summary), details=probe_details(summary))
