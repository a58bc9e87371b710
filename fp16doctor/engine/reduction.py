"""The ranks' gradient reduction, measured against the same reduction in fp32.

* **DDP** hands each bucket of local gradients to its communication hook: the default averages them in their
  dtype (fp32 master gradients), a compression hook (``fp16_compress_hook``, ``bf16_compress_hook``) casts them
  first and sums them in that dtype. The doctor puts a measuring hook around whichever hook the training registers
  (or the default).
* **FSDP2** (``fully_shard``) reduce-scatters each parameter group's unsharded gradients in its policy's
  ``reduce_dtype`` in ``FSDPParamGroup.post_backward``: the doctor takes the unsharded gradients as it is called,
  and compares each rank's shard of the result when it returns.

Either way each rank's local gradients are averaged once more in fp32, on a group of the doctor's own, and the
reduction's result is compared with that reference, parameter by parameter, over every rank. With ``repair`` the
reference is what the training gets back: the same training with its reduction made in fp32, the fix tried on the
same weights and batches. FSDP1's flat-parameter reduce-scatter is not measured.

What is compared is the gradient as it is reduced: scaled by the GradScaler's scale where the training has one (an
fp16 cast of scaled gradients overflows at 65504 although the unscaled gradients are small).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

COLUMNS = ["name", "numel", "relative_error", "nonfinite_steps", "local_max", "first_nonfinite_step"]


@dataclass
class _Reading:
    """One parameter's reduction at one step, on this rank (its shard, under FSDP)."""

    numel: int
    diff_sq: float = 0.0
    """Σ (reduced − fp32 mean)² over the part this rank holds."""
    ref_sq: float = 0.0
    nonfinite: float = 0.0
    """1: the reduction made an inf or NaN where the fp32 reference is finite."""
    local_nonfinite: float = 0.0
    """1: a local gradient was already non-finite (the rank's own, not the reduction's doing)."""
    local_max: float = 0.0


@dataclass
class ReductionMeter:
    """Measures a DDP model's communication hook or FSDP2's reduce-scatter against an fp32 reduction."""

    names: dict[int, str] = field(default_factory=dict)
    """Parameter name by ``id`` (the names of the model the user wrote, without DDP's ``module.`` prefix)."""
    repair: bool = False
    """Hand the training the fp32 mean instead of the reduction's result: the training with its reduction in fp32."""
    hook_names: list[str] = field(default_factory=list)
    """The communication hooks the training registered (empty: DDP's default, an all-reduce in the gradients' dtype)."""
    step: int = 0
    """The optimizer step now reducing (the caller advances it)."""
    _group: Any = None
    _readings: dict[tuple[int, str], _Reading] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._group = dist.new_group(backend="gloo")  # a group of its own: the reference never queues behind DDP's

    # --- installing -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def around_registration(self) -> Iterator[None]:
        """While the block runs (the training file's ``parallelize()`` and steps), a hook DDP is given is wrapped,
        and FSDP2's reduce-scatter is measured."""
        ddp = torch.nn.parallel.DistributedDataParallel
        original = ddp.register_comm_hook
        meter = self

        def register(model: torch.nn.parallel.DistributedDataParallel, state: Any, hook: Hook) -> None:
            meter.hook_names.append(getattr(hook, "__name__", type(hook).__name__))
            model._fp16doctor_measured = True  # type: ignore[assignment]
            original(model, state, meter.wrap(hook))

        ddp.register_comm_hook = register  # type: ignore[method-assign,assignment]
        try:
            with self._around_fsdp2():
                yield
        finally:
            ddp.register_comm_hook = original  # type: ignore[method-assign]

    def attach(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Measure DDP's default reduction where the training registered no hook of its own."""
        if not getattr(model, "_fp16doctor_measured", False):
            torch.nn.parallel.DistributedDataParallel.register_comm_hook(
                model, None, self.wrap(default_hooks.allreduce_hook)
            )

    def wrap(self, hook: Hook) -> Hook:
        def measured(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations, as objects
            local = bucket.buffer().detach().clone()  # before the hook: the default divides the buffer in place
            params = list(bucket.parameters())
            sizes = [p.numel() for p in params]
            reference, tops = self._fp32_mean(local, sizes)

            def compare(fut: torch.futures.Future[Any]) -> torch.Tensor:
                value = fut.value()
                reduced = value[0] if isinstance(value, list) else value
                for param, got, want, local_part, top in zip(
                    params, reduced.split(sizes), reference.split(sizes), local.split(sizes), tops.tolist()
                ):
                    self._read(self._name(param), got, want, local_part, top, param.numel())
                return reference.to(reduced.dtype) if self.repair else reduced

            return hook(state, bucket).then(compare)

        measured.__name__ = getattr(hook, "__name__", "hook")
        return measured

    @contextlib.contextmanager
    def _around_fsdp2(self) -> Iterator[None]:
        group_class = _fsdp2_param_group()
        if group_class is None:
            yield
            return
        original = vars(group_class)["post_backward"]
        meter = self

        def post_backward(group: Any, *args: Any, **kwargs: Any) -> Any:
            held = [(fp, grad) for fp in group.fsdp_params if (grad := _unsharded_grad(fp)) is not None]
            if not held or not getattr(group, "reduce_grads", True):  # gradient sync off: this backward reduces nothing
                return original(group, *args, **kwargs)
            local = torch.cat([grad.detach().float().reshape(-1) for _, grad in held])
            before = [_shard_grad(fp) for fp, _ in held]
            before = [b.detach().float().clone() if b is not None else None for b in before]
            reference, tops = meter._fp32_mean(local, [grad.numel() for _, grad in held])
            result = original(group, *args, **kwargs)
            event = getattr(group, "_post_reduce_event", None)  # on a GPU the shard is written on its own stream
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
            meter._read_shards(held, before, reference, local, tops)
            return result

        group_class.post_backward = post_backward
        try:
            yield
        finally:
            group_class.post_backward = original

    # --- measuring --------------------------------------------------------------------------------------------
    def _fp32_mean(self, local: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The local gradients' mean over the ranks in fp32, and per parameter the largest finite |local gradient|."""
        reference = local.float().clone()
        dist.all_reduce(reference, group=self._group)
        reference /= dist.get_world_size()
        magnitudes = torch.nan_to_num(local.float().abs(), nan=0.0, posinf=0.0)
        tops = torch.stack([part.max() if part.numel() else part.new_zeros(()) for part in magnitudes.split(sizes)])
        dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=self._group)
        return reference, tops

    def _read_shards(
        self,
        held: list[tuple[Any, torch.Tensor]],
        before: list[torch.Tensor | None],
        reference: torch.Tensor,
        local: torch.Tensor,
        tops: torch.Tensor,
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = [grad.numel() for _, grad in held]
        for (fp, grad), earlier, want_full, local_full, top in zip(
            held, before, reference.split(sizes), local.split(sizes), tops.tolist()
        ):
            shard = _shard_grad(fp)
            if shard is None:
                continue
            chunks = torch.chunk(want_full.view(grad.shape), world, dim=0)
            want = chunks[rank] if rank < len(chunks) else want_full.new_zeros((0, *grad.shape[1:]))
            got = shard.float() - earlier if earlier is not None else shard.float()
            name = str(getattr(fp, "_param_fqn", None) or "?")
            self._read(name, got, want.reshape(-1), local_full, top, grad.numel())
            if self.repair:
                with torch.no_grad():
                    shard.copy_((want.reshape(shard.shape) + (earlier if earlier is not None else 0)).to(shard.dtype))

    def _name(self, param: torch.Tensor) -> str:
        return self.names.get(id(param), f"parameter {len(self.names)}")

    def _read(
        self, name: str, got: torch.Tensor, want: torch.Tensor, local: torch.Tensor, top: float, numel: int
    ) -> None:
        """One parameter's reduced gradient (``got``: the whole, or this rank's shard) against the fp32 mean
        (``want``, the same part); ``local``: the rank's whole local gradient; ``numel``: the parameter's."""
        reading = self._readings.setdefault((self.step, name), _Reading(numel=numel))
        reading.local_max = max(reading.local_max, top)
        if not bool(torch.isfinite(local).all()):
            reading.local_nonfinite = 1.0
            return
        got, want = got.reshape(-1).float(), want.reshape(-1).float()
        if not bool(torch.isfinite(got).all()):
            reading.nonfinite = 1.0
            return
        reading.diff_sq += float(((got - want) ** 2).sum())
        reading.ref_sq += float((want**2).sum())

    # --- reading ----------------------------------------------------------------------------------------------
    def table(self) -> pd.DataFrame:
        """One row per parameter, over every rank and measured step (a collective: every rank calls it): name,
        numel, relative_error (the worst step's; inf where the reduction made an inf or NaN from finite local
        gradients), nonfinite_steps, local_max, first_nonfinite_step."""
        keys = sorted(self._readings)
        if not keys:
            return pd.DataFrame(columns=COLUMNS)
        readings = [self._readings[k] for k in keys]
        sums = torch.tensor([[r.diff_sq, r.ref_sq] for r in readings], dtype=torch.float64)
        flags = torch.tensor(
            [[r.nonfinite, r.local_nonfinite, r.local_max, float(r.numel)] for r in readings], dtype=torch.float64
        )
        dist.all_reduce(sums, group=self._group)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        rows: dict[str, dict[str, Any]] = {}
        for (step, name), (diff_sq, ref_sq), (bad, local_bad, top, numel) in zip(keys, sums.tolist(), flags.tolist()):
            row = rows.setdefault(name, _empty_row(name))
            row["numel"] = max(row["numel"], int(numel))
            row["local_max"] = max(row["local_max"], top)
            if local_bad:
                continue
            if bad:
                row["nonfinite_steps"] += 1
                row["relative_error"] = float("inf")
                if row["first_nonfinite_step"] is None:  # the keys are sorted by step: the first seen is the first
                    row["first_nonfinite_step"] = step
                continue
            error = (diff_sq / ref_sq) ** 0.5 if ref_sq > 0 else float(diff_sq > 0)
            row["relative_error"] = max(row["relative_error"], error)
        return pd.DataFrame(list(rows.values()), columns=COLUMNS)


def _empty_row(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "numel": 0,
        "relative_error": 0.0,
        "nonfinite_steps": 0,
        "local_max": 0.0,
        "first_nonfinite_step": None,
    }


def _fsdp2_param_group() -> Any:
    """FSDP2's ``FSDPParamGroup``, whose ``post_backward`` reduce-scatters a group's gradients, where importable."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # pragma: no cover - another torch
        return None
    return FSDPParamGroup if "post_backward" in vars(FSDPParamGroup) else None


def _unsharded_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The rank's own unsharded gradient FSDP2 is about to reduce-scatter (accumulated in ``reduce_dtype`` where
    it accumulates micro-batches in it)."""
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated
    if not hasattr(fsdp_param, "_unsharded_param"):
        return None
    grad = fsdp_param.unsharded_param.grad
    return grad if isinstance(grad, torch.Tensor) else None


def _shard_grad(fsdp_param: Any) -> torch.Tensor | None:
    """This rank's shard of the reduced gradient (the local tensor of the sharded parameter's DTensor gradient)."""
    grad = getattr(fsdp_param.sharded_param, "grad", None)
    if grad is None:
        return None
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad
