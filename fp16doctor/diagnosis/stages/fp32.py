"""Stage 2, the FP32 baseline: the user's training with every low-precision path off."""

from __future__ import annotations

from ...engine.probe import Probe
from ..findings import StageName, StageReport, StageStatus
from .context import StageContext, gap_states, probe_details, probe_sentence, run_mode


def stage_fp32(ctx: StageContext) -> StageReport:
    """The baseline run; it also keeps its weights at the steps the precision-gap search evaluates (no second run).
    Its summary says when the FP32 probes split their batches into micro-batches, or why a wanted split was refused."""
    wanted = set(gap_states(ctx))

    def keep_state(probe: Probe) -> None:
        if probe.iteration in wanted:
            ctx.states[probe.iteration] = probe.model.state_dict()  # kept as a copy (KeptStates)

    ctx.evidence.fp32 = summary = run_mode(ctx, "fp32", before_step=keep_state)
    plan = ctx.bench.micro_batch_plan("fp32")  # made when the probe was built: what every FP32 probe follows
    sentence = "; ".join(part for part in (probe_sentence(summary), plan.sentence()) if part)
    return StageReport(
        StageName.FP32, StageStatus.RAN, sentence, details={**probe_details(summary), "micro_batches": plan.to_json()}
    )
