"""Stage 6, the pause at the LR schedule's peak or largest jump."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping
from typing import Any

import torch

from ...engine.probe import DEFAULT_INSTRUMENTS, Probe, ProbeSnapshot
from ...engine.records import Column
from ..findings import LrPause, LrPeak, LrSchedule, StageName, StageReport, StageStatus
from .context import StageContext, bad_step


def stage_lr_peak(ctx: StageContext) -> StageReport:
    ev = ctx.evidence
    if not ev.has_scheduler:
        return StageReport(StageName.LR_PEAK, StageStatus.SKIPPED, "no scheduler() in the training file")
    if ctx.schedule is None:
        return StageReport(
            StageName.LR_PEAK,
            StageStatus.SKIPPED,
            "no schedule to dry-run: the scheduler follows the loss "
            "(ReduceLROnPlateau), or cannot be built apart from the training",
        )
    ev.lr_peak = found = LrPeak(LrSchedule(**ctx.schedule))
    schedule = found.schedule
    lrs, peak, jump = schedule.lrs, schedule.peak_step, schedule.jump_step
    amp = ev.amp
    trouble = None
    if amp is not None and not amp.finite:
        trouble = bad_step(amp, unsettled="first") if amp.exception is None else None  # where the trouble starts
    event = ctx.schedule_event_before(trouble)
    summary = f"peak lr {lrs[peak]:.3g} at step {peak}; largest jump x{schedule.jump_ratio:.3g} at step {jump}"
    if event is None:
        return StageReport(
            StageName.LR_PEAK,
            StageStatus.SKIPPED,
            summary + "; no trouble at the peak or jump to explain",
            details=found.to_json(),
        )
    found.pause = pause = _pause(ctx, event, lrs)
    summary += (
        f"; paused at step {event}: at lr {lrs[event]:.3g} the step is {'finite' if pause.finite_at_peak else 'NOT finite'}, "
        f"at the pre-peak lr {lrs[event - 1]:.3g} it is {'finite' if pause.finite_before_peak else 'NOT finite'}"
    )
    return StageReport(StageName.LR_PEAK, StageStatus.RAN, summary, details=found.to_json())


def _pause(ctx: StageContext, event: int, lrs: list[float]) -> LrPause:
    """From the AMP run's state right before ``event`` (kept by the AMP stage, else replayed), take that step
    at its own and at the previous learning rate."""
    kept = ctx.amp_snapshots
    # the replay to the event where the AMP stage kept no snapshot, then two steps at each learning rate
    with ctx.progress.planned((0 if event in kept else event) + 2 * PAUSED_STEPS):
        return _pause_at(ctx, kept, event, lrs)


PAUSED_STEPS = 2
"""Each pause takes the step and the one after it: an update's damage shows in the next forward."""


PAUSE_INSTRUMENTS = dataclasses.replace(DEFAULT_INSTRUMENTS, count_nonfinite=True)
"""The paused steps' instruments: the diagnosis's, with a non-finite output's largest finite magnitude measured
(the activations at the peak are evidence)."""


def _pause_at(ctx: StageContext, kept: MutableMapping[int, ProbeSnapshot], event: int, lrs: list[float]) -> LrPause:
    if event not in kept:
        probe = ctx.bench.probe("amp", ctx.config, instruments=None)
        try:
            while probe.iteration < event and probe.failed is None:
                probe.step()
            kept[event] = probe.snapshot(copy_state=False)
        finally:
            probe.close()
        del probe
    at_peak = _paused_step(ctx, kept, event)
    before = _paused_step(ctx, kept, event, lr=lrs[event - 1])
    return LrPause(
        pause_step=event,
        finite_at_peak=at_peak["finite"],
        finite_before_peak=before["finite"],
        update_to_weight_at_peak=at_peak["update_to_weight"],
        update_to_weight_before_peak=before["update_to_weight"],
        activation_max_at_peak=at_peak["activation_max"],
        activation_max_before_peak=before["activation_max"],
    )


def _paused_step(
    ctx: StageContext, kept: MutableMapping[int, ProbeSnapshot], event: int, lr: float | None = None
) -> dict[str, Any]:
    """:func:`_instrumented_step` on a fresh probe given its own copy of the snapshot before ``event``: a
    probe holding no gradients or optimizer state yet takes the copy over (no second copy in memory)."""
    # two steps: their outputs held to the step's end, so that an overflowing module's finite magnitude shows
    probe = ctx.bench.probe("amp", ctx.config, instruments=PAUSE_INSTRUMENTS)
    try:
        probe.restore_kept(kept, event)
        return _instrumented_step(probe, lr=lr)
    finally:
        probe.close()


def _instrumented_step(probe: Probe, lr: float | None = None) -> dict[str, Any]:
    """Take the step (at ``lr`` if given) and the one after it: an update's damage shows in the next forward."""
    instruments = probe.instruments
    assert instruments is not None, "the LR-peak probes carry the instruments"
    rows_before = len(instruments.update_rows), len(instruments.forward_rows)
    records = []
    for _ in range(PAUSED_STEPS):
        if lr is not None:
            for group in probe.optimizer.param_groups:
                group[Column.LR] = lr
        records.append(probe.step())
    updates = instruments.update_rows[rows_before[0] :]
    forward = instruments.forward_rows[rows_before[1] :]
    weights_finite = all(torch.isfinite(p).all() for p in probe.model.parameters())
    return {
        "finite": all(r.exception_type is None and not r.nonfinite_loss and not r.nonfinite_grads for r in records)
        and weights_finite,
        "update_to_weight": max((u["update_to_weight"] for u in updates), default=0.0),
        # NaN where no finite magnitude was measured (a row of another probe's instruments): left out
        "activation_max": max((f["abs_max"] for f in forward if not math.isnan(f["abs_max"])), default=0.0),
    }
