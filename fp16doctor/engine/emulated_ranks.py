"""The ranks of a sharded training, emulated in one process: a step as FSDP2 computes it across its ranks.

FSDP2 (``fully_shard`` with a ``MixedPrecisionPolicy``) does three things to a step that one process under autocast
does not, and a replay that leaves them out proves nothing about the run:

* it casts the **parameters themselves** to ``param_dtype`` for the forward and backward: every op runs in that
  dtype, not only those autocast casts (a norm's ``1e-8`` epsilon is 0 in fp16), and each rank's gradients come out
  in it;
* it **reduces** the ranks' gradients in ``reduce_dtype`` (``param_dtype`` where none is set): each rank's gradient
  is cast to it, then, in fp16, divided by a pre-factor before the sum and by a post-factor after it (their product
  the world size, the pre-factor about its square root); in fp32 and bf16 the ranks' gradients are averaged;
* the fp32 master parameters receive the mean, and the optimizer steps them.

FSDP1 (``FullyShardedDataParallel`` with a ``MixedPrecision``, ``wrapper="fsdp1"``) is emulated as FSDP2, except that
it divides by the same pre- and post-factors in every dtype, and with gradient sync off adds micro-batches up in
``param_dtype``. Its ``buffer_dtype`` is not emulated: buffers stay in
their own dtype. A DDP compression hook (``fp16_compress_hook``) is emulated the same way with ``wrapper="ddp"``: the
parameters stay fp32, each rank's gradient is cast to the hook's dtype and divided by the world size before the sum.

Rank r takes the r-th run of ``micro_batches`` of the step's batches, each micro-batch its own forward and backward
(the rank's gradients accumulating in the parameters' dtype), as the run's ranks took them. The FP32 baseline runs
the same ranks with no policy (``policy_dtypes=False``). The policy's casts are FSDP's, not the training's code:
no torch-function mode of the doctor's (the FP32 baseline's, a runtime fix's) rewrites them.

What the reduction did is read as it runs (:class:`ReductionReading`): per parameter, the largest finite |local
gradient| handed to it (scaled, as reduced), and the steps where every rank's local gradient was finite and the
reduced one is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ShardingConfig
from ..userfile.batches import floats_to
from ..userfile.loop import LossFn

REDUCTION = "the ranks' gradient reduction (emulated)"
"""Where an op of the emulated reduction runs, as a localisation names it (phase ``reduction``, no module)."""

_reducing = False


def reducing() -> bool:
    """Whether the emulated ranks' gradient reduction is running now: an overflow there is the reduction's, not
    the loss computation's (the localisation's phase ``reduction``)."""
    return _reducing


@contextmanager
def _reduction() -> Iterator[None]:
    global _reducing
    _reducing = True
    try:
        yield
    finally:
        _reducing = False


@dataclass
class ReductionReading:
    """What the emulated reductions did, per parameter, over the steps taken."""

    local_max: dict[str, float] = field(default_factory=dict)
    """The largest finite |local gradient| any rank handed the reduction (scaled by the loss scale, as reduced)."""
    nonfinite_steps: dict[str, list[int]] = field(default_factory=dict)
    """The steps where every rank's local gradient was finite and the reduced one is not."""
    local_nonfinite_steps: dict[str, list[int]] = field(default_factory=dict)
    """The steps where a rank's own local gradient was already non-finite (its batch, not the reduction)."""

    def worst(self) -> str | None:
        """The parameter the reduction broke most often (ties: the largest local gradient), None where it broke none."""
        broken = [name for name, steps in self.nonfinite_steps.items() if steps]
        if not broken:
            return None
        return max(broken, key=lambda n: (len(self.nonfinite_steps[n]), self.local_max.get(n, 0.0)))


def divide_factors(world: int, reduce_dtype: torch.dtype, wrapper: str = "fully_shard") -> tuple[float, float]:
    """The (pre, post) division of a reduction over ``world`` ranks. FSDP2's: in fp16 about the square root of the
    world size before the sum and the rest after it, against overflow; in fp32 and bf16 the average, all after.
    FSDP1's: the square-root split in every dtype. A DDP compression hook's (``fp16_compress_hook``): all of it
    before the sum, after the cast."""
    if wrapper == "ddp":
        return float(world), 1.0
    if reduce_dtype != torch.float16 and wrapper != "fsdp1":
        return 1.0, float(world)
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return float(pre), world / pre


def emulated_ranks_step(
    model: torch.nn.Module,
    batches: list[Any],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    autocast: Callable[[], Any],
    loss_fn: LossFn,
    sharding: ShardingConfig,
    max_grad_norm: float | None = None,
    reading: ReductionReading | None = None,
    step: int = 0,
    policy_dtypes: bool = True,
    fp32_modules: tuple[str, ...] = (),
) -> torch.Tensor:
    """One optimizer step of ``sharding.world`` ranks on ``batches`` (``world`` x ``micro_batches`` of them, rank
    by rank); the loss returned is the ranks' mean (the global batch's), summed over a rank's micro-batches.

    ``fp32_modules`` (``overrides.fp32_modules``) are sharded with a policy of their own, as FSDP2 keeps a module in
    fp32: ``fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=<the
    root's param_dtype>))``: their parameters stay fp32 and their outputs go back to the root's dtype."""
    optimizer.zero_grad(set_to_none=True)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    root = OwnPolicy.root(sharding) if policy_dtypes else OwnPolicy("")
    own = own_policies(sharding, fp32_modules, root) if policy_dtypes else []
    policy_of = {name: owner(name, own, root) for name, _ in params}
    reduce_dtypes = {name: policy.reduce_dtype for name, policy in policy_of.items()}
    # One reduction per micro-batch where the ranks reduce after every backward (FSDP2's default), else one of the
    # gradients each rank accumulated unsharded over its micro-batches (gradient sync off until the last).
    reductions = sharding.micro_batches if sharding.sync_each_micro_batch else 1
    accumulate_in = {
        name: _accumulated_in(sharding, dtype, reductions, sharding.micro_batches)
        for name, dtype in reduce_dtypes.items()
    }
    reduced: list[dict[str, torch.Tensor]] = [{} for _ in range(reductions)]
    local_bad: set[str] = set()
    total: torch.Tensor | None = None
    for rank in range(sharding.world):
        mine = batches[rank * sharding.micro_batches : (rank + 1) * sharding.micro_batches]
        # This rank's unsharded parameters: leaves of their own, in param_dtype, so that its gradients are its own
        # and in the dtype FSDP reduces them from.
        with torch._C.DisableTorchFunction():
            leaves = {
                name: p.detach().to(policy_of[name].param_dtype or p.dtype).requires_grad_(True) for name, p in params
            }
        held: dict[str, torch.Tensor] = {}  # with sync off: the micro-batches' gradients so far, unsharded
        with _parameters_replaced(model, leaves), _inputs_cast(model, [root, *own]), _outputs_cast(model, [root, *own]):
            for micro, batch in enumerate(mine):
                with autocast() if sharding.autocast else contextlib.nullcontext():
                    loss = loss_fn(model, batch)
                scaler.scale(loss).backward()
                total = loss.detach().float() if total is None else total + loss.detach().float()
                _accumulate(leaves, held, accumulate_in)
                if reductions > 1 or micro == len(mine) - 1:
                    _hand_over(
                        held, reduced[micro if reductions > 1 else 0], local_bad, reduce_dtypes, sharding, reading
                    )
    if reading is not None:
        for name in sorted(local_bad):
            reading.local_nonfinite_steps.setdefault(name, []).append(step)
    with _reduction(), torch._C.DisableTorchFunction():
        for name, p in params:
            # each reduction's result lands in the sharded gradient, in the parameter's own dtype, where FSDP2
            # accumulates over the micro-batches
            parts = [
                (sums[name] / divide_factors(sharding.world, sums[name].dtype, sharding.wrapper)[1]).to(p.dtype)
                for sums in reduced
                if name in sums
            ]
            if parts:
                p.grad = torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]
                if reading is not None and name not in local_bad and not bool(torch.isfinite(p.grad).all()):
                    reading.nonfinite_steps.setdefault(name, []).append(step)
    # From here on as in one process: unscale before anything reads gradient magnitudes, then step (skipped on
    # inf/NaN: one process sees every rank's reduced gradient, as FSDP2's DTensor found-inf does), then the scale.
    scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    assert total is not None, "a step needs at least one batch"
    return total / sharding.world


def _accumulate(
    leaves: dict[str, torch.Tensor], held: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype | None]
) -> None:
    """A micro-batch's gradients moved off the leaves into ``held``. A parameter's dtype in ``dtypes`` is its
    ``reduce_dtype`` where gradient sync is off over several micro-batches: FSDP2 then accumulates them unsharded
    in it (its ``unsharded_accumulated_grad``); else (None, or no policy dtype) in ``param_dtype``, the leaves'
    own."""
    with _reduction(), torch._C.DisableTorchFunction():
        for name, leaf in leaves.items():
            if leaf.grad is None:
                continue
            dtype = dtypes.get(name)
            grad = leaf.grad if dtype is None else leaf.grad.to(dtype)
            held[name] = grad if name not in held else held[name] + grad
            leaf.grad = None


def _hand_over(
    held: dict[str, torch.Tensor],
    sums: dict[str, torch.Tensor],
    local_bad: set[str],
    reduce_dtypes: dict[str, torch.dtype | None],
    sharding: ShardingConfig,
    reading: ReductionReading | None,
) -> None:
    """A rank's gradients so far added to a reduction, each in its parameter's ``reduce_dtype``, then cleared (the
    next micro-batch's start from zero)."""
    with _reduction():
        for name, grad in held.items():
            sums[name] = _add_rank(sums.get(name), grad, reduce_dtypes.get(name), sharding, reading, name)
            if not bool(torch.isfinite(grad).all()):
                local_bad.add(name)
        held.clear()


def _add_rank(
    so_far: torch.Tensor | None,
    grad: torch.Tensor,
    reduce_dtype: torch.dtype | None,
    sharding: ShardingConfig,
    reading: ReductionReading | None,
    name: str,
) -> torch.Tensor:
    """One rank's gradient added to the reduction: cast to the reduction's dtype (the gradient's own where the policy
    sets none), then pre-divided, as FSDP2 does."""
    if reading is not None:
        _read_local(reading, name, grad)
    dtype = reduce_dtype or grad.dtype
    pre, _ = divide_factors(sharding.world, dtype, sharding.wrapper)
    with torch._C.DisableTorchFunction():
        part = grad.to(dtype) / pre
    return part if so_far is None else so_far + part


def _read_local(reading: ReductionReading, name: str, grad: torch.Tensor) -> None:
    """The largest finite |local gradient| handed to the reduction so far."""
    finite = torch.isfinite(grad)
    top = float(grad.detach().abs().float().where(finite, 0.0).max()) if grad.numel() else 0.0
    reading.local_max[name] = max(reading.local_max.get(name, 0.0), top)


@contextmanager
def _parameters_replaced(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """The model's parameters swapped for ``tensors`` (by name) while the block runs, then put back: the loss code
    calls the model as it always does. ``functional_call``'s own swap, which the loss code could not reach."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(model, tensors, tie_weights=True):  # a tied head follows its embedding
        yield


@dataclass(frozen=True)
class OwnPolicy:
    """A mixed-precision policy as it takes effect on the parameters one ``fully_shard`` call groups: the root's,
    or a submodule's own (``fully_shard(block, mp_policy=...)``: FSDP2 gives each group its own policy)."""

    path: str
    """The module's path ("": the root)."""
    param_dtype: torch.dtype | None = None
    """What its parameters are cast to (None: their own dtype)."""
    reduce_dtype: torch.dtype | None = None
    """What its gradients are reduced in (None: their own dtype, ``param_dtype``)."""
    output_dtype: torch.dtype | None = None
    """What its outputs are cast to (None: left as computed)."""
    cast_inputs: bool = False
    """Its floating inputs are cast to ``param_dtype`` (``cast_forward_inputs``, where ``param_dtype`` is set)."""

    @classmethod
    def root(cls, sharding: ShardingConfig) -> OwnPolicy:
        param = _dtype(sharding.param_dtype)
        return cls(
            "", param, _dtype(sharding.reduce_dtype), _dtype(sharding.output_dtype), sharding.cast_forward_inputs
        )


def own_policies(sharding: ShardingConfig, fp32_modules: tuple[str, ...], root: OwnPolicy) -> list[OwnPolicy]:
    """The submodules' own policies: those the run's ``fully_shard`` calls gave (``sharding.module_policies``), and
    each module a fix keeps in fp32, sharded as FSDP2 keeps one: ``MixedPrecisionPolicy(param_dtype=torch.float32,
    output_dtype=<the root's param_dtype>)``."""
    found = [
        OwnPolicy(
            path,
            _dtype(policy.get("param_dtype")),
            _dtype(policy.get("reduce_dtype") or policy.get("param_dtype")),
            _dtype(policy.get("output_dtype")),
            bool(policy.get("cast_forward_inputs", True)),
        )
        for path, policy in sharding.module_policies.items()
        if path not in fp32_modules
    ]
    kept = [
        OwnPolicy(path, torch.float32, torch.float32, root.param_dtype, sharding.cast_forward_inputs)
        for path in fp32_modules
    ]
    return found + kept


def owner(name: str, own: list[OwnPolicy], root: OwnPolicy) -> OwnPolicy:
    """The policy of the parameter ``name``: its deepest module's with a policy of its own, else the root's. A
    policy without dtypes (a module with none: fp32) applies to its parameters as FSDP2's does: they stay as they
    are."""
    mine = [policy for policy in own if name.startswith(f"{policy.path}.")]
    return max(mine, key=lambda policy: len(policy.path)) if mine else root


@contextmanager
def _inputs_cast(model: torch.nn.Module, policies: list[OwnPolicy]) -> Iterator[None]:
    """``cast_forward_inputs``: each module's floating-point inputs cast to its policy's ``param_dtype`` while the
    block runs (the root's to the root's; a module kept in fp32 to float32)."""
    targets = [(model.get_submodule(p.path), p.param_dtype) for p in policies if p.cast_inputs and p.param_dtype]

    def cast_to(dtype: torch.dtype) -> Callable[..., Any]:
        def cast(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
            with torch._C.DisableTorchFunction():
                return floats_to(args, dtype), floats_to(kwargs, dtype)

        return cast

    handles = [m.register_forward_pre_hook(cast_to(dtype), with_kwargs=True) for m, dtype in targets]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _outputs_cast(model: torch.nn.Module, policies: list[OwnPolicy]) -> Iterator[None]:
    """Each module's outputs cast to its policy's ``output_dtype`` while the block runs."""
    targets = [(model.get_submodule(p.path), p.output_dtype) for p in policies if p.output_dtype is not None]

    def cast_to(dtype: torch.dtype) -> Callable[..., Any]:
        def cast(module: torch.nn.Module, args: Any, output: Any) -> Any:
            with torch._C.DisableTorchFunction():
                return floats_to(output, dtype)

        return cast

    handles = [m.register_forward_hook(cast_to(dtype)) for m, dtype in targets]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _accumulated_in(
    sharding: ShardingConfig, reduce_dtype: torch.dtype | None, reductions: int, micro_batches: int
) -> torch.dtype | None:
    """The dtype a rank adds its unreduced micro-batches up in (None: as computed). FSDP2 keeps them unsharded in
    ``reduce_dtype``; FSDP1's post-backward hook returns under ``no_sync()`` before its cast to ``reduce_dtype``, so
    its flat gradient adds them up in ``param_dtype`` (as computed); DDP in ``.grad``, the parameters' dtype, and
    its hook compresses only the sum."""
    unreduced = reductions == 1 and micro_batches > 1
    return reduce_dtype if unreduced and sharding.wrapper == "fully_shard" else None


def _dtype(name: Any) -> torch.dtype | None:
    return None if name in (None, "None") else getattr(torch, str(name))
