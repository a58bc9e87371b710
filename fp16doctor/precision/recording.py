"""Observing a training step without changing what it does.

The probe engine hands every training step (its own canonical loop or the
user's ``train_step``) a :class:`RecordingGradScaler` and watches the optimizer
through its step hooks. Together they tell, for any loop, whether the
optimizer really stepped, whether the scaler found inf/NaN (read before
``update()``, so fused optimizers and static scales are covered), the
unscaled gradient norm, and the order of scale / unscale / clip calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..tensors import dtype_name, grad_values


@dataclass
class StepTrace:
    """What one training step did, as observed."""

    scaled: bool = False
    """``scaler.scale(loss)`` was called with the scaler enabled."""
    scale_called: bool = False
    """``scaler.scale(loss)`` was called at all (False: the step scales by hand, or not at all)."""
    unscaled: bool = False
    """``scaler.unscale_`` ran (explicitly, or implicitly inside ``scaler.step``)."""
    found_inf: bool = False
    """The scaler found inf/NaN gradients and skipped (read before ``update()``)."""
    step_called: bool = False
    """``scaler.step(optimizer)`` was called: an optimizer step was attempted (it may be skipped)."""
    optimizer_stepped: bool = False
    """``optimizer.step()`` actually ran."""
    grad_norm: float | None = None
    """Global L2 norm of the unscaled gradients, taken at unscale or just before the optimizer step."""
    scale_used: float = 1.0
    """The loss scale this step's backward ran with."""
    loss_dtype: str | None = None
    clip_calls: list[dict[str, Any]] = field(default_factory=list)
    """One entry per clip_grad_norm_/clip_grad_value_ call: whether gradients were still scaled."""
    scaler_calls: list[str] = field(default_factory=list)
    """The GradScaler calls of the iteration in order (``scale``, ``unscale_``, ``step``, ``update``), as the loop made them."""
    calls: list[str] = field(default_factory=list)
    """The GradScaler and optimizer calls of the iteration in order, naming the optimizer each acts on
    (``scale``, ``unscale_(D)``, ``step(D)``, ``D.step()`` for a plain optimizer step, ``update``)."""
    skipped_optimizers: list[str] = field(default_factory=list)
    """The optimizers whose step the scaler skipped this iteration (inf/NaN in their gradients)."""
    unscaled_params: dict[int, torch.nn.Parameter] = field(default_factory=dict, repr=False)
    """The parameters whose gradients ``unscale_`` has unscaled this iteration (of every optimizer so far)."""
    clipped_params: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    """Without a scaler: the parameters the iteration's clip calls were given so far (the norm is theirs, before
    each clip, as ``unscale_`` takes it over the parameters unscaled so far)."""


def out_of_sight() -> Any:
    """A block of the doctor's own reads and arithmetic inside the user's step (the scale it records, the skips it
    reads, a gradient norm), run with the dispatch modes set aside: the localisation's operator tracer and
    ``speed``'s counter see the training's operators and host synchronisations, not the doctor's."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def global_grad_norm(params: Iterable[torch.Tensor], divide_by: float = 1.0) -> float:
    """L2 norm over all gradients, with one host synchronisation: each gradient's in fp32, squared and summed on
    the host in double. A gradient whose fp32 norm overflows though its values are finite (past ~1e19: a diverging
    training's gradients still are) has its norm taken again in fp64, so that it does not read as a non-finite
    gradient. A sharded gradient (FSDP2's DTensor) counts its whole: each rank's shard, the ranks' sums of squares
    added up (one all-reduce, which every rank makes at the same call). Out of sight of the localisation's operator
    tracer: the doctor's own arithmetic is not the training's."""
    with out_of_sight():
        grads = [g for g in map(grad_values, params) if g is not None]
        plain = [g for g in grads if not _is_dtensor(g)]
        squares = _squares(plain)
        if len(plain) < len(grads):
            squares += _sharded_squares([g for g in grads if _is_dtensor(g)])
    value = math.sqrt(squares)
    return value / divide_by if divide_by != 1.0 else value


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor) is not torch.Tensor and hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def _squares(tensors: list[torch.Tensor]) -> float:
    """The sum of the tensors' squared norms, read with one synchronisation; an fp32 norm that overflows is taken
    again in fp64 where the tensor's values are finite (an inf or NaN stays)."""
    if not tensors:
        return 0.0
    each = [t.float().norm() for t in tensors]
    value = torch.stack(each).double().pow(2).sum().item()
    if math.isfinite(value):
        return float(value)
    values = [n.item() for n in each]  # trouble only: which overflowed fp32, and which hold an inf or NaN
    for i, v in enumerate(values):
        if not math.isfinite(v) and bool(torch.isfinite(tensors[i]).all()):
            values[i] = tensors[i].double().norm().item()
    return sum(v * v for v in values)


def _sharded_squares(grads: list[Any]) -> float:
    """DTensor gradients' squared norms, whole: each rank's local part squared, the sums added over every mesh
    dimension that shards it (a replica counted once: FSDP2's hybrid sharding adds over the shard dimension only);
    a partial placement is gathered whole first. One all-reduce per mesh dimension, in the same order on every
    rank."""
    total = 0.0
    buckets: dict[tuple[int, tuple[int, ...]], tuple[Any, list[torch.Tensor]]] = {}
    for grad in grads:
        placements = tuple(grad.placements)
        if not all(p.is_shard() or p.is_replicate() for p in placements):
            total += _squares([grad.full_tensor()])
            continue
        sharded_dims = tuple(i for i, p in enumerate(placements) if p.is_shard())
        buckets.setdefault((id(grad.device_mesh), sharded_dims), (grad.device_mesh, []))[1].append(grad.to_local())
    for (_, sharded_dims), (mesh, parts) in buckets.items():
        ours = torch.tensor(_squares(parts), dtype=torch.float64, device=parts[0].device)
        for dim in sharded_dims:  # an inf or NaN on any rank reaches every rank
            torch.distributed.all_reduce(ours, group=mesh.get_group(dim))
        total += float(ours.item())
    return total


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class RecordingGradScaler(torch.amp.GradScaler):
    """A real ``torch.amp.GradScaler`` that also fills the current :class:`StepTrace`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace = StepTrace()
        self.names: dict[int, str] = {}
        """The probe's names of its optimizers by ``id`` (the scaler keys its per-optimizer state the same way)."""
        self.stepping: torch.optim.Optimizer | None = None
        """The optimizer inside ``step()`` right now: its own ``optimizer.step()`` is then the scaler's, not a plain one."""

    def name_of(self, optimizer: torch.optim.Optimizer) -> str:
        return self.names.get(id(optimizer), type(optimizer).__name__)

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        self.trace.scale_called = True
        self.trace.scaler_calls.append("scale")
        self.trace.calls.append("scale")
        if self.is_enabled():
            self.trace.scaled = True
            with out_of_sight():
                self.trace.scale_used = float(self.get_scale())
        if isinstance(outputs, torch.Tensor):
            self.trace.loss_dtype = dtype_name(outputs.dtype)
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer, _implicit: bool = False) -> None:
        if not _implicit:
            self.trace.scaler_calls.append("unscale_")
            self.trace.calls.append(f"unscale_({self.name_of(optimizer)})")
        super().unscale_(optimizer)
        if self.is_enabled():
            self.trace.unscaled = True
            self.trace.unscaled_params.update({id(p): p for p in optimizer_params(optimizer)})
            # Several optimizers: the norm over every gradient unscaled so far this iteration, not the last one's.
            self.trace.grad_norm = global_grad_norm(self.trace.unscaled_params.values())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.trace.step_called = True
        self.trace.scaler_calls.append("step")
        self.trace.calls.append(f"step({self.name_of(optimizer)})")
        if (
            self.is_enabled()
            and self._scale is not None
            and self._per_optimizer_states[id(optimizer)]["stage"].name != "UNSCALED"
        ):
            # What step() does first anyway (fused optimizers accept it too); done here so the
            # unscaled norm is recorded even on the steps the scaler skips. (Per optimizer: with several, one
            # unscaled does not unscale the next. A second step() before update() gets GradScaler's refusal.)
            self.unscale_(optimizer, _implicit=True)
        self.stepping = optimizer
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            self.stepping = None

    def update(self, new_scale: Any = None) -> None:
        self.trace.scaler_calls.append("update")
        self.trace.calls.append("update")
        if self.is_enabled():
            with out_of_sight():
                self._read_found_inf()
        super().update(new_scale)

    def _read_found_inf(self) -> None:
        found = []
        for key, state in self._per_optimizer_states.items():
            skipped = bool(sum(v.item() for v in state["found_inf_per_device"].values()))
            found += list(state["found_inf_per_device"].values())
            if skipped and state["stage"].name == "STEPPED":
                self.trace.skipped_optimizers.append(self.names.get(key, "optimizer"))
        if found:
            self.trace.found_inf = bool(sum(v.item() for v in found))


class OptimizerWatch:
    """Step hooks on the optimizers: did one step, through the scaler or plainly, and the gradient norm when no
    scaler reported one."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], scaler: RecordingGradScaler):
        self.scaler = scaler
        self._handles: list[Any] = []
        for optimizer in optimizers:
            self.watch(optimizer)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch one more optimizer (one the training created itself, found while it stepped)."""
        self._handles.append(optimizer.register_step_pre_hook(self._pre_step))

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trace = self.scaler.trace
        trace.optimizer_stepped = True
        if self.scaler.stepping is not optimizer:
            trace.calls.append(f"{self.scaler.name_of(optimizer)}.step()")  # a plain step, not through scaler.step()
        if trace.grad_norm is None:
            trace.grad_norm = global_grad_norm(optimizer_params(optimizer))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def double_steps(calls: list[str]) -> list[str]:
    """The optimizers an iteration stepped both through ``scaler.step()`` and with a plain ``optimizer.step()``:
    they step twice, and the plain step applies inf/NaN gradients on an overflow step."""
    through_scaler = {c[len("step(") : -1] for c in calls if c.startswith("step(")}
    return [
        name
        for name in dict.fromkeys(c[: -len(".step()")] for c in calls if c.endswith(".step()"))
        if name in through_scaler
    ]


def step_outcome(trace: StepTrace, nonfinite_grads: bool = False) -> str:
    """What the iteration did to the weights: ``"stepped"``, ``"skipped"`` or ``"accumulated"``.

    Only an attempted optimizer step that did not happen is a skip (the scaler
    found inf/NaN, or a fused optimizer skipped inside): an iteration that never
    called ``scaler.step`` nor ``optimizer.step`` is a gradient-accumulation
    micro-step, in FP32 as much as in AMP. The exception is a loop without a
    GradScaler that leaves inf/NaN gradients unapplied: its own, hand-rolled skip.
    """
    if trace.optimizer_stepped and not trace.found_inf:  # fused optimizers are called, then skip inside
        return "stepped"
    if trace.step_called or trace.optimizer_stepped:
        return "skipped"
    if nonfinite_grads and not trace.scaled:
        return "skipped"
    return "accumulated"


def finish_trace(trace: StepTrace, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> None:
    """Fill what the step's calls did not: the norm of gradients left by a loop without scaler or step."""
    if trace.grad_norm is None:
        divide = trace.scale_used if trace.scaled and not trace.unscaled else 1.0
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        params = {id(p): p for optimizer in optimizers for p in optimizer_params(optimizer)}
        trace.grad_norm = global_grad_norm(params.values(), divide)
    trace.unscaled_params = {}  # the record keeps what was measured, not references to the parameters
