"""Stage 6, the LR schedule's peak or largest jump: the trouble that grows from it, and the pause there.

The trouble is tied to an event by the measured trajectory, in AMP or FP32 (whichever probe fails): the first
non-finite step follows the event within the next forwards (:data:`~.context.EVENT_LEAD`, where an update's
damage shows before any growth can), or the gradient norm or the loss grows step after step from the event up to
it (:data:`~fp16doctor.measure.thresholds.LR_TRAJECTORY_GROWTH`). The pause then takes the steps from the event to
the trouble twice from the same state: at the schedule's rate, and capped at the rate before the event (lower
where the trouble grew while a warm-up climbed to its peak).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pandas as pd
import torch

from ...engine.probe import DEFAULT_INSTRUMENTS, Probe
from ...engine.records import Column, Reading, StepRecord
from ...measure.thresholds import LR_TRAJECTORY_GROWTH, RECURRING_SKIPS
from ..findings import LrPause, LrPeak, LrSchedule, LrTrajectory, ProbeSummary, StageName, StageReport, StageStatus
from .context import EVENT_LEAD, StageContext, bad_step


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
    summary = f"peak lr {lrs[peak]:.3g} at step {peak}; largest jump x{schedule.jump_ratio:.3g} at step {jump}"
    trajectory = tied_trajectory(ctx)
    if trajectory is None:
        return StageReport(
            StageName.LR_PEAK,
            StageStatus.SKIPPED,
            summary + "; no trouble at the peak or jump to explain",
            details=found.to_json(),
        )
    found.trajectory = trajectory
    runs = len(failing_probes(ctx)) * (1 + (CLIMB_HALVINGS if trajectory.growth_step is not None else 0))
    with ctx.progress.planned((trajectory.trouble_step + PAUSED_STEPS) * (1 + runs)):  # an estimate: a replay each
        found.pause = pause = _pause(ctx, trajectory, lrs)
    event = trajectory.event_step
    summary += f"; {trajectory_sentence(trajectory)}; paused at step {event}: at lr {lrs[event]:.3g} the steps are {'finite' if pause.finite_at_peak else 'NOT finite'}, "
    summary += f"capped at lr {pause.lr_cap:.3g}" + (
        f" from step {pause.capped_from}" if pause.capped_from != event else ""
    )
    summary += f" they are {'finite' if pause.finite_before_peak else 'NOT finite'}"
    return StageReport(StageName.LR_PEAK, StageStatus.RAN, summary, details=found.to_json())


def trajectory_sentence(t: LrTrajectory) -> str:
    """How the trouble follows the event, in words."""
    head = f"{t.mode} goes non-finite at step {t.trouble_step}, {t.trouble_step - t.event_step} step(s) after it"
    if t.growing is None:
        return head
    name = "gradient norm" if t.growing == Column.GRAD_NORM else "loss"
    return head + f", its {name} growing {t.growth:.3g}x from step {t.growth_step} on"


def tied_trajectory(ctx: StageContext) -> LrTrajectory | None:
    """The failing probe's trajectory from the schedule event its trouble follows, or None where no event ties to
    AMP's or FP32's: what grows up to the trouble grew from the event on (from earlier where the schedule was
    climbing to its peak), else the trouble starts within the next forwards after the event. A trajectory that
    shows the growth comes first (a fp16 run skips as soon as its gradients double, FP32 goes on growing)."""
    ev = ctx.evidence
    lrs = ctx.schedule["lrs"] if ctx.schedule else []
    soon: LrTrajectory | None = None
    probes = {summary.mode: summary for summary in (ev.amp, ev.fp32) if summary is not None}
    for mode, trouble in failing_probes(ctx).items():  # each from where its trouble starts
        summary = probes[mode]
        for event in ctx.schedule_event_steps():
            if event > trouble or event >= len(lrs) or lrs[event - 1] <= 0:
                continue  # a warm-up from 0 has no rate before it to cap at
            trajectory = measured_trajectory(summary, event, trouble)
            onset = trajectory.growth_step
            if onset is not None and (onset <= event + 1 or climbing(lrs, onset - 1, event)):
                return trajectory
            if trouble - event <= EVENT_LEAD and soon is None:
                soon = dataclasses.replace(trajectory, growth_step=None, growing=None, growth=1.0)
    return soon


def failing_probes(ctx: StageContext) -> dict[str, int]:
    """The probes (AMP, FP32) that went non-finite without raising, with the step each did not survive."""
    ev = ctx.evidence
    return {
        summary.mode: bad_step(summary, unsettled="first")
        for summary in (ev.amp, ev.fp32)
        if summary is not None and not summary.finite and summary.exception is None
    }


def climbing(lrs: list[float], start: int, end: int) -> bool:
    """The schedule's rate never falls from ``start`` to ``end`` and ends higher: a warm-up climbing to its peak."""
    window = lrs[max(start, 0) : end + 1]
    return len(window) > 1 and window[-1] > window[0] and all(b >= a for a, b in zip(window, window[1:]))


def measured_trajectory(summary: ProbeSummary, event: int, trouble: int) -> LrTrajectory:
    """The probe's gradient norm and loss up to ``trouble``, and the longest growth ending right before it."""
    records = summary.records
    by_step = records.drop_duplicates(Column.STEP, keep="last").set_index(Column.STEP)
    best: tuple[float, int, str] | None = None
    for column in (Column.GRAD_NORM, Column.LOSS):
        values = by_step[column].astype(float) if column in by_step else pd.Series(dtype=float)
        found = growth_before(values, trouble)
        if found is not None and found[0] >= LR_TRAJECTORY_GROWTH and (best is None or found[0] > best[0]):
            best = (found[0], found[1], column)
    onset = best[1] if best is not None else None
    first = max(min(event, onset if onset is not None else event) - 1, 0)
    steps = [s for s in range(first, trouble + 1) if s in by_step.index]
    return LrTrajectory(
        mode=summary.mode,
        event_step=event,
        trouble_step=trouble,
        growth_step=onset,
        growth=best[0] if best is not None else 1.0,
        growing=best[2] if best is not None else None,
        steps=steps,
        grad_norms=[float(by_step.at[s, Column.GRAD_NORM]) for s in steps],
        losses=[float(by_step.at[s, Column.LOSS]) for s in steps],
    )


def growth_before(values: pd.Series, trouble: int) -> tuple[float, int] | None:
    """The growth that runs step after step up to the step before ``trouble``: (its last value over the value
    before it began, the first grown step); None where the step before the trouble did not grow."""
    last = trouble - 1
    if last not in values.index or last - 1 not in values.index:
        return None
    start = last
    while start - 1 in values.index and _finite(values[start], values[start - 1]) and values[start] > values[start - 1]:
        start -= 1
    if start == last:
        return None
    base = float(values[start])
    return (float(values[last]) / base if base > 0 else math.inf), start + 1


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


PAUSED_STEPS = 2
"""Each pause takes the step and the one after it at least: an update's damage shows in the next forward."""


PAUSE_INSTRUMENTS = dataclasses.replace(DEFAULT_INSTRUMENTS, count_nonfinite=True)
"""The paused steps' instruments: the diagnosis's, with a non-finite output's largest finite magnitude measured
(the activations at the peak are evidence)."""


CLIMB_HALVINGS = 4
"""Where the trouble grew while a warm-up climbed to its peak and the rate before the peak does not hold, the pause
caps at half of it, then a quarter, down to a sixteenth: a peak that blows FP32 up within a probe is often ten or
more times what the training takes."""


def _pause(ctx: StageContext, trajectory: LrTrajectory, lrs: list[float]) -> LrPause:
    """The steps from the event through the trouble, from the state right before the event: at the schedule's rate,
    then capped at the rate of the step before the event. Where that cap does not hold and the growth began during
    the climb to the event, capped lower (:data:`CLIMB_HALVINGS`), each from the first step whose rate passes the
    cap (before it, the capped schedule is the schedule) to the end of the probe: a lower peak must hold for the
    rest of the training, not only through the trouble."""
    event, trouble, mode = trajectory.event_step, trajectory.trouble_step, trajectory.mode
    caps = [lrs[event - 1]]
    onset = trajectory.growth_step
    climb = onset is not None and onset < event
    if climb:
        caps += [lrs[event - 1] / 2**k for k in range(1, CLIMB_HALVINGS + 1)]
    at_peak = _paused_run(ctx, mode, event, _steps(ctx, event, trouble), lrs)
    failing = failing_probes(ctx)
    before: dict[str, Any] = {}
    cap, start = caps[0], event
    for index, cap in enumerate(caps):
        start = next(s for s in range(1, event + 1) if lrs[s] > cap)
        lower = climb and index > 0
        # a cap holds where every probe that failed stays finite with it (FP32 and AMP, where both failed), the
        # paused probe first; one that failed before the capped steps start fails with it too
        runs = (
            _paused_run(ctx, m, start, _steps(ctx, start, t, lower), lrs, cap=cap, stop_at_fault=lower)
            if t >= start
            else {"finite": False}
            for m, t in sorted(failing.items(), key=lambda item: item[0] != mode)
        )
        before = next(runs)
        if before["finite"] and all(other["finite"] for other in runs):
            break
        before["finite"] = False
    return LrPause(
        pause_step=event,
        finite_at_peak=at_peak["finite"],
        finite_before_peak=before["finite"],
        update_to_weight_at_peak=at_peak[Reading.UPDATE_TO_WEIGHT],
        update_to_weight_before_peak=before.get(Reading.UPDATE_TO_WEIGHT, 0.0),
        activation_max_at_peak=at_peak["activation_max"],
        activation_max_before_peak=before.get("activation_max", 0.0),
        lr_cap=cap,
        capped_from=start,
        paused_steps=_steps(ctx, event, trouble),
        mode=mode,
    )


def _steps(ctx: StageContext, start: int, trouble: int, to_end: bool = False) -> int:
    """From ``start`` through the trouble (two steps at least; ``to_end``: to the probe's last step), within the
    probes' steps."""
    last = ctx.evidence.steps - start
    return max(last if to_end else min(max(PAUSED_STEPS, trouble - start + 1), last), 1)


def _paused_run(
    ctx: StageContext,
    mode: str,
    start: int,
    steps: int,
    lrs: list[float],
    cap: float | None = None,
    stop_at_fault: bool = False,
) -> dict[str, Any]:
    """``steps`` steps of ``mode`` from its state right before ``start`` (AMP's kept snapshot there, else a replay),
    each at the schedule's rate or, with ``cap``, at most at ``cap`` (``stop_at_fault``: a long run, judged as a
    training is, :func:`_survived`, and stopped once it did not)."""
    kept = ctx.amp_snapshots if mode == "amp" else None
    replay = 0 if kept is not None and start in kept else start
    with ctx.progress.planned(replay + steps):
        probe = ctx.bench.probe(mode, ctx.config, instruments=PAUSE_INSTRUMENTS)
        try:
            if kept is not None and start in kept:
                probe.restore_kept(kept, start)
            else:
                while probe.iteration < start and probe.failed is None:
                    probe.step()
            return _instrumented_steps(probe, steps, cap, stop_at_fault)
        finally:
            probe.close()


def _instrumented_steps(
    probe: Probe, steps: int, cap: float | None = None, stop_at_fault: bool = False
) -> dict[str, Any]:
    """Take ``steps`` steps (each at most at ``cap`` if given): finite throughout (``stop_at_fault``: survived, and
    no step after it did not), the largest update-to-weight ratio and activation."""
    instruments = probe.instruments
    assert instruments is not None, "the LR-peak probes carry the instruments"
    rows_before = len(instruments.update_rows), len(instruments.forward_rows)
    records = []
    for _ in range(steps):
        if cap is not None:
            for group in probe.optimizer.param_groups:
                group[Column.LR] = min(group[Column.LR], cap)
        records.append(probe.step())
        if stop_at_fault and not _survived(records):
            break
    updates = instruments.update_rows[rows_before[0] :]
    forward = instruments.forward_rows[rows_before[1] :]
    weights_finite = all(torch.isfinite(p).all() for p in probe.model.parameters())
    finite = _survived(records) if stop_at_fault else all(_finite_record(r) for r in records)
    return {
        "finite": finite and weights_finite,
        Reading.UPDATE_TO_WEIGHT: max((u[Reading.UPDATE_TO_WEIGHT] for u in updates), default=0.0),
        # NaN where no finite magnitude was measured (a row of another probe's instruments): left out
        "activation_max": max((f[Reading.ABS_MAX] for f in forward if not math.isnan(f[Reading.ABS_MAX])), default=0.0),
    }


def _finite_record(record: StepRecord) -> bool:
    return record.exception_type is None and not record.nonfinite_loss and not record.nonfinite_grads


def _survived(records: list[StepRecord]) -> bool:
    """A long capped run survived: no non-finite loss, no non-finite update applied, fewer skips than recur (a
    scaler backing off once or twice is fp16's ordinary work)."""
    skips = sum(r.skipped for r in records)
    applied = any((r.nonfinite_grads and not r.skipped) or r.nonfinite_loss for r in records)
    return not applied and skips < RECURRING_SKIPS and all(r.exception_type is None for r in records)
