"""Tensor helpers every layer may use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported when called: torch.distributed.checkpoint is slow to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions

OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
"""Running out of memory, on the device or the host: the diagnosis's own limit, never evidence about the
training (a probe re-raises it instead of recording it as the user's exception)."""


FP16_MAX = 65504.0
"""The largest finite fp16 value (fp16's format: 5 exponent bits, 10 mantissa bits)."""
FP16_MIN_SUBNORMAL = 2.0**-24
"""fp16's smallest subnormal: non-zero values below it flush to zero."""
FP16_MIN_NORMAL = 2.0**-14
"""fp16's smallest normal: below it values lose precision."""


def grad_values(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a dense tensor of its values: a sparse gradient (``nn.Embedding(sparse=True)``)
    gives its coalesced values, which hold its every non-zero entry (norms, extremes and shares stay exact)."""
    g = p.grad
    if g is None:
        return None
    g = g.detach()
    return g.coalesce().values() if g.is_sparse else g


def norms(tensors: list[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """Each tensor's norm in one fused pass, accumulated in fp32 (a half tensor's own norm can pass 65504), or
    in fp64 when a tensor is fp64 (``_foreach_norm`` refuses to narrow)."""
    if not tensors:
        return []
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return list(torch._foreach_norm(tensors, ord, dtype=wide))


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``"float16"`` for ``torch.float16`` (cached: every hook call names its dtype)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter whole: a sharded DTensor gathered (a collective every rank makes in the same order)."""
    full_tensor = getattr(param, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else param


def parameter_sums(parameters: Iterable[torch.Tensor]) -> dict[str, float]:
    """The sum and the absolute sum of every parameter's elements, a sharded one whole (in fp64): what ranks that
    hold the same weights agree on."""
    values = torch.cat([whole(p).detach().double().reshape(-1).cpu() for p in parameters])
    return {"param_sum": float(values.sum()), "param_abs_sum": float(values.abs().sum())}


def whole_state_options(model: torch.nn.Module) -> StateDictOptions:
    """``torch.distributed.checkpoint``'s options for a sharded model's whole state: gathered onto rank 0's CPU from a
    device (the other ranks get none), where each rank would otherwise hold all of it beside its shard. Not from the
    CPU: FSDP1 with its parameters there frees the storage the offload copies from (measured with the pinned torch:
    "setStorage ... out of bounds for storage of size 0")."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    on_device = any(p.device.type != "cpu" for p in model.parameters())
    return StateDictOptions(full_state_dict=True, cpu_offload=on_device)
