"""Gradient numerics across precisions: predicted and observed underflow, and the loss-scale window.

Derived rather than guessed: from an FP32 step, the smallest loss scale S that
keeps 99.9% of the non-zero gradients above fp16's smallest subnormal
(|g S| >= 2^-24) and the largest that keeps max |g S| under 65504, per layer
(parameter gradients and activation gradients alike, since fp16 underflow
happens in the backward pass between layers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..engine.instruments import strided_sample
from ..engine.probe import Probe, Workbench
from ..engine.rng import seed_everything
from ..tensors import FP16_MAX, FP16_MIN_SUBNORMAL, grad_values
from ..userfile.modules import module_names
from .records import (
    GradientColumn,
    ScaleWindow,  # re-exported: the record types' old home
)
from .thresholds import KEEP_MASS, NEGLIGIBLE_RMS

KEEP = KEEP_MASS

CAPTURE_SAMPLE = 65536
"""Elements a capture keeps of each gradient (a strided sample, in float32: 256 KiB). The readers take shares of
the sample's elements and of its L1 mass (the window's low bound keeps 99.9% of the mass: 65 elements of the
sample at its edge) and its RMS; the window's high bound reads each gradient's exact largest magnitude, taken on
the whole tensor (:attr:`GradientCapture.abs_max`). The FP32 capture is held while the AMP step it is compared
with runs: at 262144 elements a small transformer's capture (47 tensors, 20 MB) put the loss-scale stage 20 MB
above the AMP probe."""


@dataclass
class GradientCapture:
    """Sampled gradient tensors of one step, by name: ``param:<name>`` and ``act:<module>``."""

    tensors: dict[str, torch.Tensor]
    scale: float
    """The loss scale the activation gradients were computed at (parameter gradients are unscaled)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The shape of the gradient each sample was taken from (a micro-batched capture's: the whole batch's). Two
    samples compare element for element only where these agree, not merely their lengths."""
    abs_max: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each gradient's largest magnitude over the whole tensor (0-d, left on its device until read; NaN where it
    held one), scaled as its sample: a strided sample misses the spike that overflows fp16."""


def capture_gradients(
    probe: Probe,
    sample: int = CAPTURE_SAMPLE,
    restore: bool = False,
    consume: Callable[[str, torch.Tensor, tuple[int, ...]], None] | None = None,
) -> GradientCapture:
    """Take one step of ``probe`` keeping (a strided sample of) its gradients.

    Works for any training file, ``train_step`` included: parameter gradients
    are read just before the optimizer step (unscaled by then) or after the
    step when it was skipped; activation gradients through tensor hooks. The
    samples are kept in float32 (every fp16 and bf16 value is exact there, and
    the loss scales that divide them are powers of two): half the memory of
    float64, whose sums the readers do themselves.

    A micro-batched probe (an FP32 probe within AMP's activation memory) captures what the whole batch's
    step would have: the accumulated parameter gradients, and each activation gradient sampled at the
    positions the whole batch's strided sample takes (:class:`_WholeBatchSamples`), so that the capture
    compares element for element with an AMP step on the whole batch.

    ``restore``: put the probe back to before the step. Every caller in the
    diagnosis captures from a fresh probe it closes next, so the default is not
    to: the snapshot would be a full copy of the weights and the optimizer's
    state beside the live ones, the largest allocation of the loss-scale stage.

    ``consume``: given each sample ``(key, tensor, source shape)`` as it is taken, which the capture then does not keep
    (its tensors stay empty): a comparison against another capture needs no second one alive beside it.
    """
    snap = probe.snapshot() if restore else None
    captured: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    maxima: dict[str, torch.Tensor] = {}
    names = module_names(probe.model)
    params = {p: n for n, p in probe.model.named_parameters()}
    piece_rows = probe.next_micro_batch_rows()
    pieces = _WholeBatchSamples(piece_rows, sample) if piece_rows is not None else None

    took_params = False

    def keep(key: str, g: torch.Tensor, divide: float = 1.0) -> None:
        nonlocal took_params
        took_params = took_params or key.startswith("param:")
        kept = strided_sample(g.detach(), sample).to(torch.float32, copy=True)  # a copy: the sample is a view of g
        store(key, kept.div_(divide) if divide != 1.0 else kept, tuple(g.shape), largest_magnitude(g) / divide)

    def store(key: str, kept: torch.Tensor, shape: tuple[int, ...], largest: torch.Tensor) -> None:
        if consume is None:
            captured[key], shapes[key], maxima[key] = kept, shape, largest
        else:
            consume(key, kept, shape)

    def forward_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and output.is_floating_point():
            key = f"act:{names[module]}"
            if pieces is None:
                output.register_hook(lambda g, key=key: keep(key, g))
            else:
                pieces.watch(key, output)

    def pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        for p, n in params.items():
            g = grad_values(p)
            if g is not None:
                keep(f"param:{n}", g)

    handles = [m.register_forward_hook(forward_hook) for m in names]
    if pieces is not None:
        probe.micro_batch_watchers.append(pieces.next_piece)
    handles += [optimizer.register_step_pre_hook(pre_step) for optimizer in probe.optimizers.all()]
    scale = float(probe.scaler.get_scale()) if probe.scaler.is_enabled() else 1.0
    try:
        seed_everything(probe.config.seed + probe.iteration)
        record = probe.step()
        if not took_params:
            divide = scale if record.trace and record.trace.scaled and not record.trace.unscaled else 1.0
            for p, n in params.items():
                g = grad_values(p)
                if g is not None:
                    keep(f"param:{n}", g, divide)
    finally:
        for h in handles:
            h.remove()
        if pieces is not None:
            probe.micro_batch_watchers.remove(pieces.next_piece)
        if snap is not None:
            probe.restore(snap)
    if pieces is not None:  # the activation gradients first, as a whole-batch step's backward takes them
        params_taken, captured = captured, {}
        for key, (kept, shape, largest) in pieces.assembled().items():
            store(key, kept, shape, largest)
        captured.update(params_taken)
    return GradientCapture(captured, scale, shapes, maxima)


def largest_magnitude(g: torch.Tensor) -> torch.Tensor:
    """``max |g|`` over the whole tensor as a float32 0-d tensor on its device (NaN propagates): one ``aminmax``."""
    low, high = torch.aminmax(g.detach())
    return torch.maximum(low.abs(), high.abs()).to(torch.float32)


class _WholeBatchSamples:
    """Activation gradients of a micro-batched step, sampled where :func:`strided_sample` samples the whole
    batch's: every k-th element of the batch's gradient in flattened order, k from the whole tensor's size.

    A module's output on micro-batch j holds rows ``[sum(rows[:j]), sum(rows[:j + 1]))`` of the whole batch's
    output when its leading dimension is the batch's, so its flattened elements are a contiguous stretch of
    the whole's, and the whole's sample positions in that stretch are known before the whole exists. Only
    what the sample keeps is copied (a non-contiguous gradient is flattened first, a transient copy). A module's
    gradient is kept only when every micro-batch showed it exactly once with the batch's rows as its leading
    dimension and the same shape per row, and the step took every micro-batch; else (an output without the
    batch's rows in front, one trimmed to each micro-batch's longest sequence, a module called twice per
    forward) it is left out of the capture, which readers treat as a tensor not measured. A micro-batch of one
    row cannot tell the batch's rows from a leading dimension of 1 (a position embedding's ``(1, T, D)``): its
    outputs are left out too."""

    def __init__(self, rows: list[int], sample: int):
        self.rows, self.sample = rows, sample
        self.starts = [sum(rows[:j]) for j in range(len(rows))]
        self.piece = 0
        """The micro-batch whose forward or backward runs (the probe's micro-batch watchers advance it)."""
        self.parts: dict[str, dict[int, torch.Tensor]] = {}
        self.maxima: dict[str, list[torch.Tensor]] = {}
        self.watched: set[tuple[str, int]] = set()
        self.unaligned: set[str] = set()
        self.row_shapes: dict[str, tuple[int, ...]] = {}

    def next_piece(self) -> None:
        self.piece += 1

    def watch(self, key: str, output: torch.Tensor) -> None:
        """``output`` is ``key``'s on the running micro-batch: sample its gradient when backward reaches it."""
        piece = self.piece
        aligned = (
            0 <= piece < len(self.rows)
            and (key, piece) not in self.watched
            and output.dim() > 0
            and self.rows[piece] > 1
            and output.shape[0] == self.rows[piece]
            and self.row_shapes.setdefault(key, tuple(output.shape[1:])) == tuple(output.shape[1:])
        )
        if not aligned:
            self.unaligned.add(key)
            return
        self.watched.add((key, piece))
        output.register_hook(lambda g, key=key, piece=piece: self._keep(key, piece, g))

    def _keep(self, key: str, piece: int, g: torch.Tensor) -> None:
        per_row = g.numel() // self.rows[piece]
        whole = per_row * sum(self.rows)
        stride = 1 if self.sample <= 0 or whole <= self.sample else math.ceil(whole / self.sample)
        first = -(per_row * self.starts[piece]) % stride  # the whole's first sampled position in this stretch
        self.parts.setdefault(key, {})[piece] = g.detach().reshape(-1)[first::stride].to(torch.float32, copy=True)
        self.maxima.setdefault(key, []).append(largest_magnitude(g))

    def assembled(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...], torch.Tensor]]:
        """Each aligned module's sample of the whole batch's gradient, the whole gradient's shape and its largest
        magnitude (the largest of its micro-batches')."""
        if self.piece != len(self.rows):  # the step failed before its last micro-batch's backward
            return {}
        return {
            key: (
                torch.cat([parts[j] for j in range(len(self.rows))]),
                (sum(self.rows), *self.row_shapes[key]),
                torch.stack(self.maxima[key]).amax(),
            )
            for key, parts in self.parts.items()
            if key not in self.unaligned and len(parts) == len(self.rows)
        }


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
        rows.append(
            {
                GradientColumn.KIND: kind,
                GradientColumn.NAME: name,
                GradientColumn.SCALE: scale,
                GradientColumn.PREDICTED_UNDERFLOW: share,
                GradientColumn.PREDICTED_UNDERFLOW_MASS: mass,
            }
        )
    return pd.DataFrame(rows)


def scale_window(capture: GradientCapture, keep: float = KEEP) -> ScaleWindow:
    """Derive the window from an FP32 capture (activation gradients there are unscaled).

    The low bound keeps ``keep`` of every tensor's gradient *mass* above fp16's
    smallest subnormal (elements far below the rest carry nothing when they
    flush), and ignores tensors whose gradient is rounding noise (see
    :data:`NEGLIGIBLE_RMS`); the high bound keeps every gradient under 65504:
    each tensor's exact largest magnitude where the capture has it (finite),
    else its sample's.
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
        exact = float(capture.abs_max[key]) if key in capture.abs_max else math.nan
        largest = exact if math.isfinite(exact) and exact > 0 else float(ordered[-1])
        kind, name = key.split(":", 1)
        rows.append(
            {
                GradientColumn.KIND: kind,
                GradientColumn.NAME: name,
                GradientColumn.QUANTILE_SMALL: small,
                GradientColumn.ABS_MAX: largest,
                GradientColumn.MIN_SCALE: FP16_MIN_SUBNORMAL / small,
                GradientColumn.MAX_SCALE: FP16_MAX / largest,
                GradientColumn.RMS: float(a.double().pow(2).mean().sqrt()),
            }
        )
    frame = pd.DataFrame(rows)
    if frame.empty:
        return ScaleWindow(frame, 1.0, 2.0**24)
    typical = frame.groupby(GradientColumn.KIND)[GradientColumn.RMS].transform("median")
    frame[GradientColumn.NEGLIGIBLE] = frame[GradientColumn.RMS] < NEGLIGIBLE_RMS * typical
    signal = frame[~frame[GradientColumn.NEGLIGIBLE]]
    return ScaleWindow(
        frame, float(signal[GradientColumn.MIN_SCALE].max()), float(frame[GradientColumn.MAX_SCALE].min())
    )


def _underflow_row(key: str, g32: torch.Tensor, g16: torch.Tensor) -> dict[str, Any]:
    """One tensor's observed underflow: FP32's sample ``g32`` against AMP's ``g16`` at the same positions."""
    wanted = g32 != 0
    lost = wanted & (g16 == 0)
    kind, name = key.split(":", 1)
    magnitude = g32.abs().double()
    flushed_mass = float(magnitude[lost].sum() / magnitude.sum()) if bool(wanted.any()) else 0.0
    return {
        GradientColumn.KIND: kind,
        GradientColumn.NAME: name,
        GradientColumn.OBSERVED_UNDERFLOW: float(lost.sum()) / max(int(wanted.sum()), 1),
        # The share of the gradient's L1 mass that flushed: entries far below the rest (a
        # sharp softmax's tails, a key bias's exact-zero gradient in rounding noise) carry none.
        GradientColumn.OBSERVED_UNDERFLOW_MASS: flushed_mass,
        GradientColumn.RMS: float(magnitude.pow(2).mean().sqrt()) if magnitude.numel() else 0.0,
    }


def observed_underflow(
    bench: Workbench, state_from: Probe | None = None, config: Any = None, reference: GradientCapture | None = None
) -> pd.DataFrame:
    """Per tensor: the share of gradients non-zero in FP32 but zero in AMP (of the elements, and of their L1 mass).

    Both probes take the same step from the same state (``state_from``'s weights
    and position, or the start); AMP gradients are compared after unscaling.
    ``reference``: an FP32 capture of that same step, when the caller already has one.
    """
    snap = state_from.snapshot() if state_from is not None else None

    def probe_from_state(mode: str) -> Probe:
        probe = bench.probe(
            mode, config, instruments=None
        )  # FP32 micro-batched if planned: its capture samples the whole batch's gradients
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
        compared: dict[str, dict[str, Any]] = {}
        fp32_capture = reference

        def compare(
            key: str, g16: torch.Tensor, shape: tuple[int, ...]
        ) -> None:  # as AMP's step takes each sample: none is kept
            g32 = fp32_capture.tensors.get(key)
            if g32 is not None and g16.shape == g32.shape and fp32_capture.shapes.get(key, shape) == shape:
                compared[key] = _underflow_row(key, g32, g16)

        try:
            if state_from is not None and state_from.scaler.is_enabled() and amp.scaler.is_enabled():
                amp.scaler.load_state_dict(state_from.scaler.state_dict())
            low = capture_gradients(amp, consume=compare)
        finally:
            amp.close()
    del amp
    snap = None  # the closure's cell keeps it otherwise: the snapshot's memory goes back now
    rows = [
        {
            GradientColumn.KIND: row[GradientColumn.KIND],
            GradientColumn.NAME: row[GradientColumn.NAME],
            GradientColumn.SCALE: low.scale,
            **row,
        }
        for key in reference.tensors
        if (row := compared.get(key)) is not None
    ]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    # A gradient many orders below the other tensors' of its kind is zero in exact arithmetic
    # (a key bias under softmax's shift invariance) and rounding noise in fp32: its flushing is no loss.
    typical = frame.groupby(GradientColumn.KIND)[GradientColumn.RMS].transform("median")
    frame[GradientColumn.NEGLIGIBLE] = frame[GradientColumn.RMS] < NEGLIGIBLE_RMS * typical
    return frame
