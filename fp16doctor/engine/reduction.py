"""DistributedDataParallel's gradient reduction, measured against the same reduction in fp32.

DDP hands each bucket of local gradients to its communication hook: the default averages them in their dtype
(fp32 master gradients), a compression hook (``fp16_compress_hook``, ``bf16_compress_hook``, PowerSGD) casts them
first and sums them in that dtype. The doctor puts a measuring hook around whichever hook the training registers
(or the default): each bucket's local gradients are averaged once more in fp32 on a group of their own, and the
hook's result is compared with that reference, parameter by parameter. With ``repair``, the reference is what DDP
gets back: the same training with its reduction made in fp32, the fix tried on the same weights and batches.

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


@dataclass
class ParameterReduction:
    """One parameter's reduction over the measured steps: its worst step."""

    name: str
    numel: int
    relative_error: float = 0.0
    """The largest ‖reduced − fp32 reduced‖ / ‖fp32 reduced‖ over the steps (inf: the reduction made an inf or NaN)."""
    nonfinite_steps: int = 0
    """Steps where the reduced gradient held an inf or a NaN while the local gradients and their fp32 mean did not."""
    local_max: float = 0.0
    """The largest |local gradient| any rank handed to the reduction (scaled, as reduced)."""
    first_nonfinite_step: int | None = None


@dataclass
class ReductionMeter:
    """A measuring hook around a DDP model's communication hook (the training's own, or DDP's default)."""

    names: dict[int, str]
    """Parameter name by ``id`` (the names of the model the user wrote, without DDP's ``module.`` prefix)."""
    repair: bool = False
    """Hand DDP the fp32 mean instead of the hook's result: the training with its reduction in fp32."""
    hook_names: list[str] = field(default_factory=list)
    """The communication hooks the training registered (empty: DDP's default, an all-reduce in the gradients' dtype)."""
    step: int = 0
    """The optimizer step now reducing (the caller advances it)."""
    _group: Any = None
    _params: dict[str, ParameterReduction] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._group = dist.new_group(backend="gloo")  # a group of its own: the reference never queues behind DDP's

    @contextlib.contextmanager
    def around_registration(self) -> Iterator[None]:
        """While the block runs (the training file's ``parallelize()`` and steps), a hook DDP is given is wrapped."""
        original = torch.nn.parallel.DistributedDataParallel.register_comm_hook
        meter = self

        def register(ddp: torch.nn.parallel.DistributedDataParallel, state: Any, hook: Hook) -> None:
            meter.hook_names.append(getattr(hook, "__name__", type(hook).__name__))
            ddp._fp16doctor_measured = True  # type: ignore[assignment]
            original(ddp, state, meter.wrap(hook))

        torch.nn.parallel.DistributedDataParallel.register_comm_hook = register  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.nn.parallel.DistributedDataParallel.register_comm_hook = original  # type: ignore[method-assign]

    def attach(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Measure DDP's default reduction where the training registered no hook of its own."""
        if not getattr(ddp, "_fp16doctor_measured", False):
            torch.nn.parallel.DistributedDataParallel.register_comm_hook(
                ddp, None, self.wrap(default_hooks.allreduce_hook)
            )

    def wrap(self, hook: Hook) -> Hook:
        def measured(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations, as objects
            local = bucket.buffer().detach().clone()  # before the hook: the default divides the buffer in place
            reference = local.float()
            dist.all_reduce(reference, group=self._group)
            reference /= dist.get_world_size()
            params = list(bucket.parameters())
            local_max = _largest_per_parameter(local, [p.numel() for p in params], self._group)

            def compare(fut: torch.futures.Future[Any]) -> torch.Tensor:
                value = fut.value()
                reduced = value[0] if isinstance(value, list) else value
                self._record(params, reduced, reference, local_max)
                return reference.to(reduced.dtype) if self.repair else reduced

            return hook(state, bucket).then(compare)

        measured.__name__ = getattr(hook, "__name__", "hook")
        return measured

    def _record(
        self, params: list[torch.Tensor], reduced: torch.Tensor, reference: torch.Tensor, local_max: torch.Tensor
    ) -> None:
        offset = 0
        for param, top in zip(params, local_max.tolist()):
            n = param.numel()
            got, want = reduced[offset : offset + n].float(), reference[offset : offset + n]
            offset += n
            name = self.names.get(id(param), f"parameter {len(self._params)}")
            entry = self._params.setdefault(name, ParameterReduction(name, n))
            entry.local_max = max(entry.local_max, top)
            if not torch.isfinite(want).all():
                continue  # a local inf or NaN: the rank's own gradient, not the reduction's doing
            if not torch.isfinite(got).all():
                entry.nonfinite_steps += 1
                entry.relative_error = float("inf")
                if entry.first_nonfinite_step is None:
                    entry.first_nonfinite_step = self.step
                continue
            norm = float(want.norm())
            error = float((got - want).norm()) / norm if norm > 0 else float((got - want).norm() > 0)
            entry.relative_error = max(entry.relative_error, error)

    def table(self) -> pd.DataFrame:
        """One row per parameter: name, numel, relative_error, nonfinite_steps, first_nonfinite_step, local_max."""
        rows = [vars(p) for p in self._params.values()]
        columns = ["name", "numel", "relative_error", "nonfinite_steps", "local_max", "first_nonfinite_step"]
        return pd.DataFrame(rows, columns=columns)


def _largest_per_parameter(local: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """Per parameter of the bucket, the largest finite |local gradient| over every rank."""
    magnitudes = torch.nan_to_num(local.float().abs(), nan=0.0, posinf=0.0)
    tops = torch.stack([part.max() if part.numel() else part.new_zeros(()) for part in magnitudes.split(sizes)])
    dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=group)
    return tops
