"""Stage 5, the loss-scale sweep: the window derived from FP32 gradients, underflow, and the sweep."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from ...config import scaler_patch
from ...measure.compare import compare, run_aligned
from ...measure.numerics import (
    capture_gradients,
    observed_underflow,
    predicted_underflow,
    scale_window,
)
from ...measure.symptoms import skip_runs
from ...measure.thresholds import (
    CALIBRATION_SKIPS,
    DRIFT_ERROR,
    KEEP_MASS,
    UNDERFLOW_ALARM,
)
from ..findings import StageName, StageReport, StageStatus
from .context import StageContext, skips_start_at_schedule_event, worst_underflow


def stage_scale(ctx: StageContext) -> StageReport:
    """The loss-scale window from FP32 gradients, underflow at the configured scale, and the sweep."""
    ev, cfg = ctx.evidence, ctx.config
    if cfg.dtype != "float16":
        return StageReport(
            StageName.LOSS_SCALE, StageStatus.SKIPPED, "bfloat16 has fp32's range: no loss scaling needed"
        )
    if ev.fp32 is None or not ev.fp32.finite:
        failed = f"raised {ev.fp32.exception.type}" if ev.fp32 is not None and ev.fp32.exception else "is not finite"
        return StageReport(
            StageName.LOSS_SCALE, StageStatus.SKIPPED, f"the fp32 baseline {failed}: scaling cannot help"
        )
    with ctx.progress.planned(2):  # step 0 in FP32 and in AMP; the sweep plans its own steps
        reference = ctx.bench.probe(
            "fp32", cfg, instruments=None
        )  # micro-batched if planned: the capture is the whole batch's
        try:
            capture = capture_gradients(reference)  # step 0 from the start: the same step observed_underflow compares
        finally:
            reference.close()
        del reference  # freed before observed_underflow and the sweep build their probes
        ev.observed_underflow = observed_underflow(ctx.bench, config=cfg, reference=capture)
    ev.window = window = scale_window(capture)
    taken_up = _checkpoint_scale(ctx) if cfg.scaler.enabled else None  # where the AMP probe starts, if not at init
    configured = taken_up or (cfg.scaler.init_scale if cfg.scaler.enabled else 1.0)
    whose = "the checkpoint's" if taken_up else "the configured"
    ev.predicted_underflow = predicted_underflow(capture, configured)
    worst_predicted = window.worst_signal_underflow(ev.predicted_underflow)
    worst_observed = worst_underflow(ev.observed_underflow)
    amp = ev.amp
    skips = len(amp.skip_steps) if amp is not None else 0
    needs_sweep = (
        skips > 0 or worst_observed > UNDERFLOW_ALARM or worst_predicted > UNDERFLOW_ALARM or not cfg.scaler.enabled
    )
    summary = (
        f"window [{window.low:.3g}, {window.high:.3g}] from FP32's gradients (centre {window.recommended():.0f}"
        + ("" if window.feasible else "; infeasible: no scale keeps the small gradients without overflowing the large")
        + "); "
        f"at {whose} scale {configured:.0f}: predicted underflow {worst_predicted:.1%}, "
        f"observed {worst_observed:.1%} of a tensor's gradient mass"
    )
    if not needs_sweep:
        return StageReport(
            StageName.LOSS_SCALE,
            StageStatus.SKIPPED,
            summary + "; no skips or underflow: nothing to sweep",
            details={"window": [window.low, window.high]},
        )
    if amp is not None and amp.first_nonfinite_loss is not None:
        why = "AMP raised an exception" if amp.exception is not None else "the loss itself turns non-finite"
        return StageReport(
            StageName.LOSS_SCALE,
            StageStatus.SKIPPED,
            summary + f"; {why}: no loss scale can fix that",
            details={"window": [window.low, window.high]},
        )
    event = skips_start_at_schedule_event(ctx)
    if event is not None and not (worst_observed > UNDERFLOW_ALARM or not cfg.scaler.enabled):
        return StageReport(
            StageName.LOSS_SCALE,
            StageStatus.SKIPPED,
            summary + f"; the skips start right at the LR schedule's peak or jump "
            f"(step {event}): a sweep from the start cannot see them, the LR-peak stage pauses there",
            details={"window": [window.low, window.high], "schedule_event": event},
        )
    ev.sweep = sweep = _sweep(ctx, capture, window)
    ev.recommended_scaler = _recommend(ctx, sweep, window)
    stable = bool((sweep["verdict"] != "diverged").any())
    summary += (
        f"; swept {len(sweep)} settings, "
        + ("measured best: " if stable else "none stable; the window's centre: ")
        + ", ".join(f"{k}={v:.0f}" if v >= 1 else f"{k}={v:.3g}" for k, v in ev.recommended_scaler.items())
    )
    return StageReport(
        StageName.LOSS_SCALE,
        StageStatus.RAN,
        summary,
        details={
            "window": [window.low, window.high],
            "window_recommended": window.recommended(),
            "sweep": sweep.to_dict("records"),
            "recommended": ev.recommended_scaler,
        },
    )


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
    settings: list[dict[str, Any]] = [{"init_scale": s} for s in _sweep_scales(window, ctx.ci)]
    amp = ctx.evidence.amp
    if amp is not None and len(skip_runs(amp.skip_steps)) >= 3:  # skips keep coming back: try slower growth too
        base = window.recommended()
        for interval in (ctx.config.scaler.growth_interval * 10, ctx.config.scaler.growth_interval * 100):
            settings.append({"init_scale": base, "growth_interval": int(interval)})
    # FP32, then each setting at most ``sweep_iterations`` (a skipped step is taken again): an upper bound, so
    # that the estimate of the time left shrinks as settings settle instead of growing step by step
    with ctx.progress.planned(steps + len(settings) * sweep_iterations(steps)):
        return _run_sweep(ctx, capture, window, settings, steps)


def sweep_iterations(steps: int) -> int:
    """The most iterations one sweep setting runs: a setting still skipping after the calibration allowance has failed."""
    return steps + CALIBRATION_SKIPS + 2


def _run_sweep(
    ctx: StageContext, capture: Any, window: Any, settings: list[dict[str, Any]], steps: int
) -> pd.DataFrame:
    """The sweep's probes: one FP32 reference, then each setting against it (its predicted underflow over the
    tensors that carry signal, as the window counts them)."""
    rows = []
    baseline = run_aligned(
        ctx.bench, "fp32", ctx.config, steps, instruments=None
    )  # one FP32 reference for every setting
    for setting in settings:
        config = ctx.with_config(scaler_patch(enabled=True, **setting))
        # A setting still skipping after the calibration allowance has failed: no need to watch it further.
        result = compare(
            ctx.bench,
            ["amp"],
            steps=steps,
            config=config,
            reference=baseline,
            instruments=None,
            max_iterations=sweep_iterations(steps),
        )
        trajectory = result.trajectories["amp"]
        iterations = len(trajectory.records)
        under = window.worst_signal_underflow(predicted_underflow(capture, setting["init_scale"]))
        rows.append(
            {
                "init_scale": setting["init_scale"],
                "growth_interval": setting.get("growth_interval", ctx.config.scaler.growth_interval),
                "skip_rate": trajectory.skipped / max(iterations, 1),
                "predicted_underflow": float(under),
                "max_rel_dev": result.max_rel_dev.get("amp"),
                "verdict": result.verdict_by_mode["amp"],
            }
        )
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
    ok = ok.assign(
        dev_band=(dev >= DRIFT_ERROR).astype(int) + (dev == math.inf).astype(int),
        distance=(ok["init_scale"].map(math.log2) - math.log2(window.recommended())).abs(),
    )
    best = ok.sort_values(
        ["skip_rate", "dev_band", "distance", "init_scale"], ascending=[True, True, True, False]
    ).iloc[0]
    return {"init_scale": float(best["init_scale"]), "growth_interval": int(best["growth_interval"])}


def _checkpoint_scale(ctx: StageContext) -> float | None:
    """The scale a checkpoint's GradScaler had: the probes that keep the configured scaler start at it."""
    start = ctx.bench.spec.start
    scale = start.scaler.get("scale") if start is not None and start.scaler is not None else None
    return float(scale) if isinstance(scale, (int, float)) and scale > 0 else None
