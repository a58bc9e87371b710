"""Stage 3, AMP as configured."""

from __future__ import annotations

from ...engine.probe import DEFAULT_INSTRUMENTS, PLOT_INSTRUMENTS, Probe
from ..findings import StageName, StageReport, StageStatus
from .context import StageContext, probe_details, probe_sentence, run_mode


def stage_amp(ctx: StageContext) -> StageReport:
    """AMP as configured; it also keeps its state right before the LR schedule's events (no replay to pause there)."""
    events = set(ctx.schedule_event_steps())

    def keep_snapshot(probe: Probe) -> None:
        if probe.iteration in events:
            ctx.amp_snapshots[probe.iteration] = probe.snapshot(copy_state=False)  # kept as a copy

    instruments = PLOT_INSTRUMENTS if ctx.plots else DEFAULT_INSTRUMENTS  # the plots read this probe's tables
    ctx.evidence.amp = summary = run_mode(ctx, "amp", before_step=keep_snapshot, instruments=instruments)
    return StageReport(StageName.AMP, StageStatus.RAN, probe_sentence(summary), details=probe_details(summary))
