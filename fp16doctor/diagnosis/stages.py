"""The triage stages. Each measures, fills :class:`Evidence`, and reports what it found.

The order is the expert's: data, FP32 baseline, AMP as configured,
localisation of the first bad step, the loss-scale sweep, the pause at the LR
schedule's peak, the precision-gap search. A stage that cannot add anything is
skipped with the reason; the FP32 and AMP probes always run.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd
import torch

from ..compare import compare, run_aligned
from ..config import DoctorConfig, build_config, merge
from ..datascan import scan_batches
from ..instruments import InstrumentOptions, module_names, precision_map
from ..localise import Localisation, localise
from ..numerics import capture_gradients, observed_underflow, predicted_underflow, scale_window
from ..probe import DEFAULT_INSTRUMENTS, SCHEDULER_ORDER_WARNING, Probe, ProbeSnapshot, Workbench, metric_driven
from ..rng import seed_everything
from ..symptoms import Symptom, first_nonfinite, loss_floor, measure, probe_symptoms, relative_deviation, skip_runs
from ..thresholds import BF16_FACTOR, CALIBRATION_SKIPS, DRIFT_ERROR, GAP_TOLERANCE, KEEP_MASS, UNDERFLOW_ALARM
from .model import Evidence, ProbeSummary, StageReport



@dataclass
class StageContext:
    """What every stage gets: the workbench, the config, the evidence so far, and the run options."""

    bench: Workbench
    config: DoctorConfig
    evidence: Evidence
    ci: bool = False
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """FP32 trajectory weights by step, shared by the stages that evaluate the same states."""
    loss_floor: float = 0.0
    """The denominator floor of same-state loss deviations (:func:`fp16doctor.symptoms.loss_floor`)."""
    amp_snapshots: dict[int, ProbeSnapshot] = field(default_factory=dict)
    """The AMP probe's full state right before the LR schedule's peak and jump: the LR-peak stage
    pauses there without replaying the run (at most two snapshots)."""

    def with_config(self, patch: dict[str, Any]) -> DoctorConfig:
        return build_config(merge(self.config.to_dict(), patch))

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


# --- helpers -----------------------------------------------------------------------------------------

def summarise(probe: Probe) -> ProbeSummary:
    """Turn a finished probe into the summary the rules read."""
    tables = probe.instruments.frames() if probe.instruments is not None else {}
    clip_calls = [dict(c, step=r.step) for r in probe.records if r.trace for c in r.trace.clip_calls]
    loss_dtypes = sorted({r.trace.loss_dtype for r in probe.records if r.trace and r.trace.loss_dtype})
    return ProbeSummary(
        mode=probe.mode, records=probe.frame(), tables=tables,
        precision=precision_map(probe.model, probe.optimizer, probe.instruments.compute_dtypes if probe.instruments else None),
        clip_calls=clip_calls, loss_dtypes=loss_dtypes,
        first_nonfinite_forward=probe.instruments.first_nonfinite_forward() if probe.instruments else None,
        scaler_enabled=probe.scaler.is_enabled(),
        scaler_called=any(r.trace.scale_called for r in probe.records if r.trace),
        scaler_calls=[list(r.trace.scaler_calls) if r.trace else [] for r in probe.records],
    )


def run_mode(ctx: StageContext, mode: str, config: DoctorConfig | None = None, steps: int | None = None,
             before_step: Callable[[Probe], None] | None = None,
             instruments: InstrumentOptions | None = DEFAULT_INSTRUMENTS) -> ProbeSummary:
    """Run a fresh probe of ``mode`` (every instrument unless told fewer: a probe whose tables no rule reads
    need not pay for them) and summarise it."""
    probe = ctx.bench.probe(mode, config or ctx.config, instruments=instruments)
    try:
        probe.run(steps or ctx.evidence.steps, before_step=before_step)
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
        with reference.mode_context():
            for step in wanted:
                while reference.iteration < step:
                    reference.step()
                ctx.states[step] = copy.deepcopy(reference.model.state_dict())
    finally:
        reference.close()


def probe_at(ctx: StageContext, mode: str, config: DoctorConfig, step: int) -> Probe:
    """A probe of ``mode`` holding the FP32 trajectory's weights at ``step``, about to take that step."""
    probe = ctx.bench.probe(mode, config, instruments=None)
    probe.model.load_state_dict(fp32_state_at(ctx, step))
    probe.iteration = probe.cursor = step
    seed_everything(ctx.config.seed + step)  # the same dropout masks in every mode
    return probe


def same_state_losses(ctx: StageContext, step: int, configs: dict[str, tuple[str, DoctorConfig]]) -> dict[str, float]:
    """Loss of each (mode, config) on the FP32 trajectory's state at ``step``: same weights, same batch."""
    losses = {}
    for key, (mode, config) in configs.items():
        probe = probe_at(ctx, mode, config, step)
        try:
            with probe.mode_context():
                losses[key] = probe.step().loss
        finally:
            probe.close()
    return losses


def worst_underflow(observed: pd.DataFrame | None) -> float:
    """The largest share of a tensor's gradient mass that flushed to zero, negligible gradients left out."""
    if observed is None or observed.empty:
        return 0.0
    if "negligible" in observed:
        observed = observed[~observed["negligible"].astype(bool)]
    return float(observed["observed_underflow_mass"].max()) if len(observed) else 0.0


def same_state_gap(ctx: StageContext, config: DoctorConfig, step: int) -> float:
    """AMP under ``config`` against fp32 on the FP32 trajectory's state at ``step``: same weights, same batch."""
    losses = same_state_losses(ctx, step, {"fp32": ("fp32", ctx.config), "amp": ("amp", config)})
    return relative_deviation(losses["amp"], losses["fp32"], ctx.loss_floor)


def measured_symptoms(ctx: StageContext, config: DoctorConfig, amp: ProbeSummary | None, fp32: ProbeSummary | None,
                      gap: float | None) -> list[Symptom]:
    """The symptoms of an AMP probe against FP32 (:func:`fp16doctor.symptoms.probe_symptoms`): the verdict's
    and every fix's verification.

    A trajectory drift after skipped steps is measured again on an AMP run aligned on the steps taken (a
    skipped batch retried with the same RNG; the scheduler still steps on a skip, as the user's loop does):
    a run that skipped k steps is k updates behind on other batches, and on a short probe that lag alone can
    look like a drift. What remains aligned is precision's, or the schedule's.
    """
    if amp is None:
        return []
    bf16 = config.dtype == "bfloat16"
    found = probe_symptoms(amp, fp32, gap, bf16=bf16)
    if fp32 is None or not amp.skip_steps or not any(s.code == "trajectory-drift" for s in found):
        return found
    aligned = ctx.bench.probe("amp", config, align_on_taken_steps=True, instruments=None, hold_scheduler_on_retry=False)
    try:
        records = aligned.run(ctx.evidence.steps)
    finally:
        aligned.close()
    drift = [s for s in measure(records, fp32.records, bf16=bf16) if s.code == "trajectory-drift"]
    for symptom in drift:
        symptom.measured["aligned_on_steps_taken"] = True
        symptom.description += " (aligned on the steps taken: not the lag of the skipped steps)"
    return [s for s in found if s.code != "trajectory-drift"] + drift


# --- stages ------------------------------------------------------------------------------------------

def stage_data(ctx: StageContext) -> StageReport:
    ctx.evidence.data = scan = scan_batches(ctx.bench.batches)
    bad = [f for f in scan if f.nonfinite]
    extreme = [f for f in scan if f.floating and f.abs_max >= 1e3]
    distinct = len({id(b) for b in ctx.bench.batches})
    parts = [f"{distinct} batches, {len(scan)} fields"]
    if bad:
        parts.append("non-finite values in " + ", ".join(f"'{f.field}' ({f.nan} NaN, {f.posinf + f.neginf} inf; first in batch {f.first_nonfinite['batch']})" for f in bad))
    if extreme:
        parts.append("extreme magnitudes in " + ", ".join(f"'{f.field}' (|x| up to {f.abs_max:.3g})" for f in extreme))
    if not bad and not extreme:
        parts.append("all finite, magnitudes fp16 can carry")
    return StageReport("data scan", "ran", "; ".join(parts), details={"fields": [f.to_json() for f in scan]})


def gap_states(ctx: StageContext) -> list[int]:
    """The FP32 trajectory steps at which the precision-gap search compares AMP with FP32 on the same state."""
    steps = ctx.evidence.steps
    return sorted({0, steps // 2, steps - 1}) if not ctx.ci else sorted({0, steps - 1})


def stage_fp32(ctx: StageContext) -> StageReport:
    """The baseline run; it also keeps its weights at the steps the precision-gap search evaluates (no second run)."""
    wanted = set(gap_states(ctx))

    def keep_state(probe: Probe) -> None:
        if probe.iteration in wanted:
            ctx.states[probe.iteration] = copy.deepcopy(probe.model.state_dict())

    ctx.evidence.fp32 = summary = run_mode(ctx, "fp32", before_step=keep_state)
    return StageReport("fp32 baseline", "ran", _probe_sentence(summary), details=_probe_details(summary))


def stage_amp(ctx: StageContext) -> StageReport:
    """AMP as configured; it also keeps its state right before the LR schedule's events (no replay to pause there)."""
    events = set(ctx.schedule_event_steps())

    def keep_snapshot(probe: Probe) -> None:
        if probe.iteration in events:
            ctx.amp_snapshots[probe.iteration] = probe.snapshot()

    ctx.evidence.amp = summary = run_mode(ctx, "amp", before_step=keep_snapshot)
    return StageReport("amp as configured", "ran", _probe_sentence(summary), details=_probe_details(summary))


def _probe_sentence(summary: ProbeSummary) -> str:
    rec = summary.records
    if summary.exception:
        e = summary.exception
        return f"stopped at step {e['step']}: {e['type']}: {e['message']} ({e['location']})"
    parts = [f"{len(rec)} steps, loss {rec['loss'].iloc[0]:.4g} -> {rec['loss'].iloc[-1]:.4g}"]
    if summary.first_nonfinite_loss is not None:
        parts.append(f"loss non-finite from step {summary.first_nonfinite_loss}")
    skips = summary.skip_steps
    if skips:
        parts.append(f"{len(skips)} skipped step(s) (first {skips[:5]})")
    return "; ".join(parts)


def _probe_details(summary: ProbeSummary) -> dict[str, Any]:
    rec = summary.records
    return {
        "steps": len(rec), "first_nonfinite_loss": summary.first_nonfinite_loss,
        "first_nonfinite_grads": summary.first_nonfinite_grads, "skipped_steps": summary.skip_steps,
        "final_loss": float(rec["loss"].iloc[-1]) if len(rec) else None, "exception": summary.exception,
    }


def stage_localise(ctx: StageContext) -> StageReport:
    ev = ctx.evidence
    notes = []
    if ev.fp32 is not None and not ev.fp32.finite and ev.fp32.exception is None:
        step = _bad_step(ev.fp32)
        ev.fp32_localisation = localise(ctx.bench, "fp32", step, ctx.config)
        if ev.fp32_localisation:
            notes.append("fp32: " + ev.fp32_localisation.describe())
    amp = ev.amp
    if amp is None or amp.finite or amp.exception is not None:
        if not notes:
            return StageReport("localisation", "skipped", "no non-finite step to localise")
        return StageReport("localisation", "ran", "; ".join(notes))
    step = _bad_step(amp)
    first = localise(ctx.bench, "amp", step, ctx.config)
    ev.localisation = first
    ev.localisation_deterministic = first is not None and reproduces(first, amp)
    if first is None:
        notes.append(f"amp step {step}: the replay stayed finite (non-deterministic fault?)")
    else:
        notes.append("amp: " + first.describe() + ("" if ev.localisation_deterministic else " (the replay differed: non-deterministic)"))
    return StageReport("localisation", "ran", "; ".join(notes),
                       details={"amp": first.to_json() if first else None, "deterministic": ev.localisation_deterministic,
                                "fp32": ev.fp32_localisation.to_json() if ev.fp32_localisation else None})


def reproduces(found: Localisation, original: ProbeSummary) -> bool:
    """Whether the replay walked the original run's path: the same loss and loss scale at every step before
    the traced one (bit for bit), and the fault at the same step. One replay checked against the original
    run is as strict as two replays checked against each other, at half the cost."""
    rows = original.records[original.records["step"] < found.step]
    expected = list(zip(rows["loss"].astype(float), rows["loss_scale"].astype(float)))
    return len(expected) == len(found.replayed) and all(
        _same(a, b) and _same(c, d) for (a, c), (b, d) in zip(expected, found.replayed))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _bad_step(summary: ProbeSummary) -> int:
    """The step to localise: the first the training did not survive (an inf/NaN loss, or inf/NaN gradients
    applied to the weights), else the first whose gradients the GradScaler caught. A skip is the scaler at
    work; a forward that overflows a few steps later is the fault the user sees."""
    unhandled = first_nonfinite(summary.records)
    if unhandled is not None:
        return unhandled
    candidates = [s for s in (summary.first_nonfinite_loss, summary.first_nonfinite_grads) if s is not None]
    return min(candidates)


def stage_scale(ctx: StageContext) -> StageReport:
    """The loss-scale window from FP32 gradients, underflow at the configured scale, and the sweep."""
    ev, cfg = ctx.evidence, ctx.config
    if cfg.dtype != "float16":
        return StageReport("loss-scale sweep", "skipped", "bfloat16 has fp32's range: no loss scaling needed")
    if ev.fp32 is None or not ev.fp32.finite:
        return StageReport("loss-scale sweep", "skipped", "the fp32 baseline is not finite: scaling cannot help")
    reference = ctx.bench.probe("fp32", cfg, instruments=None)
    try:
        capture = capture_gradients(reference)  # step 0 from the start: the same step observed_underflow compares
    finally:
        reference.close()
    ev.window = window = scale_window(capture)
    configured = cfg.scaler.init_scale if cfg.scaler.enabled else 1.0
    ev.predicted_underflow = predicted_underflow(capture, configured)
    ev.observed_underflow = observed_underflow(ctx.bench, config=cfg, reference=capture)
    worst_predicted = float(ev.predicted_underflow["predicted_underflow_mass"].max()) if len(ev.predicted_underflow) else 0.0
    worst_observed = worst_underflow(ev.observed_underflow)
    amp = ev.amp
    skips = len(amp.skip_steps) if amp is not None else 0
    needs_sweep = skips > 0 or worst_observed > UNDERFLOW_ALARM or worst_predicted > UNDERFLOW_ALARM or not cfg.scaler.enabled
    summary = (f"window [{window.low:.3g}, {window.high:.3g}] (recommended {window.recommended():.0f}"
               + ("" if window.feasible else "; infeasible: no scale keeps the small gradients without overflowing the large")
               + "); "
               f"at the configured scale {configured:.0f}: predicted underflow {worst_predicted:.1%}, "
               f"observed {worst_observed:.1%} of a tensor's gradient mass")
    if not needs_sweep:
        return StageReport("loss-scale sweep", "skipped", summary + "; no skips or underflow: nothing to sweep",
                           details={"window": [window.low, window.high]})
    if amp is not None and amp.first_nonfinite_loss is not None:
        why = "AMP raised an exception" if amp.exception is not None else "the loss itself turns non-finite"
        return StageReport("loss-scale sweep", "skipped", summary + f"; {why}: no loss scale can fix that",
                           details={"window": [window.low, window.high]})
    event = skips_start_at_schedule_event(ctx)
    if event is not None and not (worst_observed > UNDERFLOW_ALARM or not cfg.scaler.enabled):
        return StageReport("loss-scale sweep", "skipped", summary + f"; the skips start right at the LR schedule's peak or jump "
                           f"(step {event}): a sweep from the start cannot see them, the LR-peak stage pauses there",
                           details={"window": [window.low, window.high], "schedule_event": event})
    ev.sweep = sweep = _sweep(ctx, capture, window)
    ev.recommended_scaler = _recommend(ctx, sweep, window)
    summary += f"; swept {len(sweep)} settings; recommended {ev.recommended_scaler}"
    return StageReport("loss-scale sweep", "ran", summary, details={"window": [window.low, window.high], "window_recommended": window.recommended(), "sweep": sweep.to_dict("records"),
                                                             "recommended": ev.recommended_scaler})


SWEEP_SETTINGS = 4
"""At most this many initial scales (plus the recommended one): powers of 16 around the derived window."""


def _sweep_scales(window: Any, ci: bool) -> list[float]:
    """Powers of 16 (2^8 apart with --ci) from 16x below the window to 16x above it, nearest the recommended scale."""
    low = max(1.0, window.low / 16) if window.feasible else 1.0
    high = min(2.0**24, window.high * 16) if window.feasible else 2.0**24
    centre = math.log2(window.recommended())
    exponents = range(int(math.floor(math.log2(low))), int(math.ceil(math.log2(high))) + 1, 4 if not ci else 8)
    nearest = sorted(exponents, key=lambda e: abs(e - centre))[:SWEEP_SETTINGS]
    scales = sorted({float(2**e) for e in nearest} | {window.recommended()})
    return [s for s in scales if 1.0 <= s <= 2.0**24]


def _sweep(ctx: StageContext, capture: Any, window: Any) -> pd.DataFrame:
    """Each setting: skipped-step rate, predicted underflow and loss deviation from fp32 on aligned steps."""
    steps = min(ctx.evidence.steps, 10)  # the scale settles (or not) within the first steps
    rows = []
    settings: list[dict[str, Any]] = [{"init_scale": s} for s in _sweep_scales(window, ctx.ci)]
    amp = ctx.evidence.amp
    if amp is not None and len(skip_runs(amp.skip_steps)) >= 3:  # skips keep coming back: try slower growth too
        base = window.recommended()
        for interval in (ctx.config.scaler.growth_interval * 10, ctx.config.scaler.growth_interval * 100):
            settings.append({"init_scale": base, "growth_interval": int(interval)})
    baseline = run_aligned(ctx.bench, "fp32", ctx.config, steps, instruments=None)  # one FP32 reference for every setting
    for setting in settings:
        config = ctx.with_config({"scaler": {"enabled": True, **setting}})
        # A setting still skipping after the calibration allowance has failed: no need to watch it further.
        result = compare(ctx.bench, ["amp"], steps=steps, config=config, reference=baseline, instruments=None,
                         max_iterations=steps + CALIBRATION_SKIPS + 2)
        trajectory = result.trajectories["amp"]
        iterations = len(trajectory.records)
        under = predicted_underflow(capture, setting["init_scale"])["predicted_underflow_mass"].max()
        rows.append({
            "init_scale": setting["init_scale"], "growth_interval": setting.get("growth_interval", ctx.config.scaler.growth_interval),
            "skip_rate": trajectory.skipped / max(iterations, 1), "predicted_underflow": float(under),
            "max_rel_dev": result.max_rel_dev.get("amp"), "verdict": result.verdict_by_mode["amp"],
        })
    return pd.DataFrame(rows)


def _recommend(ctx: StageContext, sweep: pd.DataFrame, window: Any) -> dict[str, Any]:
    """The setting with no divergence, underflow under 0.1% and the fewest skips; then the closest to fp32,
    where that differs by a symptom's worth (deviations under ``DRIFT_ERROR`` are data-order noise of a
    short run, not a reason to pick a scale); then the scale nearest the window's recommended one (the most
    headroom on both sides), then the larger."""
    ok = sweep[(sweep["verdict"] != "diverged") & (sweep["predicted_underflow"] <= 1 - KEEP_MASS)]
    if ok.empty:
        ok = sweep[sweep["verdict"] != "diverged"]
    if ok.empty:
        return {"init_scale": window.recommended(), "growth_interval": ctx.config.scaler.growth_interval}
    dev = ok["max_rel_dev"].fillna(math.inf)
    ok = ok.assign(dev_band=(dev >= DRIFT_ERROR).astype(int) + (dev == math.inf).astype(int),
                   distance=(ok["init_scale"].map(math.log2) - math.log2(window.recommended())).abs())
    best = ok.sort_values(["skip_rate", "dev_band", "distance", "init_scale"], ascending=[True, True, True, False]).iloc[0]
    return {"init_scale": float(best["init_scale"]), "growth_interval": int(best["growth_interval"])}


def scheduler_lrs(ctx: StageContext) -> list[float] | None:
    """Dry-run a copy of the user's scheduler over the run, on a throw-away optimizer; None for a scheduler
    that follows the loss (``ReduceLROnPlateau``): it has no schedule to know in advance."""
    spec = ctx.bench.spec
    # Shape-only stand-ins for the model's parameters: an optimizer() that groups them (by dimension, say)
    # builds the same groups, and nothing is allocated (the dry run never steps the optimizer).
    stand_ins = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in ctx.bench.parameter_shapes]
    try:
        optimizer = spec.optimizer(stand_ins) if spec.optimizer else torch.optim.AdamW(stand_ins, lr=ctx.config.lr)
        scheduler = spec.scheduler(optimizer)
    except Exception:  # noqa: BLE001 - the probes built them on the real parameters; only the dry run cannot
        return None
    if metric_driven(scheduler):
        return None
    lrs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCHEDULER_ORDER_WARNING)  # no optimizer steps in a dry run
        for _ in range(ctx.evidence.steps):
            lrs.append(float(optimizer.param_groups[0]["lr"]))
            try:
                scheduler.step()
            except Exception:  # noqa: BLE001 - e.g. OneCycleLR past its total_steps: the probes show it as the user's error
                break
    return lrs


def schedule_events(lrs: list[float]) -> dict[str, Any]:
    """The schedule's peak and its largest jump (the step and the ratio to the step before)."""
    peak = max(range(len(lrs)), key=lrs.__getitem__)
    ratios = [lrs[t] / lrs[t - 1] if lrs[t - 1] > 0 else math.inf for t in range(1, len(lrs))]
    jump = (max(range(len(ratios)), key=ratios.__getitem__) + 1) if ratios else 0
    return {"lrs": lrs, "peak_step": peak, "peak_lr": lrs[peak], "jump_step": jump, "jump_ratio": ratios[jump - 1] if ratios else 1.0}


def skips_start_at_schedule_event(ctx: StageContext) -> int | None:
    """The LR event (peak or largest jump, after step 0) right before AMP's first skip, if the skips start there."""
    amp = ctx.evidence.amp
    if not ctx.evidence.has_scheduler or amp is None or not amp.skip_steps:
        return None
    first = amp.skip_steps[0]
    return next((e for e in ctx.schedule_event_steps() if e <= first <= e + 3), None)


def stage_lr_peak(ctx: StageContext) -> StageReport:
    ev = ctx.evidence
    if not ev.has_scheduler:
        return StageReport("LR schedule peak", "skipped", "no scheduler() in the training file")
    if ctx.schedule is None:
        return StageReport("LR schedule peak", "skipped", "no schedule to dry-run: the scheduler follows the loss "
                           "(ReduceLROnPlateau), or cannot be built apart from the training")
    ev.lr_peak = info = dict(ctx.schedule)
    lrs, peak, jump = info["lrs"], info["peak_step"], info["jump_step"]
    amp = ev.amp
    trouble = None
    if amp is not None and not amp.finite:
        trouble = _bad_step(amp) if amp.exception is None else None
    near = [e for e in ctx.schedule_event_steps() if trouble is not None and e <= trouble <= e + 3]
    summary = f"peak lr {lrs[peak]:.3g} at step {peak}; largest jump x{info['jump_ratio']:.3g} at step {jump}"
    if not near:
        return StageReport("LR schedule peak", "skipped", summary + "; no trouble at the peak or jump to explain", details=info)
    event = near[0]
    info.update(_pause(ctx, event, lrs))
    summary += (f"; paused at step {event}: at lr {lrs[event]:.3g} the step is {'finite' if info['finite_at_peak'] else 'NOT finite'}, "
                f"at the pre-peak lr {lrs[event - 1]:.3g} it is {'finite' if info['finite_before_peak'] else 'NOT finite'}")
    return StageReport("LR schedule peak", "ran", summary, details=info)


def _pause(ctx: StageContext, event: int, lrs: list[float]) -> dict[str, Any]:
    """From the AMP run's state right before ``event`` (kept by the AMP stage, else replayed), take that step
    at its own and at the previous learning rate."""
    probe = ctx.bench.probe("amp", ctx.config)
    try:
        with probe.mode_context():
            snap = ctx.amp_snapshots.get(event)
            if snap is None:
                while probe.iteration < event and probe.failed is None:
                    probe.step()
                snap = probe.snapshot()
            probe.restore(snap)
            at_peak = _instrumented_step(probe)
            probe.restore(snap)
            before = _instrumented_step(probe, lr=lrs[event - 1])
    finally:
        probe.close()
    return {"pause_step": event, "finite_at_peak": at_peak["finite"], "finite_before_peak": before["finite"],
            "update_to_weight_at_peak": at_peak["update_to_weight"], "update_to_weight_before_peak": before["update_to_weight"],
            "activation_max_at_peak": at_peak["activation_max"], "activation_max_before_peak": before["activation_max"]}


def _instrumented_step(probe: Probe, lr: float | None = None) -> dict[str, Any]:
    """Take the step (at ``lr`` if given) and the one after it: an update's damage shows in the next forward."""
    rows_before = len(probe.instruments.update_rows), len(probe.instruments.forward_rows)
    records = []
    for _ in range(2):
        if lr is not None:
            for group in probe.optimizer.param_groups:
                group["lr"] = lr
        records.append(probe.step())
    updates = probe.instruments.update_rows[rows_before[0]:]
    forward = probe.instruments.forward_rows[rows_before[1]:]
    weights_finite = all(torch.isfinite(p).all() for p in probe.model.parameters())
    return {
        "finite": all(r.exception_type is None and not r.nonfinite_loss and not r.nonfinite_grads for r in records) and weights_finite,
        "update_to_weight": max((u["update_to_weight"] for u in updates), default=0.0),
        "activation_max": max((f["abs_max"] for f in forward), default=0.0),
    }


def stage_precision_gap(ctx: StageContext) -> StageReport:
    ev, cfg = ctx.evidence, ctx.config
    amp = ev.amp
    if amp is None or amp.exception is not None or amp.first_nonfinite_loss is not None:
        return StageReport("precision-gap search", "skipped", "AMP is not finite: a range problem, not a precision gap")
    tolerance = GAP_TOLERANCE * (BF16_FACTOR if cfg.dtype == "bfloat16" else 1.0)
    states = gap_states(ctx)
    floor = loss_floor(ev.fp32.records) if ev.fp32 is not None else 0.0
    ctx.loss_floor = floor
    remember_fp32_states(ctx, states)
    gaps = {}
    for step in states:
        losses = same_state_losses(ctx, step, {"fp32": ("fp32", cfg), "amp": ("amp", cfg)})
        gaps[step] = relative_deviation(losses["amp"], losses["fp32"], floor)
    worst_step = max(gaps, key=gaps.get)
    gap = gaps[worst_step]
    ev.gap = info = {"same_state_rel_dev": gaps, "worst_step": worst_step, "gap": gap, "tolerance": tolerance}
    if gap <= tolerance:
        return StageReport("precision-gap search", "skipped",
                           f"AMP matches fp32 on the same state (largest deviation {gap:.3%} at step {worst_step})", details=info)
    if cfg.scaler.enabled and cfg.dtype == "float16":
        # The loss of one step does not depend on the loss scale, unless the scale leaks into it.
        info["gap_without_loss_scaling"] = plain = same_state_gap(ctx, ctx.with_config({"scaler": {"enabled": False}}), worst_step)
        if plain <= tolerance:
            info["scale_leak"] = True
            return StageReport("precision-gap search", "ran",
                               f"AMP deviates {gap:.3%} from fp32 on the same state (step {worst_step}), and {plain:.3%} with loss "
                               "scaling off: the loss scale leaks into the loss (not a precision gap)", details=info)
    ranked = _rank_modules(ctx, worst_step)
    info["ranked_modules"] = ranked[:8]
    fix = _search_fp32_set(ctx, worst_step, [r["module"] for r in ranked], tolerance)
    info.update(fix)
    closed = fix.get("closing_set")
    summary = f"AMP deviates {gap:.3%} from fp32 on the same state (step {worst_step}); "
    summary += f"keeping {closed} in fp32 closes it ({fix['closed_gap']:.3%})" if closed else "no fp32 module set tried closes it"
    return StageReport("precision-gap search", "ran", summary, details=info)


def _rank_modules(ctx: StageContext, step: int) -> list[dict[str, Any]]:
    """Per module: the relative error its output adds over its input, AMP against fp32, same state and batch."""
    outputs: dict[str, dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
    for mode in ("fp32", "amp"):
        probe = probe_at(ctx, mode, ctx.config, step)
        names = {m: n for m, n in module_names(probe.model).items() if n != "<root>"}
        captured: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

        def hook(module: torch.nn.Module, args: Any, output: Any, captured=captured, names=names) -> None:
            if module in names and names[module] not in captured:
                first_in = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
                out = output if isinstance(output, torch.Tensor) else next((o for o in (output if isinstance(output, (tuple, list)) else []) if isinstance(o, torch.Tensor)), None)
                captured[names[module]] = (first_in.detach().double().clone() if first_in is not None else None,
                                           out.detach().double().clone() if out is not None and out.is_floating_point() else None)

        handles = [m.register_forward_hook(hook) for m in names]
        try:
            with probe.mode_context():
                probe.step()
        finally:
            for h in handles:
                h.remove()
            probe.close()
        outputs[mode] = captured
    ranked = []
    for name, (in32, out32) in outputs["fp32"].items():
        in16, out16 = outputs["amp"].get(name, (None, None))
        if out32 is None or out16 is None or out32.shape != out16.shape:
            continue
        err_out = _rel_err(out16, out32)
        err_in = _rel_err(in16, in32) if in32 is not None and in16 is not None and in32.shape == in16.shape else 0.0
        ranked.append({"module": name, "added_error": max(err_out - err_in, 0.0), "output_error": err_out, "input_error": err_in})
    ranked.sort(key=lambda r: r["added_error"], reverse=True)
    return ranked


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm((a - b).nan_to_num(nan=1e30, posinf=1e30, neginf=1e30)).item()
    return diff / max(torch.linalg.vector_norm(b).item(), 1e-30)


def _search_fp32_set(ctx: StageContext, step: int, candidates: list[str], tolerance: float) -> dict[str, Any]:
    """The smallest set of modules (greedy, in ranked order) whose fp32 fallback closes the gap."""
    limit = 3 if ctx.ci else 6
    chosen: list[str] = []
    tried = []
    for name in candidates[:limit]:
        trial = chosen + [name]
        gap = same_state_gap(ctx, ctx.with_config({"overrides": {"fp32_modules": trial}}), step)
        tried.append({"fp32_modules": trial, "gap": gap})
        if gap <= tolerance:
            return {"closing_set": trial, "closed_gap": gap, "tried": tried}
        best_before = min((t["gap"] for t in tried[:-1]), default=math.inf)
        if gap < best_before:
            chosen = trial  # keep a module only if it helps
    return {"closing_set": None, "closed_gap": None, "tried": tried}


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
        return StageReport("bf16 check", "skipped", "no fp16 range trouble to compare against" if ctx.config.dtype != "bfloat16" else "already bfloat16")
    ev.bf16 = summary = run_mode(ctx, "bf16", instruments=None)  # the bf16 advice reads the records only
    ev.bf16_supported = torch.cuda.is_bf16_supported() if ctx.bench.device.type == "cuda" else True
    return StageReport("bf16 check", "ran", _probe_sentence(summary), details=_probe_details(summary))


STAGES: list[tuple[str, Callable[[StageContext], StageReport]]] = [
    ("data scan", stage_data),
    ("fp32 baseline", stage_fp32),
    ("amp as configured", stage_amp),
    ("localisation", stage_localise),
    ("loss-scale sweep", stage_scale),
    ("LR schedule peak", stage_lr_peak),
    ("precision-gap search", stage_precision_gap),
    ("bf16 check", stage_bf16),
]
