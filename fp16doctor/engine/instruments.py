"""Numerics instruments: what happens inside a training step, per module and per parameter.

Cheap enough to run inside every probe:

* every statistic is reduced on the device into a few numbers per tensor and
  all of them are stacked and moved to the host **once per step**;
* non-finite values are detected exactly with one ``aminmax`` pass (NaN and
  inf propagate into it); exact NaN/+inf/-inf counts of parameter gradients
  are taken only on the rare steps where that pass found any (a second
  transfer on bad steps only). Forward outputs and activation gradients are
  not held until then: holding them kept a step's activations alive past
  their last use, which cost memory and, in fresh pages, time.
  Their rows flag which kinds the range shows (1 for present; every reader
  asks only whether a module made any) and leave the largest finite magnitude
  of a non-finite output unmeasured (NaN). ``count_nonfinite`` counts them
  exactly instead (a host sync per module call, and four reductions of an
  output that is not finite; no output held), where a report of one bad step
  shows them;
* the shares of elements beyond the fp16 range or below its subnormal and
  normal thresholds are measured exactly on tensors up to ``sample`` (16384)
  elements and on an evenly strided subsample of ``sample`` elements beyond
  that (an unbiased estimate whose error is well under the 5% thresholds the
  rules use). The samples of a step are copied into one buffer and counted
  together by a few in-place integer passes over their fp32 bit patterns
  (:class:`SampleCounter`; parameters: :class:`_Layout`), not by a
  ``bucketize`` and a ``bincount`` per tensor;
* update health (lost updates, update-to-weight ratio) is measured on the same
  strided sample of each parameter before and after the optimizer step;
* ``every=k`` instruments one step in k.

Recorded per step: forward outputs per module (and whether its inputs were
finite), activation gradients per module (``grad_output``, as scaled in
backward, where fp16 underflow happens), per-parameter gradient statistics
(unscaled), and update health (lost updates, update-to-weight ratio).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pandas as pd
import torch

from ..tensors import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL, dtype_name, grad_values, norms
from ..userfile.batches import iter_tensors
from ..userfile.modules import module_names, unwrapped
from .records import Inventory, Reading, Table

# Layout of one stat vector (a row of the per-step stack): input range, output range, then the sampled
# histogram over |x|: zero, (0, 2^-24), [2^-24, 2^-14), normal, > 65504. The element count is known on the
# host and never goes through the device.
IN_MIN, IN_MAX, OUT_MIN, OUT_MAX, ZERO, SUB24, SUB14, NORMAL, OVER = range(9)
VECTOR = 9
_EDGES: dict[torch.device, torch.Tensor] = {}  # device -> bucket edges; right=True counts the edges <= |x|


def _edges(device: torch.device) -> torch.Tensor:
    if device not in _EDGES:
        smallest_positive = 2.0**-149  # fp32's smallest subnormal: every non-zero |x| is >= it
        just_above_max = FP16_MAX * (1 + 2.0**-23)
        _EDGES[device] = torch.tensor(
            [smallest_positive, FP16_MIN_SUBNORMAL, FP16_MIN_NORMAL, just_above_max], device=device
        )
    return _EDGES[device]


def _floating_leaves(value: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(value) if t.is_floating_point()]


def strided_sample(t: torch.Tensor, size: int) -> torch.Tensor:
    """Every k-th of ``t``'s elements in flattened order, k = ceil(numel / size) (all of them when ``size`` is 0
    or ``t`` is no larger): an unbiased sample for shares. A view, one operator for a contiguous tensor, because
    the instruments take it of every activation, gradient and parameter in every step; for a non-contiguous one
    (a transposed attention output) a copy of the sampled elements only where k divides, or is a multiple of,
    the innermost dimensions (see :func:`_sample_view`), else a copy of the whole tensor first."""
    n = t.numel()
    stride = 1 if size <= 0 or n <= size else math.ceil(n / size)
    if t.is_contiguous():
        return t.as_strided((math.ceil(n / stride),), (stride,), t.storage_offset())
    view = _sample_view(t, stride) if t.dim() else None
    return view.reshape(-1) if view is not None else t.reshape(-1)[::stride]


def _sample_view(t: torch.Tensor, k: int) -> torch.Tensor | None:
    """Elements 0, k, 2k, ... of ``t`` in flattened order as a view, where its innermost dimension allows: every
    k-th along it (k divides it), or its first element along it and every (k / d)-th of the rest (d divides k)."""
    d = t.shape[-1]
    if k == 1:
        return t
    if d % k == 0:
        return t[..., ::k]
    if k % d == 0 and t.dim() > 1:
        return _sample_view(t[..., 0], k // d)
    return None


def _bits_of(value: float) -> int:
    """The bit pattern of ``value`` as an fp32 number, read as an int32."""
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


EDGE_BITS = (
    _bits_of(2.0**-149),
    _bits_of(FP16_MIN_SUBNORMAL),
    _bits_of(FP16_MIN_NORMAL),
    _bits_of(FP16_MAX * (1 + 2.0**-23)),
)
"""The histogram's edges (:func:`_edges`) as fp32 bit patterns. The bits of a non-negative fp32 number, read as an
int32, order as the numbers do (NaN's above +inf, where ``bucketize`` puts it too): counting ``|x|`` at or above
an edge is an integer comparison, which a subtraction and a sign shift make in place."""
CHUNK = 256
"""Elements per chunk of a :class:`SampleCounter`'s buffer: each sample starts a chunk, so a chunk's counts are
one sample's (the zeros padding its last chunk count below every edge)."""
COUNTER_ELEMENTS = 1 << 18
"""A counter's buffer holds at most this many elements (1 MiB, and as much again of scratch) before it counts
what it holds; a larger sample is counted on its own."""


def at_least_counts(sample: torch.Tensor) -> torch.Tensor:
    """How many of ``|sample|`` reach each histogram edge (``[4]``, int64), by comparisons in fp32 (fp64 for an
    fp64 sample), NaN reaching every edge (as in ``bucketize``): what :class:`SampleCounter` computes for the
    samples it buffers."""
    a = sample.detach().reshape(-1).abs()
    a = a.double() if a.dtype == torch.float64 else a.float()
    return torch.stack([a.numel() - (a < edge).sum() for edge in _edges(a.device).to(a.dtype)])


class SampleCounter:
    """The histogram counts of a step's samples (activations, activation gradients), taken in a few passes.

    Each sample is copied, as fp32 (exact for fp16, bf16 and fp32 values), into a chunk-aligned slot of one
    zeroed buffer: the copy also lets the sampled tensor go. When the buffer is full, and when the step's rows
    are taken, one pass per edge over the buffer's int32 view counts the elements below the edge per chunk, and
    one ``index_add_`` sums the chunks per sample. That replaces a ``bucketize`` and a ``bincount`` per tensor
    (binary searches and a scatter, ten times slower per element than these in-place integer passes). An fp64
    sample, and one larger than the buffer, is counted on its own by :func:`at_least_counts` (exact in fp64).

    Counts come back as ``value`` per sample and edge, where ``padded + value`` is how many of the sample's
    elements reach the edge (``padded``: the slot's length, 0 for a sample counted on its own)."""

    def __init__(self, device: torch.device, capacity: int = COUNTER_ELEMENTS):
        self.device = device
        self.capacity = capacity
        self.buffer: torch.Tensor | None = None  # fp32, zero beyond ``used``
        self.scratch: torch.Tensor | None = None  # int32, as long as the buffer
        self.used = 0
        self.chunks: list[int] = []  # per buffered sample, its slot's chunks
        self.blocks: list[torch.Tensor] = []  # [k, 4] counts, in sample order
        self.padded: list[int] = []  # per sample since the last take()
        self._ids: dict[tuple[int, ...], torch.Tensor] = {}

    def add(self, sample: torch.Tensor) -> int:
        """Queue one sample (a view is fine: it is copied); its index among the samples since the last take()."""
        index = len(self.padded)
        n = sample.numel()
        slot = -(-n // CHUNK) * CHUNK
        if sample.dtype == torch.float64 or slot > self.capacity:
            self.flush()
            self.blocks.append(at_least_counts(sample)[None])
            self.padded.append(0)
            return index
        if self.used + slot > self.capacity:
            self.flush()
        if self.buffer is None or self.used + slot > self.buffer.numel():
            self._grow(self.used + slot)
        assert self.buffer is not None
        self.buffer[self.used : self.used + n].copy_(sample if sample.dim() == 1 else sample.reshape(-1))
        self.used += slot
        self.chunks.append(slot // CHUNK)
        self.padded.append(slot)
        return index

    def _grow(self, needed: int) -> None:
        size = min(self.capacity, max(needed, 2 * (self.buffer.numel() if self.buffer is not None else 0), 16 * CHUNK))
        buffer = torch.zeros(size, dtype=torch.float32, device=self.device)
        if self.buffer is not None and self.used:
            buffer[: self.used].copy_(self.buffer[: self.used])
        self.buffer, self.scratch = buffer, torch.empty(size, dtype=torch.int32, device=self.device)

    def flush(self) -> None:
        """Count the buffered samples (a few in-place passes) and zero the buffer for the next ones."""
        if not self.chunks:
            return
        assert self.buffer is not None and self.scratch is not None
        used = self.used
        bits = self.buffer[:used].view(torch.int32)
        bits.bitwise_and_(0x7FFFFFFF)  # |x|: the sign bit cleared
        scratch = self.scratch[:used]
        below = []
        for edge in EDGE_BITS:
            torch.sub(bits, edge, out=scratch)
            scratch.bitwise_right_shift_(31)  # -1 below the edge, 0 at or above it
            below.append(scratch.view(-1, CHUNK).sum(1, dtype=torch.int32))
        per_chunk = torch.stack(below, 1)
        ids = self._chunk_ids(tuple(self.chunks))
        self.blocks.append(
            torch.zeros(len(self.chunks), 4, dtype=torch.int32, device=self.device).index_add_(0, ids, per_chunk)
        )
        self.buffer[:used].zero_()
        self.used = 0
        self.chunks = []

    def _chunk_ids(self, chunks: tuple[int, ...]) -> torch.Tensor:
        """Each chunk's sample (cached: a step's layouts repeat every step)."""
        if chunks not in self._ids:
            if len(self._ids) >= 4 * SEGMENT_CACHE_SIZE:
                self._ids.clear()
            self._ids[chunks] = torch.repeat_interleave(
                torch.arange(len(chunks), device=self.device), torch.tensor(chunks, device=self.device)
            )
        return self._ids[chunks]

    def reset(self) -> None:
        """Drop what a step left unfinished (it raised before its rows were taken)."""
        if self.buffer is not None and self.used:
            self.buffer[: self.used].zero_()
        self.used, self.chunks, self.blocks, self.padded = 0, [], [], []

    def take(self) -> tuple[torch.Tensor | None, list[int]]:
        """The counts of every sample since the last take() (``[k, 4]``, on the device) and their ``padded``."""
        self.flush()
        blocks, padded = self.blocks, self.padded
        self.blocks, self.padded = [], []
        if not blocks:
            return None, padded
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks)), padded


def histogram_of(counts: list[tuple[int, int, list[float]]]) -> list[float]:
    """The five bucket counts (zero, below 2^-24, below 2^-14, normal, above 65504) of one or more samples, from
    each one's ``(length, padded, values)`` of :class:`SampleCounter` (``padded + value``: elements at or above an
    edge)."""
    histogram = [0.0] * 5
    for length, padded, values in counts:
        c0, c1, c2, c3 = (padded + v for v in values)
        for i, n in enumerate((length - c0, c0 - c1, c1 - c2, c2 - c3, c3)):
            histogram[i] += n
    return histogram


def combined_range(ranges: list[tuple[float, float]]) -> tuple[float, float]:
    """``(min, max)`` over tensors' ``(min, max)`` ranges; ``(0, 0)`` for none. NaN propagates, each side on
    its own, as a min/max over the stacked ranges on the device does."""
    if not ranges:
        return 0.0, 0.0
    if len(ranges) == 1:
        return ranges[0]
    lows, highs = [r[0] for r in ranges], [r[1] for r in ranges]
    low = math.nan if any(math.isnan(x) for x in lows) else min(lows)
    high = math.nan if any(math.isnan(x) for x in highs) else max(highs)
    return low, high


SEGMENT_CACHE_SIZE = 4
"""Segment-id tensors kept (each as long as the samples): the parameter-gradient and update layouts of one or
two optimizers; a model whose parameters with gradients change every step rebuilds them instead of piling up."""


class _Layout:
    """Chunk-aligned slots for pieces of fixed lengths (the samples of a step's parameters; cached, as they are the
    same every step): piece ``i`` starts chunk ``starts[i]`` of a flat buffer, zeros pad it to a whole chunk. Per
    piece sums are then a contiguous sum per chunk and one ``index_add_`` over the chunks, which is many times
    faster per element than ``bincount`` with weights."""

    def __init__(self, lengths: tuple[int, ...], device: torch.device):
        chunks = [max(1, -(-n // CHUNK)) for n in lengths]
        self.offsets = [CHUNK * c for c in itertools.accumulate([0, *chunks[:-1]])]
        self.total = CHUNK * sum(chunks)
        self.ids = torch.repeat_interleave(
            torch.arange(len(lengths), device=device), torch.tensor(chunks, device=device)
        )
        self.lengths = torch.tensor(lengths, dtype=torch.float64, device=device)[:, None]
        self.padded = torch.tensor([CHUNK * c for c in chunks], dtype=torch.float64, device=device)[:, None]
        self.device = device
        self.piece_lengths = lengths
        self._buffers: dict[tuple[str, torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def packed(self, pieces: list[torch.Tensor], dtype: torch.dtype, purpose: str) -> torch.Tensor:
        """The pieces copied, as ``dtype``, into their slots of this layout's buffer for ``purpose``, by one
        ``_foreach_copy_`` (not a slice and a copy per piece: a step's parameters are many). The buffer is kept
        for the next step's same purpose, zero in its padding: the slots are overwritten, and what is done in
        place to a packed buffer (``abs_``, ``sub_`` of another packed buffer) keeps zero at zero.
        A purpose's buffer is in use from one packing to the next of the same purpose."""
        key = (purpose, dtype)
        if key not in self._buffers:
            buffer = torch.zeros(self.total, dtype=dtype, device=self.device)
            self._buffers[key] = buffer, [buffer[o : o + n] for o, n in zip(self.offsets, self.piece_lengths)]
        buffer, slots = self._buffers[key]
        torch._foreach_copy_(slots, [piece if piece.dim() == 1 else piece.reshape(-1) for piece in pieces])
        return buffer

    def chunk_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per chunk: the sum of a packed buffer's values, in fp64 (exact for counts)."""
        return values.view(-1, CHUNK).sum(1, dtype=torch.float64)

    def sums(self, columns: list[torch.Tensor]) -> torch.Tensor:
        """Per piece (``n x len(columns)``, fp64): the sums of per-chunk columns."""
        stacked = torch.stack(columns, 1)
        return torch.zeros(len(self.offsets), len(columns), dtype=torch.float64, device=self.device).index_add_(
            0, self.ids, stacked
        )

    def maxima(self, values: torch.Tensor) -> torch.Tensor:
        """Per piece: the largest of a packed buffer's non-negative values (NaN propagates; the padding's zeros
        change no maximum of values >= 0)."""
        chunk_max = values.view(-1, CHUNK).amax(1)
        return torch.zeros(len(self.offsets), dtype=values.dtype, device=self.device).scatter_reduce_(
            0, self.ids, chunk_max, "amax"
        )


def _layout(lengths: tuple[int, ...], device: torch.device, cache: dict[Any, _Layout]) -> _Layout:
    key = (lengths, device)
    if key not in cache:
        if len(cache) >= SEGMENT_CACHE_SIZE:  # the set of parameters with gradients changes (unused experts)
            cache.clear()
        cache[key] = _Layout(lengths, device)
    return cache[key]


def _dense_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` itself (read under ``no_grad``: no detached alias to dispatch), or a sparse one's values."""
    g = p.grad
    return g if g is None or not g.is_sparse else grad_values(p)


def exact_counts(tensors: Iterable[torch.Tensor]) -> tuple[int, int, int]:
    """Exact NaN, +inf and -inf counts (the slow path, taken only on bad steps)."""
    nan = pos = neg = 0
    for t in tensors:
        t = t.detach()
        nan += int(torch.isnan(t).sum())
        pos += int((t == math.inf).sum())
        neg += int((t == -math.inf).sum())
    return nan, pos, neg


@dataclass
class InstrumentOptions:
    """Which instruments run, and how often."""

    forward: bool = True
    """Forward output statistics per module."""
    activation_grads: bool = True
    """Statistics of each module's grad_output in backward."""
    param_grads: bool = True
    """Per-parameter gradient norm, non-finite values, zero share."""
    updates: bool = True
    """Lost updates and update-to-weight ratio per parameter (copies the parameters before each step)."""
    every: int = 1
    """Instrument one step in ``every``."""
    sample: int = 16384
    """Elements per tensor measured for the threshold shares; 0 = all (exact). At 16384 the standard
    error of a 5% share is 0.17%: ample for rules that act at 5%."""
    module_shares: bool = True
    """The shares of each forward output's and activation gradient's elements beyond fp16's range, below its
    subnormal and normal thresholds and at zero (``over_fp16_max``, ``below_fp16_subnormal``,
    ``below_fp16_normal``, ``zero_share``: a sample of each tensor copied and counted). Off, those columns are
    NaN (not measured) and a module call costs one ``aminmax`` per tensor. The diagnosis reads none of them (a
    module's overflow is its exact range, the plot reads the ranges), so its probes leave them off
    (``probe.DEFAULT_INSTRUMENTS``); parameter-gradient shares are measured either way."""
    count_nonfinite: bool = False
    """Count each forward output's NaN, +inf and -inf exactly, and measure its largest finite magnitude: for a
    report of one bad step (``train``'s ``nonfinite_step_N.json``) and the LR-peak pause, where the overflowing
    module's finite magnitude is evidence. Each module call's exact range is read at once (a host sync per call:
    for a few steps, not a probe's every step), and only a call whose outputs are not all finite pays four
    reductions of them, queued for the step's one transfer. No output is held: holding them until the transfer
    kept every activation of the step alive past its last use, and reducing every output made as many
    temporaries (either way the LR-peak pause stood 20 MB above the AMP probe on a small transformer).
    Off, a non-finite output's row flags the kinds present (0/1) and its ``abs_max`` is NaN."""


@dataclass
class _ModuleRow:
    """One module call's row (forward, or an activation gradient) waiting for the step's transfer."""

    kind: str
    name: str
    order: int
    dtype: str
    numel: int
    inputs: list[int]
    """Its floating inputs' ranges (indices into ``_Pending.ranges``); none: ``[0, 0]``."""
    outputs: list[int]
    """Its measured outputs' ranges."""
    samples: list[tuple[SampleCounter, int, int]]
    """Its outputs' samples: (counter, index in it, sample length)."""
    counted: list[int]
    """Its outputs' exact non-finite counts and finite magnitudes (indices into ``_Pending.counted``): forward
    outputs with ``count_nonfinite`` only."""


def _lookup(table: dict[int, tuple[weakref.ref, int]], t: torch.Tensor) -> int | None:
    """``t``'s entry in an id-keyed table, if it is ``t``'s (not a freed tensor's whose id ``t`` now has)."""
    entry = table.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


@dataclass
class _Pending:
    """Device-side results of one step, waiting for the single transfer.

    A module call's range is two 0-d tensors (``torch.aminmax``'s), stacked with every other of the step only at
    the transfer; its histogram is counted by a :class:`SampleCounter`; a row's ranges over several tensors are
    combined on the host. ``blocks`` are the batched parameter statistics (``k x VECTOR`` each), with one entry
    of ``block_rows`` and ``block_tensors`` per row."""

    rows: list[_ModuleRow] = field(default_factory=list)
    ranges: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    known: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    """Output id -> (the output, the index of its range): a module's input is usually an earlier module's output.
    Outputs are not held (:meth:`Instruments._queue`), so an id can come back on another tensor once its output
    is freed: the weak reference tells them apart."""
    seen: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    """Output id -> (the output, the index of its row): a container handing on its child's output reuses its
    numbers."""
    counted: list[torch.Tensor] = field(default_factory=list)
    """:func:`nonfinite_stats` of the outputs ``count_nonfinite`` measures, 4 values each."""
    block_rows: list[tuple[str, str, int, str, int]] = field(default_factory=list)  # (kind, name, order, dtype, numel)
    blocks: list[torch.Tensor] = field(default_factory=list)
    block_tensors: list[list[torch.Tensor]] = field(default_factory=list)

    def range_of(self, t: torch.Tensor) -> int:
        """The index of ``t``'s ``(min, max)`` (measured now unless known; NaN propagates into both)."""
        index = _lookup(self.known, t)
        if index is None:
            self.ranges.append(torch.aminmax(t))
            index = len(self.ranges) - 1
        return index

    def row_of(self, t: torch.Tensor) -> int | None:
        """The index of the row that measured ``t`` this step, if one did."""
        return _lookup(self.seen, t)

    def add_block(
        self, rows: list[tuple[str, str, int, str, int]], block: torch.Tensor, tensors: list[list[torch.Tensor]]
    ) -> None:
        """Queue ``len(rows)`` rows at once (``block``: ``len(rows) x VECTOR``)."""
        self.block_rows.extend(rows)
        self.blocks.append(block.reshape(-1))
        self.block_tensors.extend(tensors)

    def count(self, t: torch.Tensor) -> int:
        """The index of ``t``'s :func:`nonfinite_stats`, queued now."""
        self.counted.append(nonfinite_stats(t))
        return len(self.counted) - 1

    def finite(self, ranges: list[int]) -> bool:
        """Whether these ranges hold only finite values: read now (a host sync)."""
        ends = [end for i in ranges for end in self.ranges[i]]
        return not ends or bool(torch.isfinite(torch.stack([e.to(torch.float64) for e in ends])).all())

    def empty(self) -> bool:
        return not self.rows and not self.blocks


def _transfer(pieces: list[torch.Tensor]) -> list[float]:
    """The pieces' values as one float64 list: one device-to-host transfer (one per device for a model split
    across devices)."""
    if len({p.device for p in pieces}) > 1:
        pieces = [p.to("cpu") for p in pieces]
    return torch.cat([p.reshape(-1).to(torch.float64) for p in pieces]).tolist()


class Instruments:
    """Hooks on a model and its optimizer that fill per-step statistics tables."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        options: InstrumentOptions | None = None,
        hook_modules: bool = True,
    ):
        """``hook_modules``: False for a model the steps call compiled. Its modules' hooks would be traced into the
        compiled program, guarding on what they write (a dict that fills recompiles the graph at every call); the
        optimizer's hooks (gradients, updates) run outside it either way."""
        self.model = model
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.optimizer = self.optimizers[0]
        self.options = options or InstrumentOptions()
        self.names = module_names(model)
        self.param_names = {p: n for n, p in unwrapped(model).named_parameters()}
        self.forward_rows: list[dict[str, Any]] = []
        self.activation_grad_rows: list[dict[str, Any]] = []
        self.param_rows: list[dict[str, Any]] = []
        self.update_rows: list[dict[str, Any]] = []
        self.compute_dtypes: dict[str, str] = {}
        self._handles: list[Any] = []
        self._pending = _Pending()
        self._active = False
        self._order = 0
        self._step = -1
        self._scale = 1.0
        self._before: tuple[list[torch.nn.Parameter], torch.Tensor] | None = None
        """The parameters an optimizer is about to step, and their strided samples concatenated (fp32)."""
        self._segment_cache: dict[Any, _Layout] = {}
        self._counters: dict[torch.device, SampleCounter] = {}
        self._param_grads_taken = False
        self._hook_modules = hook_modules
        self.attach()

    # --- wiring ---------------------------------------------------------------------------------
    def attach(self) -> None:
        if self._handles:
            return
        for module in self.names if self._hook_modules else ():
            self._handles.append(module.register_forward_hook(self._post_forward))
        for optimizer in self.optimizers:
            self._hook_optimizer(optimizer)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
        self._handles.append(optimizer.register_step_post_hook(self._post_step))

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Instrument one more optimizer (one the training created itself, found while it stepped)."""
        if all(optimizer is not known for known in self.optimizers):
            self.optimizers.append(optimizer)
            if self._handles:
                self._hook_optimizer(optimizer)

    def detach(self, release: bool = True) -> None:
        """Remove the hooks and let the step buffers go (up to 2 MiB per device, and the packed parameter
        samples): detached instruments of a probe that lives on (an intervention's, a verification's) hold no
        memory for steps they no longer see. ``release=False`` keeps them, for hooks taken off between two steps
        of one probe (``benchmarks/overhead.py``), as attached instruments keep them from step to step."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if release:
            self._counters.clear()
            self._segment_cache.clear()

    # --- step protocol (called by the probe) ------------------------------------------------------
    def begin_step(self, step: int, scale: float) -> None:
        self._step, self._scale = step, scale
        self._active = step % max(1, self.options.every) == 0
        self._pending = _Pending()
        for counter in self._counters.values():
            counter.reset()
        self._order = 0
        self._before = None
        self._param_grads_taken = False

    def end_step(self, grads_unscaled: bool = True) -> None:
        """The step's one transfer: stack every pending vector, move it, turn it into rows."""
        if not self._active:
            return
        if self.options.param_grads and not self._param_grads_taken:
            self._take_param_grads(divide_by=1.0 if grads_unscaled else self._scale)
        if self._emit_pending():
            self._active = False

    def end_micro_batch(self) -> None:
        """One micro-batch of a micro-batched step (an FP32 probe's, :mod:`.microbatch`) is through its forward
        and backward: its rows are taken now, in one transfer, and the tensors they were measured on let go,
        so that the step holds one micro-batch's activations at a time, not all of them until its end.

        Each module call of each micro-batch is then a row of the step: ``order`` runs on across the
        micro-batches (still the execution order, which the first non-finite forward is found by), a module's
        largest ``abs_max`` over the step's rows is the whole batch's, its non-finite flags (or, with
        ``count_nonfinite``, counts) add up over them (flags then count the micro-batches that had any),
        and ``inputs_finite`` is per call, as it always is. The shares (``over_fp16_max`` and the underflow
        shares) are each micro-batch's own. Parameter gradients and updates stay one row per step: they are
        taken once, at the optimizer step, from the summed gradients."""
        if self._active:
            self._emit_pending()

    def _emit_pending(self) -> bool:
        """Turn every pending row into table rows (one transfer); whether there were any."""
        pending, self._pending = self._pending, _Pending()
        taken = [(counter, *counter.take()) for counter in self._counters.values()]
        if pending.empty():
            return False
        pieces: list[torch.Tensor] = []
        if pending.ranges:
            ends = [end for pair in pending.ranges for end in pair]
            if len({t.device for t in ends}) > 1:
                ends = [t.to("cpu") for t in ends]
            pieces.append(torch.stack(ends))  # stack promotes mixed dtypes (fp16, bf16, fp32: exactly) to one
        if pending.counted:
            pieces.append(torch.stack(pending.counted))
        pieces += [counts for _, counts, _ in taken if counts is not None]
        pieces += pending.blocks
        values = _transfer(pieces)
        offset = 2 * len(pending.ranges)
        ranges = [(values[2 * i], values[2 * i + 1]) for i in range(len(pending.ranges))]
        counted = [values[offset + 4 * i : offset + 4 * i + 4] for i in range(len(pending.counted))]
        offset += 4 * len(pending.counted)
        counts: dict[int, tuple[list[float], list[int]]] = {}
        for counter, block, padded in taken:
            if block is not None:
                counts[id(counter)] = (values[offset : offset + 4 * len(padded)], padded)
                offset += 4 * len(padded)
        for row in pending.rows:
            histogram = histogram_of(
                [(length, counts[id(c)][1][i], counts[id(c)][0][4 * i : 4 * i + 4]) for c, i, length in row.samples]
            )
            low, high = combined_range([ranges[i] for i in row.inputs])
            out_low, out_high = combined_range([ranges[i] for i in row.outputs])
            self._emit(
                row.kind,
                row.name,
                row.order,
                row.dtype,
                row.numel,
                [low, high, out_low, out_high, *histogram],
                counted=[counted[i] for i in row.counted],
            )
        for (kind, name, order, dtype, numel), tensors in zip(pending.block_rows, pending.block_tensors):
            self._emit(kind, name, order, dtype, numel, values[offset : offset + VECTOR], tensors)
            offset += VECTOR
        return True

    # --- forward --------------------------------------------------------------------------------
    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Measure a module's output when it completes.

        ``order`` is the completion order: children complete before their parents, so the
        first module to produce a non-finite output from finite inputs is the innermost culprit.
        """
        if not self._active:
            return
        name = self.names.get(module, type(module).__name__)
        leaves = _floating_leaves(output)
        if not leaves:
            return
        order = self._order
        self._order += 1
        dtype = dtype_name(leaves[0].dtype)
        self.compute_dtypes[name] = dtype
        pending = self._pending
        outputs = [t for t in leaves if pending.row_of(t) is None]
        if not outputs:  # a container handing on its child's output: reuse the child's numbers
            if self.options.forward:
                self._queue_alias(name, order, dtype, leaves[0], _floating_leaves(args))
            return
        if self.options.forward:
            with torch.no_grad():
                inputs = [pending.range_of(t) for t in _floating_leaves(args) if t.numel()]
                row = self._queue("forward", name, order, dtype, outputs, inputs, count=self.options.count_nonfinite)
            for t, index in zip([t for t in outputs if t.numel()], row.outputs):
                pending.known[id(t)] = (weakref.ref(t), index)
            for t in outputs:
                pending.seen[id(t)] = (weakref.ref(t), len(pending.rows) - 1)
        if self.options.activation_grads:
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, order))

    def _grad_hook(self, name: str, order: int):
        def hook(grad: torch.Tensor) -> None:
            if self._active and grad is not None:
                with torch.no_grad():
                    self._queue("activation_grad", name, order, dtype_name(grad.dtype), [grad], [], count=False)

        return hook

    def _queue_alias(self, name: str, order: int, dtype: str, output: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        source = self._pending.rows[cast(int, self._pending.row_of(output))]  # a child measured it
        with torch.no_grad():
            own_inputs = [self._pending.range_of(t) for t in inputs if t.numel()] if inputs else source.inputs
        self._pending.rows.append(
            _ModuleRow(
                "forward", name, order, dtype, source.numel, own_inputs, source.outputs, source.samples, source.counted
            )
        )

    def _queue(
        self, kind: str, name: str, order: int, dtype: str, outputs: list[torch.Tensor], inputs: list[int], count: bool
    ) -> _ModuleRow:
        """Queue one module call's row: its outputs' exact ranges (one ``aminmax`` each) and their samples (one
        copy each into the device's :class:`SampleCounter`). ``count``: where they are not all finite, also their
        exact non-finite counts and largest finite magnitudes (:func:`nonfinite_stats`, ``count_nonfinite``);
        otherwise the row says which kinds of non-finite values the exact range saw. Nothing is held either way:
        autograd frees each output and gradient as soon as it is done with it (holding a step's activation
        gradients kept a second copy of them alive, holding its forward outputs kept every one past its last use:
        the memory target). Call it under ``torch.no_grad()``."""
        pending = self._pending
        sized = [t for t in outputs if t.numel()]
        samples = []
        for t in sized if self.options.module_shares else ():
            sample, counter = strided_sample(t, self.options.sample), self._counter(t.device)
            samples.append((counter, counter.add(sample), sample.numel()))
        ranges = [pending.range_of(t) for t in sized]
        counted = [pending.count(t) for t in sized] if count and not pending.finite(ranges) else []
        row = _ModuleRow(kind, name, order, dtype, sum(t.numel() for t in outputs), inputs, ranges, samples, counted)
        pending.rows.append(row)
        return row

    def _counter(self, device: torch.device) -> SampleCounter:
        counter = self._counters.get(device)
        if counter is None:
            counter = self._counters[device] = SampleCounter(device)
        return counter

    # --- parameters -----------------------------------------------------------------------------
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        if self.options.param_grads and not self._param_grads_taken:  # several optimizers: the gradients once
            self._take_param_grads(divide_by=1.0)
        if self.options.updates:
            # A strided sample of each parameter this optimizer steps (the same elements after the step): lost
            # updates and the update-to-weight ratio are measured on it, without copying whole parameters.
            # Sparse gradients are left out: their values do not line up with the parameter's elements.
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            params = [p for p in self.param_names if id(p) in stepped and p.grad is not None and not p.grad.is_sparse]
            with torch.no_grad():  # packing copies: the samples survive the step's in-place update
                if params:
                    samples = [self._sampled(p) for p in params]
                    self._before = (params, self._layout_of(samples).packed(samples, torch.float32, "before"))
                else:
                    self._before = None

    def _sampled(self, t: torch.Tensor) -> torch.Tensor:
        return strided_sample(t, self.options.sample)

    def _layout_of(self, pieces: list[torch.Tensor]) -> _Layout:
        return _layout(tuple(p.numel() for p in pieces), pieces[0].device, self._segment_cache)

    def _take_param_grads(self, divide_by: float) -> None:
        """Per-parameter gradient statistics, batched across parameters: a fixed handful of passes over the
        parameters' samples packed into chunk-aligned slots (:class:`_Layout`), plus one copy per parameter."""
        self._param_grads_taken = True
        named = [(name, g) for p, name in self.param_names.items() if (g := _dense_grad(p)) is not None]
        if not named:
            return
        grads = [g for _, g in named]
        with torch.no_grad():
            # Norms accumulate in fp32: a half gradient's own norm can overflow fp16.
            l2 = torch.stack(norms(grads)).double() / divide_by
            samples = [self._sampled(g) for g in grads]
            layout = self._layout_of(samples)
            flat = layout.packed(samples, torch.float32, "grads").abs_()  # |g| (fp32), zeros padding each slot
            if divide_by != 1.0:
                flat = flat / divide_by  # not in place: the kept buffer's padding stays 0 even for a scale of 0
            # Buckets of |g * S|: bucket 1 is 0 < |g S| < 2^-24, what fp16 flushes to zero at this scale.
            scaled = (flat * self._scale).view(torch.int32).bitwise_and_(0x7FFFFFFF)
            below, first, second = [], torch.empty_like(scaled), torch.empty_like(scaled)
            in_bucket_1 = first
            for k, edge in enumerate(EDGE_BITS):
                out = first if k == 0 else second
                torch.sub(scaled, edge, out=out)
                out.bitwise_right_shift_(31)  # -1 below the edge, 0 at or above it
                below.append(layout.chunk_sums(out))
                if k == 1:
                    torch.sub(first, second, out=in_bucket_1)  # 1 at or above edge 0 and below edge 1
            # The L1 mass that flushes (bucket 1) and the whole mass: underflow that matters is a share of the mass;
            # sums of up to 16384 values per parameter accumulate in fp64.
            flushed = layout.chunk_sums(flat * in_bucket_1)
            per_param = layout.sums([*below, flushed, layout.chunk_sums(flat)])
            at_least = per_param[:, :4] + layout.padded
            histogram = torch.cat(
                [layout.lengths - at_least[:, :1], at_least[:, :3] - at_least[:, 1:], at_least[:, 3:]], 1
            )
            if any(g.dtype == torch.float64 for g in grads):
                amax = torch.stack(norms(samples, math.inf)).double() / divide_by  # max |g|, exactly in fp64
            else:
                amax = layout.maxima(flat).double()  # max |g| / divide_by: the same, as division is monotonic
            block = torch.cat([l2[:, None], histogram, amax[:, None], per_param[:, 4:]], 1)
        rows = [("param_grad", name, -1, dtype_name(g.dtype), g.numel()) for name, g in named]
        self._pending.add_block(rows, block, [[g] for g in grads])

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Lost updates (gradient non-zero, stored value unchanged) and update-to-weight ratio per parameter."""
        if not (self._active and self.options.updates and self._before):
            return
        (params, before), self._before = self._before, None
        with torch.no_grad():
            samples = [self._sampled(p) for p in params]
            layout = self._layout_of(samples)
            moved = layout.packed(samples, torch.float32, "after").sub_(before)  # zero in the padding, as both are
            # every one had a gradient when _pre_step chose it, and a step does not take it away
            grads = [cast(torch.Tensor, p.grad) for p in params]
            wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
            wanted = layout.packed([self._sampled(g) for g in grads], wide, "wanted") != 0
            lost = wanted & (moved == 0)
            squares = [moved.double().square_(), before.double().square_()]
            sums = layout.sums([layout.chunk_sums(lost), layout.chunk_sums(wanted), *map(layout.chunk_sums, squares)])
            block = torch.nn.functional.pad(torch.cat([sums[:, :2], sums[:, 2:].sqrt()], 1), (0, VECTOR - 4))
        rows = [("update", self.param_names[p], -1, dtype_name(p.dtype), p.numel()) for p in params]
        self._pending.add_block(rows, block, [[] for _ in params])

    # --- turning vectors into rows ------------------------------------------------------------------
    def _emit(
        self,
        kind: str,
        name: str,
        order: int,
        dtype: str,
        numel: int,
        v: list[float],
        tensors: Sequence[torch.Tensor] = (),
        counted: Sequence[list[float]] = (),
    ) -> None:
        """One table row from its transferred values: ``tensors``, a parameter's gradient for exact counts should it
        be non-finite; ``counted``, a module row's outputs' :func:`nonfinite_stats` (``count_nonfinite``)."""
        base = {
            Reading.STEP: self._step,
            Reading.MODULE if kind in ("forward", "activation_grad") else Reading.PARAM: name,
            Reading.DTYPE: dtype,
        }
        if kind in ("forward", "activation_grad"):
            finite = all(math.isfinite(x) for x in (v[OUT_MIN], v[OUT_MAX]))
            nan = pos = neg = 0
            abs_max = max(abs(v[OUT_MIN]), abs(v[OUT_MAX]))
            if not finite and counted:
                nan, pos, neg = (int(sum(c[k] for c in counted)) for k in range(3))
                abs_max = max(c[3] for c in counted)
            elif not finite:  # not counted (without count_nonfinite): what the exact range shows, 1 for present
                nan, pos, neg, abs_max = kinds_in_range(v[OUT_MIN], v[OUT_MAX]) + (math.nan,)
            row = {
                **base,
                Reading.ORDER: order,
                Reading.NUMEL: numel,
                Reading.ABS_MAX: abs_max,
                Reading.NAN: nan,
                Reading.POSINF: pos,
                Reading.NEGINF: neg,
                **(_shares(v) if self.options.module_shares else UNMEASURED_SHARES),
            }
            if kind == "forward":
                row[Reading.INPUTS_FINITE] = math.isfinite(v[IN_MIN]) and math.isfinite(v[IN_MAX])
                row[Reading.INPUT_ABS_MAX] = (
                    max(abs(v[IN_MIN]), abs(v[IN_MAX])) if row[Reading.INPUTS_FINITE] else math.inf
                )
                self.forward_rows.append(row)
            else:
                row[Reading.LOSS_SCALE] = self._scale
                self.activation_grad_rows.append(row)
        elif kind == "param_grad":
            norm, zero, under, amax = v[0], v[1], v[2], v[6]
            sample_n = sum(v[1:6])
            nonzero = sample_n - zero
            nan = pos = neg = 0
            if not math.isfinite(norm):
                nan, pos, neg = exact_counts(tensors)
            self.param_rows.append(
                {
                    **base,
                    Reading.GRAD_NORM: norm,
                    Reading.NAN: nan,
                    Reading.POSINF: pos,
                    Reading.NEGINF: neg,
                    Reading.ZERO_SHARE: 1.0 - nonzero / max(sample_n, 1.0),
                    Reading.UNDERFLOW_AT_SCALE: under / max(nonzero, 1.0),
                    Reading.GRAD_ABS_MAX: amax,
                    Reading.LOSS_SCALE: self._scale,
                    Reading.UNDERFLOW_MASS_AT_SCALE: v[7] / v[8] if v[8] > 0 else 0.0,
                }
            )
        else:
            lost, wanted, delta, weight = v[:4]
            self.update_rows.append(
                {
                    **base,
                    Reading.LOST_UPDATE_SHARE: lost / wanted if wanted else 0.0,
                    Reading.UPDATE_TO_WEIGHT: delta / weight if weight else (math.inf if delta else 0.0),
                }
            )

    # --- results ----------------------------------------------------------------------------------
    def frames(self) -> dict[str, pd.DataFrame]:
        """The four tables: forward, activation_grads, param_grads, updates."""
        return {
            Table.FORWARD: pd.DataFrame(self.forward_rows),
            Table.ACTIVATION_GRADS: pd.DataFrame(self.activation_grad_rows),
            Table.PARAM_GRADS: pd.DataFrame(self.param_rows),
            Table.UPDATES: pd.DataFrame(self.update_rows),
        }

    def first_nonfinite_forward(self) -> dict[str, Any] | None:
        """The first module (execution order) whose output is non-finite while its inputs are finite."""
        bad = [
            r
            for r in self.forward_rows
            if (r[Reading.NAN] or r[Reading.POSINF] or r[Reading.NEGINF]) and r[Reading.INPUTS_FINITE]
        ]
        if not bad:
            return None
        first_step = min(r[Reading.STEP] for r in bad)
        return min((r for r in bad if r[Reading.STEP] == first_step), key=lambda r: r[Reading.ORDER])


UNMEASURED_SHARES = {
    "over_fp16_max": math.nan,
    "below_fp16_subnormal": math.nan,
    "below_fp16_normal": math.nan,
    "zero_share": math.nan,
}
"""A module row's shares where ``module_shares`` is off."""


def _shares(v: list[float]) -> dict[str, float]:
    """A module row's shares from its stat vector's sampled histogram."""
    sample_n = max(sum(v[ZERO : OVER + 1]), 1.0)
    nonzero = max(sample_n - v[ZERO], 1.0)
    return {
        "over_fp16_max": v[OVER] / sample_n,
        "below_fp16_subnormal": v[SUB24] / nonzero,
        "below_fp16_normal": (v[SUB24] + v[SUB14]) / nonzero,
        "zero_share": v[ZERO] / sample_n,
    }


def kinds_in_range(low: float, high: float) -> tuple[int, int, int]:
    """``(nan, posinf, neginf)`` as 0/1 flags from a tensor's exact ``[min, max]``: NaN propagates into both
    (and then hides whether infinities are there too), +inf is the max, -inf the min."""
    if math.isnan(low) or math.isnan(high):
        return 1, 0, 0
    return 0, int(high == math.inf), int(low == -math.inf)


def nonfinite_stats(t: torch.Tensor) -> torch.Tensor:
    """``[NaN count, +inf count, -inf count, largest finite |x| (0 for none)]`` of a non-empty tensor, as a float64
    vector left on its device (the step's transfer takes it): exact counts up to 2^53 elements."""
    t = t.detach()
    finite_abs = torch.where(torch.isfinite(t), t.abs(), 0).amax()
    return torch.stack(
        [
            torch.isnan(t).sum().double(),
            (t == math.inf).sum().double(),
            (t == -math.inf).sum().double(),
            finite_abs.double(),
        ]
    )


LIBRARY_PACKAGES = ("torch", "transformers", "timm", "torchvision")
"""Packages whose module classes a user does not edit (``nn.Linear``, a Hugging Face layer): a fix names where such a
module sits in the user's model, not its class (the precision table's ``library`` column)."""


def precision_map(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
    compute_dtypes: dict[str, str] | None = None,
) -> pd.DataFrame:
    """For every module: the dtype its computation ran in, and the dtypes of its parameters, buffers and optimizer state.

    ``library``: the module's class comes from a library (:data:`LIBRARY_PACKAGES`), not the user's code.
    ``trained_param_dtypes``: the dtypes of the parameters the training trains (they require grad and an
    optimizer holds them); ``frozen``: the module has parameters and trains none of them. Only trained
    parameters are the training's weights: a frozen module kept in fp16 on purpose (a distillation teacher, a
    frozen encoder, an embedding table) is stored in half precision without being trained in it.
    """
    compute_dtypes = compute_dtypes or {}
    optimizers = (
        [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    )
    state = {p: s for opt in optimizers for p, s in opt.state.items()}
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    rows = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        buffers = [b for b in module.buffers(recurse=False) if b.is_floating_point()]
        state_dtypes = sorted(
            {
                dtype_name(v.dtype)
                for p in params
                for v in state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
            }
        )
        trained = [p for p in params if p.requires_grad and id(p) in held]
        rows.append(
            {
                Inventory.MODULE: name or "<root>",
                Inventory.TYPE: type(module).__name__,
                Inventory.LIBRARY: type(module).__module__.split(".")[0] in LIBRARY_PACKAGES,
                Inventory.COMPUTE_DTYPE: compute_dtypes.get(name or "<root>"),
                Inventory.PARAM_DTYPES: _dtype_names(params),
                Inventory.BUFFER_DTYPES: _dtype_names(buffers),
                Inventory.OPTIMIZER_STATE_DTYPES: ",".join(state_dtypes) or None,
                Inventory.TRAINED_PARAM_DTYPES: _dtype_names(trained),
                Inventory.FROZEN: bool(params) and not trained,
            }
        )
    return pd.DataFrame(rows)


def _dtype_names(tensors: list[torch.Tensor]) -> str | None:
    """The tensors' dtypes as a sorted comma-joined string (``"float16,float32"``), None for no tensors."""
    return ",".join(sorted({dtype_name(t.dtype) for t in tensors})) or None
