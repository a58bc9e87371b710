"""Numerics instruments: what happens inside a training step, per module and per parameter.

Cheap enough to run inside every probe:

* every statistic is reduced on the device into a few numbers per tensor and
  all of them are stacked and moved to the host **once per step**;
* non-finite values are detected exactly with one ``aminmax`` pass (NaN and
  inf propagate into it); exact NaN/+inf/-inf counts of forward outputs and
  parameter gradients are taken only on the rare steps where that pass found
  any (a second transfer on bad steps only). Activation gradients are not held
  until then (that would keep every one of a step's activation gradients
  alive): their rows flag which kinds the range shows (1 for present) and
  leave the largest finite magnitude of a non-finite gradient unmeasured (NaN);
* the shares of elements beyond the fp16 range or below its subnormal and
  normal thresholds are measured exactly on tensors up to ``sample`` (16384)
  elements and on an evenly strided subsample of ``sample`` elements beyond
  that (an unbiased estimate whose error is well under the 5% thresholds the
  rules use);
* update health (lost updates, update-to-weight ratio) is measured on the same
  strided sample of each parameter before and after the optimizer step;
* ``every=k`` instruments one step in k.

Recorded per step: forward outputs per module (and whether its inputs were
finite), activation gradients per module (``grad_output``, as scaled in
backward, where fp16 underflow happens), per-parameter gradient statistics
(unscaled), and update health (lost updates, update-to-weight ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, cast

import pandas as pd
import torch

from ..tensors import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL, grad_values, norms
from ..userfile.batches import iter_tensors

# Layout of one stat vector (a row of the per-step stack): input range, output range, then the sampled
# histogram over |x|: zero, (0, 2^-24), [2^-24, 2^-14), normal, > 65504. The element count is known on the
# host and never goes through the device.
IN_MIN, IN_MAX, OUT_MIN, OUT_MAX, ZERO, SUB24, SUB14, NORMAL, OVER = range(9)
VECTOR = 9
_EDGES: dict[torch.device, torch.Tensor] = {}  # device -> bucket edges; right=True counts the edges <= |x|
_NO_RANGE: dict[torch.device, torch.Tensor] = {}  # device -> the [0, 0] input range of a call with no inputs


def _edges(device: torch.device) -> torch.Tensor:
    if device not in _EDGES:
        smallest_positive = 2.0**-149  # fp32's smallest subnormal: every non-zero |x| is >= it
        just_above_max = FP16_MAX * (1 + 2.0**-23)
        _EDGES[device] = torch.tensor([smallest_positive, FP16_MIN_SUBNORMAL, FP16_MIN_NORMAL, just_above_max], device=device)
    return _EDGES[device]


def _no_range(device: torch.device) -> torch.Tensor:
    """A constant ``[0, 0]`` in float64 (never written to: ``cat`` copies it)."""
    if device not in _NO_RANGE:
        _NO_RANGE[device] = torch.zeros(2, dtype=torch.float64, device=device)
    return _NO_RANGE[device]


def _floating_leaves(value: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(value) if t.is_floating_point()]


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a (Distributed)DataParallel wrapper: its names are the ones the user knows."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return model.module if isinstance(model, parallel) else model


def module_names(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """Every module of the user's model that takes Python hooks, by its path (the root: ``<root>``). A parallel
    wrapper is left out; so is a TorchScript module and what it contains (it refuses hooks: its inside is
    seen only as its output)."""
    names: dict[torch.nn.Module, str] = {}
    scripted: list[str] = []
    for name, module in unwrapped(model).named_modules():
        if any(name == s or name.startswith(s + ".") for s in scripted):
            continue
        if isinstance(module, torch.jit.ScriptModule):
            scripted.append(name)
            continue
        names[module] = name or "<root>"
    return names


def strided_sample(t: torch.Tensor, size: int) -> torch.Tensor:
    """Every k-th of ``t``'s elements in flattened order, k = ceil(numel / size) (all of them when ``size`` is 0
    or ``t`` is no larger): an unbiased sample for shares. A view, one operator for a contiguous tensor, because
    the instruments take it of every activation, gradient and parameter in every step."""
    n = t.numel()
    stride = 1 if size <= 0 or n <= size else math.ceil(n / size)
    if t.is_contiguous():
        return t.as_strided((math.ceil(n / stride),), (stride,), t.storage_offset())
    return t.reshape(-1)[::stride]


def magnitude_histogram(values: torch.Tensor, sample: int) -> torch.Tensor:
    """Counts of |x| in the buckets zero, below 2^-24, below 2^-14, normal, above 65504 (on a sample): exactly
    five, since the four edges give bucket indices 0..4."""
    a = strided_sample(values, sample).abs()
    return torch.bincount(torch.bucketize(a, _edges(a.device), right=True), minlength=5)


def _range(t: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of one tensor, in its own dtype (NaN propagates)."""
    return torch.stack(torch.aminmax(t))


def value_range(tensors: list[torch.Tensor], known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """[min, max] over the tensors in float64 (NaN propagates); ranges already measured (``known``, by id) are
    reused. Call it under ``torch.no_grad()`` (the instruments' hooks do): no graph is recorded."""
    known = known or {}
    ranges = [known[id(t)] if id(t) in known else _range(t).double() for t in tensors if t.numel()]
    if not ranges:
        return torch.zeros(2, dtype=torch.float64)
    if len(ranges) == 1:
        return ranges[0]
    stacked = torch.stack([r.to(ranges[0].device) for r in ranges])
    return torch.stack([stacked[:, 0].min(), stacked[:, 1].max()])


def tensor_vector(outputs: list[torch.Tensor], inputs: list[torch.Tensor], sample: int,
                  known: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """The float64 stat vector of a module call: input range, output range, sampled magnitude histogram. A
    handful of operators for the usual one-output call (``cat`` promotes the pieces to float64 at once)."""
    with torch.no_grad():
        device = outputs[0].device
        sized = [t for t in outputs if t.numel()]
        in_range = value_range(inputs, known).to(device) if inputs else _no_range(device)
        if len(sized) == 1:
            out_range, histogram = _range(sized[0]), magnitude_histogram(sized[0], sample)
        elif sized:
            out_range = value_range(sized).to(device)
            histogram = torch.stack([magnitude_histogram(t, sample) for t in sized]).sum(0)
        else:
            out_range, histogram = _no_range(device), torch.zeros(5, dtype=torch.long, device=device)
        return torch.cat([in_range, out_range, histogram])


SEGMENT_CACHE_SIZE = 4
"""Segment-id tensors kept (each as long as the samples): the parameter-gradient and update layouts of one or
two optimizers; a model whose parameters with gradients change every step rebuilds them instead of piling up."""


def _segment_ids(lengths: tuple[int, ...], device: torch.device, cache: dict[Any, torch.Tensor]) -> torch.Tensor:
    """For pieces of these lengths concatenated: the index of the piece each element came from (cached: the
    parameters' shapes, hence their samples' lengths, are the same every step)."""
    key = (lengths, device)
    if key not in cache:
        if len(cache) >= SEGMENT_CACHE_SIZE:  # the set of parameters with gradients changes (unused experts)
            cache.clear()
        cache[key] = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                             torch.tensor(lengths, device=device))
    return cache[key]


def _dense_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` itself (read under ``no_grad``: no detached alias to dispatch), or a sparse one's values."""
    g = p.grad
    return g if g is None or not g.is_sparse else grad_values(p)


def _as_float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


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


@dataclass
class _Pending:
    """Device-side results of one step, waiting for the single transfer.

    ``vectors`` holds one float64 tensor per queued call: a stat vector (``VECTOR`` values, one row) or a block
    of rows (``k x VECTOR``, the batched parameter statistics); ``rows`` and ``tensors`` have one entry per row,
    in the same order."""

    rows: list[tuple[str, str, int, str, int]] = field(default_factory=list)  # (kind, name, order, dtype, numel)
    vectors: list[torch.Tensor] = field(default_factory=list)
    tensors: list[list[torch.Tensor]] = field(default_factory=list)  # kept for exact counts on bad steps
    seen: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Output id -> (index of its vector, index of its row): a container handing on its child's output reuses them."""
    ranges: dict[int, torch.Tensor] = field(default_factory=dict)  # output id -> its [min, max] (inputs reuse them)

    def add(self, row: tuple[str, str, int, str, int], vector: torch.Tensor, tensors: list[torch.Tensor]) -> int:
        """Queue one row; the index of its vector."""
        self.rows.append(row)
        self.vectors.append(vector)
        self.tensors.append(tensors)
        return len(self.vectors) - 1

    def add_block(self, rows: list[tuple[str, str, int, str, int]], block: torch.Tensor,
                  tensors: list[list[torch.Tensor]]) -> None:
        """Queue ``len(rows)`` rows at once (``block``: ``len(rows) x VECTOR``)."""
        self.rows.extend(rows)
        self.vectors.append(block.reshape(-1))
        self.tensors.extend(tensors)

    def values(self) -> list[list[float]]:
        """Every row's values, in one device-to-host transfer (one per device for a model split across devices)."""
        devices = {v.device for v in self.vectors}
        vectors = self.vectors if len(devices) == 1 else [v.to("cpu") for v in self.vectors]
        return torch.cat(vectors).to(torch.float64).view(-1, VECTOR).tolist()


class Instruments:
    """Hooks on a model and its optimizer that fill per-step statistics tables."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                 options: InstrumentOptions | None = None):
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
        self._segment_cache: dict[Any, torch.Tensor] = {}
        self._param_grads_taken = False
        self.attach()

    # --- wiring ---------------------------------------------------------------------------------
    def attach(self) -> None:
        if self._handles:
            return
        for module in self.names:
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

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- step protocol (called by the probe) ------------------------------------------------------
    def begin_step(self, step: int, scale: float) -> None:
        self._step, self._scale = step, scale
        self._active = step % max(1, self.options.every) == 0
        self._pending = _Pending()
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
        largest ``abs_max`` over the step's rows is the whole batch's, its non-finite counts add up over them,
        and ``inputs_finite`` is per call, as it always is. The shares (``over_fp16_max`` and the underflow
        shares) are each micro-batch's own. Parameter gradients and updates stay one row per step: they are
        taken once, at the optimizer step, from the summed gradients."""
        if self._active:
            self._emit_pending()

    def _emit_pending(self) -> bool:
        """Turn every pending vector into rows (one transfer); whether there were any."""
        pending, self._pending = self._pending, _Pending()
        if not pending.vectors:
            return False
        for (kind, name, order, dtype, numel), vector, tensors in zip(pending.rows, pending.values(), pending.tensors):
            self._emit(kind, name, order, dtype, numel, vector, tensors)
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
        dtype = str(leaves[0].dtype).replace("torch.", "")
        self.compute_dtypes[name] = dtype
        outputs = [t for t in leaves if id(t) not in self._pending.seen]
        if not outputs:  # a container handing on its child's output: reuse the child's numbers
            if self.options.forward:
                self._queue_alias(name, order, dtype, leaves[0], _floating_leaves(args))
            return
        if self.options.forward:
            index = self._queue("forward", name, order, dtype, outputs, _floating_leaves(args))
            row = len(self._pending.rows) - 1
            vector = self._pending.vectors[index]
            for t in outputs:  # a module's input is usually an earlier module's output: its range is known
                self._pending.seen[id(t)] = (index, row)
                self._pending.ranges[id(t)] = vector[OUT_MIN:OUT_MAX + 1] if len(outputs) == 1 else value_range([t])
        if self.options.activation_grads:
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name, order))

    def _grad_hook(self, name: str, order: int):
        def hook(grad: torch.Tensor) -> None:
            if self._active and grad is not None:
                self._queue("activation_grad", name, order, str(grad.dtype).replace("torch.", ""), [grad], [], hold=False)
        return hook

    def _queue_alias(self, name: str, order: int, dtype: str, output: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        index, row = self._pending.seen[id(output)]
        source = self._pending.vectors[index]
        with torch.no_grad():
            own_inputs = value_range(inputs, self._pending.ranges) if inputs else source[:OUT_MIN]
            vector = torch.cat([own_inputs.to(source.device), source[OUT_MIN:]])
        numel = self._pending.rows[row][4]
        self._pending.add(("forward", name, order, dtype, numel), vector, self._pending.tensors[row])

    def _queue(self, kind: str, name: str, order: int, dtype: str, outputs: list[torch.Tensor],
               inputs: list[torch.Tensor], hold: bool = True) -> int:
        """Queue one module call's stat vector; the index of its vector. ``hold``: keep ``outputs`` until the
        step's transfer, for exact counts should they be non-finite. Activation gradients are not held: autograd
        frees each as soon as the next node consumed it, and holding them all kept a second copy of the step's
        activation gradients alive (issue #17); their rows say which kinds of non-finite values the exact range
        saw instead of counting them."""
        vector = tensor_vector(outputs, inputs, self.options.sample, self._pending.ranges)
        numel = sum(t.numel() for t in outputs)
        return self._pending.add((kind, name, order, dtype, numel), vector, outputs if hold else [])

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
            with torch.no_grad():  # cat copies: the samples survive the step's in-place update
                self._before = (params, _as_float(torch.cat([self._sampled(p) for p in params]))) if params else None

    def _sampled(self, t: torch.Tensor) -> torch.Tensor:
        return strided_sample(t, self.options.sample)

    def _segments_of(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        return _segment_ids(tuple(p.numel() for p in pieces), pieces[0].device, self._segment_cache)

    def _take_param_grads(self, divide_by: float) -> None:
        """Per-parameter gradient statistics, batched across parameters: a fixed handful of operators plus one
        view per parameter, whatever the number of parameters."""
        self._param_grads_taken = True
        named = [(name, g) for p, name in self.param_names.items() if (g := _dense_grad(p)) is not None]
        if not named:
            return
        grads = [g for _, g in named]
        n = len(grads)
        with torch.no_grad():
            # Norms accumulate in fp32: a half gradient's own norm can overflow fp16.
            l2 = torch.stack(norms(grads)).double() / divide_by
            samples = [self._sampled(g) for g in grads]
            ids = self._segments_of(samples)
            flat = _as_float(torch.cat(samples)).abs()
            if divide_by != 1.0:
                flat = flat / divide_by
            # Buckets of |g * S|: bucket 1 is 0 < |g S| < 2^-24, what fp16 flushes to zero at this scale.
            buckets = torch.bucketize(flat * self._scale, _edges(flat.device), right=True)
            counts = torch.bincount(ids * 5 + buckets, minlength=5 * n).view(n, 5)
            amax = torch.stack(norms(samples, math.inf)) / divide_by  # max |g|
            # The L1 mass that flushes (bucket 1) and the whole mass: underflow that matters is a share of the mass.
            mass_weights = flat.double()  # sums of up to 16384 values per parameter: accumulate in fp64
            flushed = torch.bincount(ids, weights=mass_weights * (buckets == 1), minlength=n)
            mass = torch.bincount(ids, weights=mass_weights, minlength=n)
            block = torch.cat([l2[:, None], counts, torch.stack([amax.double(), flushed, mass], 1)], 1)
        rows = [("param_grad", name, -1, str(g.dtype).replace("torch.", ""), g.numel()) for name, g in named]
        self._pending.add_block(rows, block, [[g] for g in grads])

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Lost updates (gradient non-zero, stored value unchanged) and update-to-weight ratio per parameter."""
        if not (self._active and self.options.updates and self._before):
            return
        (params, before), self._before = self._before, None
        n = len(params)
        with torch.no_grad():
            after = _as_float(torch.cat([self._sampled(p) for p in params]))
            # every one had a gradient when _pre_step chose it, and a step does not take it away
            grad_samples = [self._sampled(cast(torch.Tensor, p.grad)) for p in params]
            ids = self._segments_of(grad_samples)
            moved = after - before
            wanted = torch.cat(grad_samples) != 0
            lost = torch.bincount(ids, weights=wanted & (moved == 0), minlength=n)
            wanted_count = torch.bincount(ids, weights=wanted, minlength=n)
            delta = torch.bincount(ids, weights=moved.double().square(), minlength=n).sqrt()
            weight = torch.bincount(ids, weights=before.double().square(), minlength=n).sqrt()
            block = torch.nn.functional.pad(torch.stack([lost, wanted_count, delta, weight], 1), (0, VECTOR - 4))
        rows = [("update", self.param_names[p], -1, str(p.dtype).replace("torch.", ""), p.numel()) for p in params]
        self._pending.add_block(rows, block, [[] for _ in params])

    # --- turning vectors into rows ------------------------------------------------------------------
    def _emit(self, kind: str, name: str, order: int, dtype: str, numel: int, v: list[float],
              tensors: list[torch.Tensor]) -> None:
        base = {"step": self._step, "module" if kind in ("forward", "activation_grad") else "param": name, "dtype": dtype}
        if kind in ("forward", "activation_grad"):
            finite = all(math.isfinite(x) for x in (v[OUT_MIN], v[OUT_MAX]))
            nan = pos = neg = 0
            abs_max = max(abs(v[OUT_MIN]), abs(v[OUT_MAX]))
            if not finite and tensors:
                nan, pos, neg = exact_counts(tensors)
                abs_max = _finite_abs_max(tensors)
            elif not finite:  # not held (activation gradients): what the exact range shows, 1 for present
                nan, pos, neg, abs_max = kinds_in_range(v[OUT_MIN], v[OUT_MAX]) + (math.nan,)
            sample_n = max(sum(v[ZERO:OVER + 1]), 1.0)
            nonzero = max(sample_n - v[ZERO], 1.0)
            row = {
                **base, "order": order, "numel": numel,
                "abs_max": abs_max,
                "nan": nan, "posinf": pos, "neginf": neg,
                "over_fp16_max": v[OVER] / sample_n,
                "below_fp16_subnormal": v[SUB24] / nonzero,
                "below_fp16_normal": (v[SUB24] + v[SUB14]) / nonzero,
                "zero_share": v[ZERO] / sample_n,
            }
            if kind == "forward":
                row["inputs_finite"] = math.isfinite(v[IN_MIN]) and math.isfinite(v[IN_MAX])
                row["input_abs_max"] = max(abs(v[IN_MIN]), abs(v[IN_MAX])) if row["inputs_finite"] else math.inf
                self.forward_rows.append(row)
            else:
                row["loss_scale"] = self._scale
                self.activation_grad_rows.append(row)
        elif kind == "param_grad":
            norm, zero, under, amax = v[0], v[1], v[2], v[6]
            sample_n = sum(v[1:6])
            nonzero = sample_n - zero
            nan = pos = neg = 0
            if not math.isfinite(norm):
                nan, pos, neg = exact_counts(tensors)
            self.param_rows.append({
                **base, "grad_norm": norm, "nan": nan, "posinf": pos, "neginf": neg,
                "zero_share": 1.0 - nonzero / max(sample_n, 1.0),
                "underflow_at_scale": under / max(nonzero, 1.0), "grad_abs_max": amax, "loss_scale": self._scale,
                "underflow_mass_at_scale": v[7] / v[8] if v[8] > 0 else 0.0,
            })
        else:
            lost, wanted, delta, weight = v[:4]
            self.update_rows.append({
                **base, "lost_update_share": lost / wanted if wanted else 0.0,
                "update_to_weight": delta / weight if weight else (math.inf if delta else 0.0),
            })

    # --- results ----------------------------------------------------------------------------------
    def frames(self) -> dict[str, pd.DataFrame]:
        """The four tables: forward, activation_grads, param_grads, updates."""
        return {
            "forward": pd.DataFrame(self.forward_rows),
            "activation_grads": pd.DataFrame(self.activation_grad_rows),
            "param_grads": pd.DataFrame(self.param_rows),
            "updates": pd.DataFrame(self.update_rows),
        }

    def first_nonfinite_forward(self) -> dict[str, Any] | None:
        """The first module (execution order) whose output is non-finite while its inputs are finite."""
        bad = [r for r in self.forward_rows if (r["nan"] or r["posinf"] or r["neginf"]) and r["inputs_finite"]]
        if not bad:
            return None
        first_step = min(r["step"] for r in bad)
        return min((r for r in bad if r["step"] == first_step), key=lambda r: r["order"])


def kinds_in_range(low: float, high: float) -> tuple[int, int, int]:
    """``(nan, posinf, neginf)`` as 0/1 flags from a tensor's exact ``[min, max]``: NaN propagates into both
    (and then hides whether infinities are there too), +inf is the max, -inf the min."""
    if math.isnan(low) or math.isnan(high):
        return 1, 0, 0
    return 0, int(high == math.inf), int(low == -math.inf)


def _finite_abs_max(tensors: list[torch.Tensor]) -> float:
    values = [t.detach().float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max().item() for t in tensors if t.numel()]
    return max(values, default=0.0)


def precision_map(model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
                  compute_dtypes: dict[str, str] | None = None) -> pd.DataFrame:
    """For every module: the dtype its computation ran in, and the dtypes of its parameters, buffers and optimizer state.

    ``trained_param_dtypes``: the dtypes of the parameters the training trains (they require grad and an
    optimizer holds them); ``frozen``: the module has parameters and trains none of them. Only trained
    parameters are the training's weights: a frozen module kept in fp16 on purpose (a distillation teacher, a
    frozen encoder, an embedding table) is stored in half precision without being trained in it.
    """
    compute_dtypes = compute_dtypes or {}
    optimizers = [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    state = {p: s for opt in optimizers for p, s in opt.state.items()}
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    rows = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        buffers = [b for b in module.buffers(recurse=False) if b.is_floating_point()]
        state_dtypes = sorted({str(v.dtype).replace("torch.", "") for p in params for v in state.get(p, {}).values()
                               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0})
        trained = [p for p in params if p.requires_grad and id(p) in held]
        rows.append({
            "module": name or "<root>", "type": type(module).__name__,
            "compute_dtype": compute_dtypes.get(name or "<root>"),
            "param_dtypes": _dtype_names(params),
            "buffer_dtypes": _dtype_names(buffers),
            "optimizer_state_dtypes": ",".join(state_dtypes) or None,
            "trained_param_dtypes": _dtype_names(trained),
            "frozen": bool(params) and not trained,
        })
    return pd.DataFrame(rows)


def _dtype_names(tensors: list[torch.Tensor]) -> str | None:
    """The tensors' dtypes as a sorted comma-joined string (``"float16,float32"``), None for no tensors."""
    return ",".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors})) or None
