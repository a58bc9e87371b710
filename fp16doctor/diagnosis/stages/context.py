"""What every stage shares: the :class:`StageContext` and the probe helpers several stages use."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ...config import DoctorConfig, apply_patch, build_config, merge, scaler_patch
from ...engine.instruments import InstrumentOptions, precision_map
from ...engine.kept import StateKeeper
from ...engine.microbatch import UNSPLIT
from ...engine.optimizers import flat_schedulers, named_optimizers
from ...engine.probe import (
    DEFAULT_INSTRUMENTS,
    SCHEDULER_ORDER_WARNING,
    Probe,
    ProbeSnapshot,
    Workbench,
    metric_driven,
    resume_schedulers,
)
from ...engine.progress import StepProgress
from ...engine.records import Column, StepRecord
from ...engine.rng import seed_everything
from ...errors import CheckpointError
from ...measure.records import GradientColumn
from ...measure.symptoms import (
    Symptom,
    first_nonfinite,
    measure,
    probe_symptoms,
    relative_deviation,
    skip_profile,
)
from ...userfile.checkpoint import TrainedStart
from ..findings import Evidence, ProbeSummary

EVENT_LEAD = 3
"""Trouble that starts at most this many steps after an LR schedule's peak or jump starts there."""


@dataclass
class StageContext:
    """What every stage gets: the workbench, the config, the evidence so far, and the run options."""

    bench: Workbench
    config: DoctorConfig
    evidence: Evidence
    ci: bool = False
    plots: bool = False
    """The report's plots will be drawn: the AMP stage's probe carries :data:`PLOT_INSTRUMENTS`."""
    nproc: int = 1
    """The ranks the parallel stage runs (``--nproc``; 1: it is skipped)."""
    rank_timeout: float = 300.0
    """Seconds the parallel stage waits while no rank moves before it stops the run (``--rank-timeout``)."""
    states: MutableMapping[int, dict[str, torch.Tensor]] = field(default_factory=lambda: StateKeeper().kept())
    """FP32 trajectory weights by step, shared by the stages that evaluate the same states (a diagnosis run
    gives :class:`fp16doctor.engine.kept.KeptStates`: in host memory within its budget, else on disk)."""
    loss_floor: float = 0.0
    """The denominator floor of same-state loss deviations (:func:`fp16doctor.measure.symptoms.loss_floor`)."""
    fault_snapshots: MutableMapping[int, ProbeSnapshot] = field(default_factory=lambda: StateKeeper().kept())
    """The AMP probe's state one step before the localised step (kept by the localisation's replay): the
    intervention search screens each candidate from there instead of replaying the run."""
    amp_snapshots: MutableMapping[int, ProbeSnapshot] = field(default_factory=lambda: StateKeeper().kept())
    """The AMP probe's full state right before the LR schedule's peak and jump: the LR-peak stage
    pauses there without replaying the run (at most two snapshots)."""

    @property
    def progress(self) -> StepProgress:
        """The bench's probe-step count: every probe step reports itself there; a stage announces how many
        it will take (``with ctx.progress.planned(n):``) so that a display can show "step i of n"."""
        return self.bench.progress

    def with_config(self, patch: dict[str, Any]) -> DoctorConfig:
        return build_config(apply_patch(self.config.to_dict(), patch))

    @functools.cached_property
    def schedule(self) -> dict[str, Any] | None:
        """The LR schedule's peak and largest jump (:func:`schedule_events`), dry-run once; None without a
        scheduler, or with one that follows the loss."""
        lrs = scheduler_lrs(self) if self.evidence.has_scheduler else None
        return schedule_events(lrs) if lrs else None

    def schedule_event_steps(self) -> list[int]:
        """The steps (after step 0) where the learning rate peaks or jumps."""
        info = self.schedule
        return sorted({info["peak_step"], info["jump_step"]} - {0}) if info else []

    def schedule_event_before(self, step: int | None) -> int | None:
        """The LR event (peak or largest jump) that ``step``'s trouble starts at: at most ``EVENT_LEAD`` steps
        after it (an update's damage shows in the next forwards), else None."""
        if step is None:
            return None
        return next((e for e in self.schedule_event_steps() if e <= step <= e + EVENT_LEAD), None)


def summarise(probe: Probe) -> ProbeSummary:
    """Turn a finished probe into the summary the rules read."""
    tables = probe.instruments.frames() if probe.instruments is not None else {}
    clip_calls = [dict(c, step=r.step) for r in probe.records if r.trace for c in r.trace.clip_calls]
    loss_dtypes = sorted({r.trace.loss_dtype for r in probe.records if r.trace and r.trace.loss_dtype})
    return ProbeSummary(
        mode=probe.mode,
        records=probe.frame(),
        tables=tables,
        precision=precision_map(
            probe.model, probe.optimizers.all(), probe.instruments.compute_dtypes if probe.instruments else None
        ),
        clip_calls=clip_calls,
        loss_dtypes=loss_dtypes,
        first_nonfinite_forward=probe.instruments.first_nonfinite_forward() if probe.instruments else None,
        scaler_enabled=probe.scaler.is_enabled(),
        scaler_called=any(r.trace.scale_called for r in probe.records if r.trace),
        scaler_calls=[list(r.trace.scaler_calls) if r.trace else [] for r in probe.records],
        optimizer_calls=[list(r.trace.calls) if r.trace else [] for r in probe.records],
        skips_by_optimizer=probe.skips_by_optimizer(),
        emulated_reduction=probe.reduction_reading if probe.config.sharding.emulated else None,
    )


def run_mode(
    ctx: StageContext,
    mode: str,
    config: DoctorConfig | None = None,
    steps: int | None = None,
    before_step: Callable[[Probe], None] | None = None,
    instruments: InstrumentOptions | None = DEFAULT_INSTRUMENTS,
    compiled: bool = False,
) -> ProbeSummary:
    """Run a fresh probe of ``mode`` (with the instruments the rules read, :data:`DEFAULT_INSTRUMENTS`, unless
    told others: the report's AMP probe takes the plots' too, a probe whose tables nothing reads none) and
    summarise it. ``compiled``: the steps call the model compiled (:class:`~fp16doctor.engine.probe.Probe`)."""
    probe = ctx.bench.probe(mode, config or ctx.config, instruments=instruments, compiled=compiled)
    steps = steps or ctx.evidence.steps
    try:
        with ctx.progress.planned(steps):
            probe.run(steps, before_step=before_step)
        return summarise(probe)
    finally:
        probe.close()


def fp32_state_at(ctx: StageContext, step: int) -> dict[str, torch.Tensor]:
    """The FP32 trajectory's weights at ``step`` (cached: several stages evaluate the same states)."""
    if step not in ctx.states:
        remember_fp32_states(ctx, [step])
    return ctx.states[step]


def remember_fp32_states(ctx: StageContext, steps: list[int]) -> None:
    """One FP32 run up to the last of ``steps``, keeping the weights at each of them."""
    wanted = sorted(set(steps) - set(ctx.states))
    if not wanted:
        return
    reference = ctx.bench.probe("fp32", ctx.config, instruments=None)
    try:
        with ctx.progress.planned(wanted[-1]):
            for step in wanted:
                while reference.iteration < step:
                    reference.step()
                ctx.states[step] = reference.model.state_dict()  # the mapping keeps a copy
    finally:
        reference.close()


def probe_at(
    ctx: StageContext, mode: str, config: DoctorConfig, step: int, whole_batches: bool = False, compiled: bool = False
) -> Probe:
    """A probe of ``mode`` holding the FP32 trajectory's weights at ``step``, about to take that step.
    ``whole_batches``: never micro-batched, for a caller that hooks what each module computes on the batch
    (a micro-batched FP32 step would show it a part of the rows at a time). ``compiled``: the step calls the
    compiled program, as the training compiles it."""
    options: dict[str, Any] = {"batch_plan": UNSPLIT} if whole_batches else {}
    state = fp32_state_at(ctx, step)  # first: a reference run it makes trains too, and the probe starts after it
    probe = ctx.bench.probe(mode, config, instruments=None, compiled=compiled, **options)
    probe.model.load_state_dict(state)
    probe.iteration = probe.cursor = step
    seed_everything(ctx.config.seed + step)  # the same dropout masks in every mode
    return probe


def same_state_losses(
    ctx: StageContext, step: int, configs: dict[str, tuple[str, DoctorConfig]], compiled: bool = False
) -> dict[str, float]:
    """Loss of each (mode, config) on the FP32 trajectory's state at ``step``: same weights, same batch."""
    return {key: record.loss for key, record in same_state_records(ctx, step, configs, compiled).items()}


def same_state_records(
    ctx: StageContext, step: int, configs: dict[str, tuple[str, DoctorConfig]], compiled: bool = False
) -> dict[str, StepRecord]:
    """The step record of each (mode, config) on the FP32 trajectory's state at ``step`` (its loss, and the loss
    scale it was taken at, :func:`same_state_step`). ``compiled``: the mixed-precision steps call the compiled
    program; FP32's stays the eager baseline's."""
    with ctx.progress.planned(len(configs)):
        return {
            key: same_state_step(ctx, mode, config, step, compiled=compiled and mode != "fp32")
            for key, (mode, config) in configs.items()
        }


SKIP_BACKOFFS = 8
"""A same-state step whose skip changes what a later optimizer sees is retried at most this many lower scales."""


def same_state_step(
    ctx: StageContext, mode: str, config: DoctorConfig, step: int, compiled: bool = False
) -> StepRecord:
    """One step of ``mode`` on the FP32 trajectory's state at ``step``, at a loss scale no optimizer skips at.

    Each probe's scaler starts at ``init_scale``, so every same-state step is a run's first, where the scaler's
    calibration skips. With several optimizers that skip is not neutral: a discriminator left unstepped gives the
    generator's loss another network than FP32's. Such a step is taken again at the scale the calibration lowers
    to, as the run itself does, until no optimizer of the iteration skips (the record's ``loss_scale`` says which).
    """
    for _ in range(SKIP_BACKOFFS + 1):
        probe = probe_at(ctx, mode, config, step, compiled=compiled)
        try:
            record = probe.step()
            lowered = float(probe.scaler.get_scale()) if probe.scaler.is_enabled() else record.loss_scale
        finally:
            probe.close()
        del probe  # freed before the next probe is built: one probe alive at a time
        if not skip_reaches_later_step(record):
            break
        config = build_config(merge(config.to_dict(), scaler_patch(init_scale=min(lowered, settled_scale(ctx)))))
    return record


def skip_reaches_later_step(record: StepRecord) -> bool:
    """An optimizer skipped in an iteration that steps several: the later ones see what it did not update."""
    trace = record.trace
    return trace is not None and bool(trace.skipped_optimizers) and trace.scaler_calls.count("step") > 1


def settled_scale(ctx: StageContext) -> float:
    """The loss scale AMP's run ended at (where its calibration settled); inf before an AMP run."""
    amp = ctx.evidence.amp
    scales = amp.records[Column.LOSS_SCALE] if amp is not None and len(amp.records) else None
    return float(scales.iloc[-1]) if scales is not None and math.isfinite(float(scales.iloc[-1])) else math.inf


def worst_underflow(observed: pd.DataFrame | None) -> float:
    """The largest share of a tensor's gradient mass that flushed to zero, negligible gradients left out."""
    if observed is None or observed.empty:
        return 0.0
    if GradientColumn.NEGLIGIBLE in observed:
        observed = observed[~observed[GradientColumn.NEGLIGIBLE].astype(bool)]
    return float(observed[GradientColumn.OBSERVED_UNDERFLOW_MASS].max()) if len(observed) else 0.0


def same_state_gap(ctx: StageContext, config: DoctorConfig, step: int, compiled: bool = False) -> float:
    """AMP under ``config`` against fp32 on the FP32 trajectory's state at ``step``: same weights, same batch.
    ``compiled``: the AMP step calls the compiled program (FP32 stays the eager baseline)."""
    losses = same_state_losses(ctx, step, {"fp32": ("fp32", ctx.config), "amp": ("amp", config)}, compiled)
    return relative_deviation(losses["amp"], losses["fp32"], ctx.loss_floor)


def measured_symptoms(
    ctx: StageContext,
    config: DoctorConfig,
    amp: ProbeSummary | None,
    fp32: ProbeSummary | None,
    gap: float | None,
    compiled: bool = False,
) -> list[Symptom]:
    """The symptoms of an AMP probe against FP32 (:func:`measured_outcome`'s)."""
    return measured_outcome(ctx, config, amp, fp32, gap, compiled)[0]


def measured_outcome(
    ctx: StageContext,
    config: DoctorConfig,
    amp: ProbeSummary | None,
    fp32: ProbeSummary | None,
    gap: float | None,
    compiled: bool = False,
) -> tuple[list[Symptom], pd.DataFrame | None]:
    """The symptoms of an AMP probe against FP32 (:func:`fp16doctor.measure.symptoms.probe_symptoms`): the verdict's
    and every fix's verification; with the records of the aligned AMP run where one was measured (below), else None.

    A trajectory drift after skipped steps is measured again on an AMP run aligned on the steps taken (a
    skipped batch retried with the same RNG; the scheduler still steps on a skip, as the user's loop does):
    a run that skipped k steps is k updates behind on other batches, and on a short probe that lag alone can
    look like a drift. What remains aligned is precision's, or the schedule's. ``compiled``: ``amp`` is a compiled
    probe's, and so is the aligned run.
    """
    if amp is None:
        return [], None
    bf16 = config.dtype == "bfloat16"
    capsule = ctx.evidence.capsule
    found = probe_symptoms(amp, fp32, gap, bf16=bf16, skipped_before=capsule.skipped_before if capsule else 0)
    if fp32 is None or not amp.skip_steps or not any(s.code == "trajectory-drift" for s in found):
        return found, None
    aligned = ctx.bench.probe(
        "amp", config, align_on_taken_steps=True, instruments=None, hold_scheduler_on_retry=False, compiled=compiled
    )
    try:
        records = aligned.run(ctx.evidence.steps)
    finally:
        aligned.close()
    drift = [s for s in measure(records, fp32.records, bf16=bf16) if s.code == "trajectory-drift"]
    for symptom in drift:
        symptom.measured["aligned_on_steps_taken"] = True
        symptom.description += " (aligned on the steps taken: not the lag of the skipped steps)"
    return [s for s in found if s.code != "trajectory-drift"] + drift, records


def gap_states(ctx: StageContext) -> list[int]:
    """The FP32 trajectory steps at which the precision-gap search compares AMP with FP32 on the same state: once
    the FP32 baseline ran, only those before its first non-finite step (a NaN reference compares with nothing)."""
    fp32 = ctx.evidence.fp32
    failed = first_nonfinite(fp32.records) if fp32 is not None else None
    steps = ctx.evidence.steps if failed is None else failed
    chosen = {0, steps // 2, steps - 1} if not ctx.ci else {0, steps - 1}
    return sorted(s for s in chosen if 0 <= s < steps)


def probe_sentence(summary: ProbeSummary) -> str:
    rec = summary.records
    if summary.exception:
        e = summary.exception
        return f"stopped at step {e.step}: {e.type}: {e.message} ({e.location})"
    first, last = (float(rec[Column.LOSS].iloc[i]) + 0.0 for i in (0, -1))  # + 0.0: a loss of -0.0 reads as 0
    parts = [f"{len(rec)} steps, loss {first:.4g} -> {last:.4g}"]
    if summary.first_nonfinite_loss is not None:
        parts.append(f"loss non-finite from step {summary.first_nonfinite_loss}")
    skips = summary.skip_steps
    if skips:
        parts.append(f"{len(skips)} skipped step(s) (first {skips[:5]})")
    return "; ".join(parts)


def probe_details(summary: ProbeSummary) -> dict[str, Any]:
    rec = summary.records
    return {
        "steps": len(rec),
        "first_nonfinite_loss": summary.first_nonfinite_loss,
        "first_nonfinite_grads": summary.first_nonfinite_grads,
        "skipped_steps": summary.skip_steps,
        "final_loss": float(rec[Column.LOSS].iloc[-1]) if len(rec) else None,
        "exception": summary.exception,
        "skipped_by_optimizer": summary.skips_by_optimizer,
    }


def bad_step(summary: ProbeSummary, unsettled: str = "last") -> int:
    """The step to localise: the first the training did not survive (an inf/NaN loss, or inf/NaN gradients
    applied to the weights), else the skip that tells the fault (:func:`telling_skip`). A skip is the scaler at
    work; a forward that overflows a few steps later is the fault the user sees. ``unsettled="first"``: where no
    step was applied, the first skip (where the trouble starts, as the LR-peak stage asks) instead of the last."""
    unhandled = first_nonfinite(summary.records)
    if unhandled is not None:
        return unhandled
    candidates = [s for s in (summary.first_nonfinite_loss, summary.first_nonfinite_grads) if s is not None]
    return telling_skip(summary.records, min(candidates), unsettled)


def telling_skip(records: pd.DataFrame, first: int, unsettled: str = "last") -> int:
    """Of a training whose trouble is skipped steps only, the skip that tells its fault from the scaler's
    calibration: the first skip after an applied step (the scale had settled: what overflows then is the fault);
    else, when no step was applied, the last (at the lowest scale: what still overflows there is not the initial
    scale's doing: a default 2^16 overflows some gradient at step 0 in most trainings, a custom backward
    overflows at every scale; ``unsettled="first"``: ``first``); else ``first`` (calibration skips only).
    Under gradient accumulation the optimizer step found is mapped back to the first micro-batch of its group
    whose gradients turned non-finite: that is where the inf is made."""
    profile = skip_profile(records)
    if not profile["settled"]:  # every attempt skipped: the last skip is the last attempt
        if unsettled != "last" or not profile["skipped_steps"]:
            return first
        chosen = profile["skipped_steps"][-1]
    else:
        later = profile["skipped_steps"][profile["leading"] :]
        if not later:
            return first
        chosen = later[0]
    return _first_bad_in_group(records, chosen)


def _first_bad_in_group(records: pd.DataFrame, step: int) -> int:
    """The first row with non-finite gradients among the micro-batches accumulated into optimizer step ``step``."""
    if "micro_step" not in records:
        return step
    steps = records[Column.STEP].astype(int)
    before = records[(steps < step) & ~records[Column.MICRO_STEP].astype(bool)]
    start = int(before[Column.STEP].max()) + 1 if len(before) else int(steps.min())
    group = records[(steps >= start) & (steps <= step) & records[Column.NONFINITE_GRADS].astype(bool)]
    return int(group[Column.STEP].min()) if len(group) else step


def scheduler_lrs(ctx: StageContext) -> list[float] | None:
    """Dry-run a copy of the user's scheduler over the run, on a throw-away optimizer; None for a scheduler
    that follows the loss (``ReduceLROnPlateau``): it has no schedule to know in advance."""
    spec = ctx.bench.spec
    if spec.scheduler is None:
        return None
    # Shape-only stand-ins for the model's parameters: an optimizer() that groups them (by dimension, say)
    # builds the same groups, and nothing is allocated (the dry run never steps the optimizer).
    stand_ins = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in ctx.bench.parameter_shapes]
    try:
        if spec.optimizers is not None:  # optimizers(model): a model built on the meta device, nothing allocated
            with torch.device("meta"):
                built = spec.optimizers(spec.model())
            optimizer = named_optimizers(built, "optimizers(model)")
        else:
            built = spec.optimizer(stand_ins) if spec.optimizer else torch.optim.AdamW(stand_ins, lr=ctx.config.lr)
            optimizer = {"optimizer": built}
        schedulers = flat_schedulers(spec.scheduler(built))
    except Exception:  # noqa: BLE001 - the probes built them on the real parameters; only the dry run cannot
        return None
    first: torch.optim.Optimizer = next(
        iter(optimizer.values())
    )  # the first optimizer's learning rate, as the records show
    if not schedulers or any(metric_driven(s) for s in schedulers):
        return None
    if spec.start is not None:  # the probes take up a checkpoint's schedule: so does its dry run
        _resume_schedule(spec.start, optimizer, schedulers)
    lrs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCHEDULER_ORDER_WARNING)  # no optimizer steps in a dry run
        for _ in range(_scheduler_steps(ctx)):
            lrs.append(float(first.param_groups[0][Column.LR]))
            try:
                for scheduler in schedulers:
                    scheduler.step()
            except Exception:  # noqa: BLE001 - e.g. OneCycleLR past its total_steps: the probes show it as the user's error
                break
    return lrs


def _resume_schedule(start: TrainedStart, optimizers: dict[str, Any], schedulers: list[Any]) -> None:
    """The dry run's optimizers and schedulers where the checkpoint left them: each group's learning rate (a
    chained scheduler multiplies the current one) and each scheduler's position, as the probes restore them."""
    try:
        states = start.optimizer_states_for(list(optimizers)) or []
    except CheckpointError:  # the probes refuse it with the message; the dry run needs none
        return
    for optimizer, state in zip(optimizers.values(), states):
        for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({key: saved[key] for key in ("lr", "initial_lr") if key in saved})
    resume_schedulers(start, schedulers, lambda _: None)  # as the probes take theirs up (their notes say how)


def _scheduler_steps(ctx: StageContext) -> int:
    """How many learning rates the training uses: one per optimizer step, so under gradient accumulation fewer
    than the probe's steps (the FP32 baseline's steps that were no accumulation micro-step, once it ran). A rate
    past them is never used (OneCycleLR past its ``total_steps`` is garbage, not a jump)."""
    steps = ctx.evidence.steps
    fp32 = ctx.evidence.fp32
    if fp32 is not None and "micro_step" in fp32.records:
        steps -= int(
            fp32.records[Column.MICRO_STEP].astype(bool).sum()
        )  # an FP32 run that ended early ends no schedule
    return max(steps, 1)


def schedule_events(lrs: list[float]) -> dict[str, Any]:
    """The schedule's peak and its largest jump (the step and the ratio to the step before)."""
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    ratios = [lrs[t] / lrs[t - 1] if lrs[t - 1] > 0 else math.inf for t in range(1, len(lrs))]
    jump = (max(range(len(ratios)), key=ratios.__getitem__) + 1) if ratios else 0
    return {
        "lrs": lrs,
        "peak_step": peak,
        "peak_lr": lrs[peak],
        "jump_step": jump,
        "jump_ratio": ratios[jump - 1] if ratios else 1.0,
    }


def skips_start_at_schedule_event(ctx: StageContext) -> int | None:
    """The LR event (peak or largest jump, after step 0) right before AMP's first skip, if the skips start there."""
    amp = ctx.evidence.amp
    if not ctx.evidence.has_scheduler or amp is None or not amp.skip_steps:
        return None
    return ctx.schedule_event_before(amp.skip_steps[0])
