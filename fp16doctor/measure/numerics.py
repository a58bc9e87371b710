"""Gradient numerics across precisions: predicted and observed underflow, and the loss-scale window.

Derived rather than guessed: from an FP32 step, the smallest loss scale S that
keeps 99.9% of the non-zero gradients above fp16's smallest subnormal
(|g S| >= 2^-24) and the largest that keeps max |g S| under 65504, per layer
(parameter gradients and activation gradients alike, since fp16 underflow
happens in the backward pass between layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from ..engine.instruments import module_names, strided_sample
from ..engine.microbatch import UNSPLIT
from ..engine.probe import Probe, Workbench
from ..engine.rng import seed_everything
from ..tensors import FP16_MAX, FP16_MIN_SUBNORMAL, grad_values
from .records import ScaleWindow  # re-exported: the record types' old home
from .thresholds import KEEP_MASS, NEGLIGIBLE_RMS

KEEP = KEEP_MASS


@dataclass
class GradientCapture:
    """Sampled gradient tensors of one step, by name: ``param:<name>`` and ``act:<module>``."""

    tensors: dict[str, torch.Tensor]
    scale: float
    """The loss scale the activation gradients were computed at (parameter gradients are unscaled)."""




def capture_gradients(probe: Probe, sample: int = 262144, restore: bool = False) -> GradientCapture:
    """Take one step of ``probe`` keeping (a strided sample of) its gradients.

    Works for any training file, ``train_step`` included: parameter gradients
    are read just before the optimizer step (unscaled by then) or after the
    step when it was skipped; activation gradients through tensor hooks. The
    samples are kept in float32 (every fp16 and bf16 value is exact there, and
    the loss scales that divide them are powers of two): half the memory of
    float64, whose sums the readers do themselves.

    ``restore``: put the probe back to before the step. Every caller in the
    diagnosis captures from a fresh probe it closes next, so the default is not
    to: the snapshot would be a full copy of the weights and the optimizer's
    state beside the live ones, the largest allocation of the loss-scale stage.
    """
    if probe.batch_plan.split:  # a micro-batch's activation gradients would overwrite the one before
        raise ValueError("capture_gradients needs a probe that takes its batches whole (batch_plan=UNSPLIT)")
    snap = probe.snapshot() if restore else None
    captured: dict[str, torch.Tensor] = {}
    names = module_names(probe.model)
    params = {p: n for n, p in probe.model.named_parameters()}

    def keep(key: str, g: torch.Tensor, divide: float = 1.0) -> None:
        kept = strided_sample(g.detach(), sample).to(torch.float32, copy=True)  # a copy: the sample is a view of g
        captured[key] = kept.div_(divide) if divide != 1.0 else kept

    def forward_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and output.is_floating_point():
            output.register_hook(lambda g, key=f"act:{names[module]}": keep(key, g))

    def pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        for p, n in params.items():
            g = grad_values(p)
            if g is not None:
                keep(f"param:{n}", g)

    handles = [m.register_forward_hook(forward_hook) for m in names]
    handles += [optimizer.register_step_pre_hook(pre_step) for optimizer in probe.optimizers.all()]
    scale = float(probe.scaler.get_scale()) if probe.scaler.is_enabled() else 1.0
    try:
        seed_everything(probe.config.seed + probe.iteration)
        record = probe.step()
        if not any(k.startswith("param:") for k in captured):
            divide = scale if record.trace and record.trace.scaled and not record.trace.unscaled else 1.0
            for p, n in params.items():
                g = grad_values(p)
                if g is not None:
                    keep(f"param:{n}", g, divide)
    finally:
        for h in handles:
            h.remove()
        if snap is not None:
            probe.restore(snap)
    return GradientCapture(captured, scale)


def predicted_underflow(capture: GradientCapture, scale: float) -> pd.DataFrame:
    """Per tensor: the share of non-zero FP32 gradients with |g S| < 2^-24 (flushed to zero in fp16), of the
    elements and of their L1 mass."""
    rows = []
    for key, g in capture.tensors.items():
        a = g.abs()
        nonzero = a[a > 0].double()
        flushed = nonzero * scale < FP16_MIN_SUBNORMAL
        share = float(flushed.double().mean()) if nonzero.numel() else 0.0
        mass = float(nonzero[flushed].sum() / nonzero.sum()) if nonzero.numel() else 0.0
        kind, name = key.split(":", 1)
        rows.append({"kind": kind, "name": name, "scale": scale, "predicted_underflow": share, "predicted_underflow_mass": mass})
    return pd.DataFrame(rows)


def scale_window(capture: GradientCapture, keep: float = KEEP) -> ScaleWindow:
    """Derive the window from an FP32 capture (activation gradients there are unscaled).

    The low bound keeps ``keep`` of every tensor's gradient *mass* above fp16's
    smallest subnormal (elements far below the rest carry nothing when they
    flush), and ignores tensors whose gradient is rounding noise (see
    :data:`NEGLIGIBLE_RMS`); the high bound keeps every gradient under 65504.
    """
    rows = []
    for key, g in capture.tensors.items():
        a = g.abs()
        nonzero = a[(a > 0) & torch.isfinite(a)]
        if not nonzero.numel():
            continue
        ordered = nonzero.double().sort().values
        mass = ordered.cumsum(0)
        flushable = int(torch.searchsorted(mass, (1 - keep) * mass[-1], right=True))
        small = float(ordered[min(flushable, ordered.numel() - 1)])
        largest = float(ordered[-1])
        kind, name = key.split(":", 1)
        rows.append({
            "kind": kind, "name": name, "quantile_small": small, "abs_max": largest,
            "min_scale": FP16_MIN_SUBNORMAL / small, "max_scale": FP16_MAX / largest,
            "rms": float(a.double().pow(2).mean().sqrt()),
        })
    frame = pd.DataFrame(rows)
    if frame.empty:
        return ScaleWindow(frame, 1.0, 2.0**24)
    frame["negligible"] = frame["rms"] < NEGLIGIBLE_RMS * frame.groupby("kind")["rms"].transform("median")
    signal = frame[~frame["negligible"]]
    return ScaleWindow(frame, float(signal["min_scale"].max()), float(frame["max_scale"].min()))


def observed_underflow(bench: Workbench, state_from: Probe | None = None, config: Any = None,
                       reference: GradientCapture | None = None) -> pd.DataFrame:
    """Per tensor: the share of gradients non-zero in FP32 but zero in AMP (of the elements, and of their L1 mass).

    Both probes take the same step from the same state (``state_from``'s weights
    and position, or the start); AMP gradients are compared after unscaling.
    ``reference``: an FP32 capture of that same step, when the caller already has one.
    """
    snap = state_from.snapshot() if state_from is not None else None

    def probe_from_state(mode: str) -> Probe:
        probe = bench.probe(mode, config, instruments=None, batch_plan=UNSPLIT)  # gradients of the whole batch, as AMP's
        if snap is not None:
            probe.model.load_state_dict(snap.model)
            probe.iteration, probe.cursor = snap.iteration, snap.cursor
        return probe

    with bench.progress.planned(2 if reference is None or snap is not None else 1):  # a step per capture
        if reference is None or snap is not None:
            fp32 = probe_from_state("fp32")  # one probe alive at a time: FP32's capture first, then AMP's
            try:
                reference = capture_gradients(fp32)
            finally:
                fp32.close()
            del fp32
        amp = probe_from_state("amp")
        try:
            if state_from is not None and state_from.scaler.is_enabled() and amp.scaler.is_enabled():
                amp.scaler.load_state_dict(state_from.scaler.state_dict())
            low = capture_gradients(amp)
        finally:
            amp.close()
    del amp, snap
    rows = []
    for key, g32 in reference.tensors.items():
        g16 = low.tensors.get(key)
        if g16 is None or g16.shape != g32.shape:
            continue
        wanted = g32 != 0
        lost = wanted & (g16 == 0)
        kind, name = key.split(":", 1)
        magnitude = g32.abs().double()
        rows.append({
            "kind": kind, "name": name, "scale": low.scale,
            "observed_underflow": float(lost.sum()) / max(int(wanted.sum()), 1),
            # The share of the gradient's L1 mass that flushed: entries far below the rest (a
            # sharp softmax's tails, a key bias's exact-zero gradient in rounding noise) carry none.
            "observed_underflow_mass": float(magnitude[lost].sum() / magnitude.sum()) if bool(wanted.any()) else 0.0,
            "rms": float(magnitude.pow(2).mean().sqrt()) if magnitude.numel() else 0.0,
        })
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    # A gradient many orders below the other tensors' of its kind is zero in exact arithmetic
    # (a key bias under softmax's shift invariance) and rounding noise in fp32: its flushing is no loss.
    typical = frame.groupby("kind")["rms"].transform("median")
    frame["negligible"] = frame["rms"] < NEGLIGIBLE_RMS * typical
    return frame
