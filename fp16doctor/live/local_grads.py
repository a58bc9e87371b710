"""Each rank's own gradients, checked before the ranks reduce them.

After the reduction every rank holds the reduced gradient (or its shard of it): an inf that one rank's batch made is
on every rank, and a reduction that overflowed looks the same. Seen before it, a non-finite gradient is this rank's
own, with the micro-batch and the first parameter the backward gave it to. Where it is seen:

* DDP: a post-accumulate-grad hook on each parameter holds its gradient, and one callback at the end of the
  backward, queued before DDP's own (which copies the reduced buckets back into the gradients), measures them all in
  one fused pass. With ``gradient_as_bucket_view`` a gradient is the bucket the reduction writes into, so it is
  measured in its hook, which runs before DDP's (a tensor's post-accumulate hooks run inside its ``AccumulateGrad``,
  DDP's after it);
* FSDP1: a post-accumulate-grad hook on each ``FlatParameter`` sees its unsharded gradient before FSDP's own
  post-backward hook on the same ``AccumulateGrad`` reduce-scatters it;
* FSDP2: ``FSDPParamGroup.post_backward``, which reduce-scatters a group's unsharded gradients, measures them first.

Each gradient's sum, accumulated in fp32 or wider (inf or NaN where the gradient holds an inf or a NaN; the cheapest
reduction there is: with torch 2.13 on a CPU a max-norm of fp16 gradients costs a hundred times more), stays on the device; the step's check reads how
many are non-finite in its one transfer, and where only when some are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .sharding import flat_parameters


@dataclass
class LocalCheck:
    """One backward's measurement of some of the rank's own gradients."""

    micro_batch: int
    indices: list[int]
    """Which of :attr:`LocalGradients.names`, in the order the backward reached them."""
    sums: torch.Tensor
    """Their sums (a 1-d float32 device tensor): non-finite exactly where a gradient holds an inf or a NaN, bar a
    sum of finite values past fp32's range (3.4e38)."""


class LocalGradients:
    """The rank's own gradients of the current optimizer step, before each reduction."""

    def __init__(self, failed: Callable[[str, BaseException], None]):
        self.failed = failed
        """Told of a failure inside a measurement: the watch's, reported once, never the training's."""
        self.names: list[str] = []
        """Every measured parameter, in the order first measured (the same on every rank for the same model)."""
        self.micro_batch = 0
        """The backward now running, counted from 0 in each optimizer step."""
        self.on = True
        self._index: dict[str, int] = {}
        self._checks: list[LocalCheck] = []
        self._pending: list[tuple[int, torch.Tensor]] = []
        self._queued = False
        self._handles: list[Any] = []
        self._watched: set[int] = set()

    # --- installing -----------------------------------------------------------------------------------
    def watch(self, outer: torch.nn.Module) -> None:
        """Hook the gradients of a DDP or FSDP1 model (FSDP2's are measured by :meth:`group_backward`)."""
        if id(outer) in self._watched:
            return
        self._watched.add(id(outer))
        if isinstance(outer, torch.nn.parallel.DistributedDataParallel):
            in_bucket = bool(getattr(outer, "gradient_as_bucket_view", False))
            for name, param in outer.module.named_parameters():
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._ddp_hook(name, in_bucket)))
            return
        for flat, names in flat_parameters(outer).values():
            if flat.requires_grad:
                self._handles.append(flat.register_post_accumulate_grad_hook(self._flat_hook(flat, names)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._watched = [], set()

    def _slot(self, name: str) -> int:
        index = self._index.get(name)
        if index is None:
            index = self._index[name] = len(self.names)
            self.names.append(name)
        return index

    # --- measuring ---------------------------------------------------------------------------------------
    def _ddp_hook(self, name: str, in_bucket: bool) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.on or param.grad is None:
                return
            try:
                index = self._slot(name)
                if in_bucket:
                    self._record([index], [param.grad])
                    return
                self._pending.append((index, param.grad))
                if not self._queued:
                    self._queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            except Exception as exc:  # noqa: BLE001 - the watch's own failure
                self._fail(exc)

        return hook

    def _flush(self) -> None:
        """The end of the backward, before DDP copies the reduced gradients back: measure the held ones."""
        pending, self._pending, self._queued = self._pending, [], False
        try:
            if pending and self.on:
                self._record([i for i, _ in pending], [g for _, g in pending])
        except Exception as exc:  # noqa: BLE001 - the watch's own failure
            self._fail(exc)

    def _flat_hook(self, flat: Any, names: list[str]) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.on or param.grad is None:
                return
            try:
                sizes = list(flat._numels_with_padding)
                pieces = param.grad.reshape(-1)[: sum(sizes)].split(sizes)
                real = [p for p, padding in zip(pieces, flat._is_padding_mask) if not padding]
                self._record([self._slot(n) for n in names], real)
            except Exception as exc:  # noqa: BLE001 - the watch's own failure
                self._fail(exc)

        return hook

    def group_backward(self, group: Any) -> None:
        """FSDP2 is about to reduce-scatter this parameter group's unsharded gradients: measure them first."""
        if not self.on:
            return
        try:
            held = [
                (fp._param_fqn or "?", fp.unsharded_param.grad)
                for fp in group.fsdp_params
                if hasattr(fp, "_unsharded_param") and fp.unsharded_param.grad is not None
            ]
            if held:
                self._record([self._slot(n) for n, _ in held], [g for _, g in held])
        except Exception as exc:  # noqa: BLE001 - the watch's own failure
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.on = False
        self.failed("check of the rank's own gradients", exc)

    def _record(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        sums = torch.stack([_sum(g) for g in grads])
        self._checks.append(LocalCheck(self.micro_batch, indices, sums))

    # --- reading -----------------------------------------------------------------------------------------
    def nonfinite_count(self) -> torch.Tensor | None:
        """How many of this step's own gradients were non-finite (a 0-d device tensor, no synchronisation); None
        where none was measured."""
        if not self._checks:
            return None
        return torch.stack([(~torch.isfinite(c.sums)).sum() for c in self._checks]).sum()

    def first_nonfinite(self, order: dict[str, int]) -> tuple[int, int] | None:
        """(micro-batch, index into :attr:`names`) of the first non-finite own gradient of this step: in its first
        micro-batch that had one, the parameter the backward reached first, i.e. the latest in the model's order
        (``order``: position by name; a name not in it counts as measured). A synchronisation: asked only once the
        count is non-zero."""
        bad = [
            (check.micro_batch, index)
            for check in self._checks
            for index, flag in zip(check.indices, (~torch.isfinite(check.sums)).tolist())
            if flag
        ]
        if not bad:
            return None
        first_batch = min(mb for mb, _ in bad)
        candidates = [(mb, index) for mb, index in bad if mb == first_batch]
        ranked = [c for c in candidates if self.names[c[1]] in order]
        if not ranked:
            return candidates[0]
        return max(ranked, key=lambda c: order[self.names[c[1]]])

    def next_step(self) -> None:
        """The optimizer step was checked: forget its measurements."""
        self._checks, self._pending, self._queued = [], [], False
        self.micro_batch = 0


def _sum(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's sum in fp32 (a half gradient's own sum would overflow fp16)."""
    wide = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return grad.detach().sum(dtype=wide).float()
