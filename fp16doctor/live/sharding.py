"""How a model trained on several ranks is wrapped, as far as the watch needs to know it.

Three wrappers are recognised: ``DistributedDataParallel`` (every rank holds the whole model; gradients are
all-reduced, in half precision under a compression hook), FSDP1's ``FullyShardedDataParallel`` (flat parameters
sharded across the ranks, gradients reduce-scattered in its ``MixedPrecision.reduce_dtype``) and FSDP2's
``fully_shard`` (each parameter a ``DTensor`` holding this rank's shard, gradients reduce-scattered in its
``MixedPrecisionPolicy.reduce_dtype``). A sharded gradient is measured on this rank's own part
(:func:`local_part`): a ``DTensor`` refuses to be read as a whole, and summing it would be a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..engine.ddp import half_precision_comm_hooks
from ..tensors import dtype_name
from ..userfile.modules import fsdp2_param_groups

HALF = (torch.float16, torch.bfloat16)
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
"""The names wrappers add to a module's or parameter's path (FSDP1, activation checkpointing, ``torch.compile``),
which ``torch.distributed.checkpoint`` leaves out of its keys too."""


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own values of ``tensor``: a ``DTensor``'s local shard, any other tensor itself."""
    if type(tensor) is torch.Tensor:  # the common case, without a failed attribute lookup (an exception each)
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


@dataclass(frozen=True)
class Topology:
    """How the model's gradients travel between the ranks."""

    wrapper: str | None
    """``DistributedDataParallel``, ``FullyShardedDataParallel`` (FSDP1) or ``fully_shard`` (FSDP2); None: no
    wrapper the watch knows."""
    world_size: int
    sharded: bool
    """Each rank holds a shard of the parameters and gradients: its numbers are its shard's."""
    half_reduction: str | None
    """What reduces the gradients in half precision (``fp16_compress_hook``, ``reduce_dtype=torch.float16``);
    None: they are reduced in fp32 or wider."""

    @property
    def replicated(self) -> bool:
        """Every rank holds every parameter whole: after a step they must be identical on all ranks."""
        return self.wrapper == "DistributedDataParallel"


def topology(outer: torch.nn.Module, world_size: int) -> Topology:
    """The wrapper of ``outer`` (the outermost module the training runs) and the precision of its reduction."""
    if isinstance(outer, torch.nn.parallel.DistributedDataParallel):
        hooks = half_precision_comm_hooks(outer)
        return Topology("DistributedDataParallel", world_size, False, ", ".join(hooks) or None)
    fsdp2 = fully_shard_groups(outer)
    if fsdp2:
        dtypes = {_fsdp2_reduce_dtype(group) for group in fsdp2}
        return Topology("fully_shard", world_size, True, _half_dtypes(dtypes))
    fsdp1 = fsdp1_modules(outer)
    if fsdp1:
        dtypes = {_fsdp1_reduce_dtype(m) for m in fsdp1}
        return Topology("FullyShardedDataParallel", world_size, True, _half_dtypes(dtypes))
    return Topology(None, world_size, False, None)


def _half_dtypes(dtypes: set[torch.dtype | None]) -> str | None:
    half = sorted(dtype_name(d) for d in dtypes if d in HALF)
    return ", ".join(f"reduce_dtype=torch.{name}" for name in half) or None


def fully_shard_groups(model: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups under ``model`` (one per ``fully_shard`` call that holds parameters)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed
        return []
    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups += fsdp2_param_groups(module._get_fsdp_state())
    return groups


def gradient_sync_on(model: torch.nn.Module) -> bool:
    """Whether the backward of ``model``'s forward now reduces its gradients across the ranks: False inside DDP's
    ``no_sync()``, or after FSDP2's ``set_requires_gradient_sync(False)`` (a training that accumulates micro-batches
    unreduced and reduces the last one only). Read at the forward, where both are set for the backward to come."""
    ddp = getattr(model, "require_backward_grad_sync", None)
    if isinstance(ddp, bool):
        return ddp
    if not callable(getattr(model, "_get_fsdp_state", None)):
        return True  # no fully_shard root: nothing this flag governs (the forward's hot path walks nothing)
    # set_requires_gradient_sync sets every group alike: the first one found says it (the root's, else, for a root
    # holding no parameters of its own, the first submodule's; the walk ends there)
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        groups = fsdp2_param_groups(get_state()) if callable(get_state) else []
        if groups:
            return bool(getattr(groups[0], "reduce_grads", True))
    return True


def _fsdp2_reduce_dtype(group: Any) -> torch.dtype | None:
    """The dtype a group's gradients are reduce-scattered in: ``reduce_dtype``, else the compute dtype."""
    policy = group.mp_policy
    params = getattr(group, "fsdp_params", [])
    original = params[0].sharded_param.dtype if params else None
    return policy.reduce_dtype or policy.param_dtype or original


def fsdp1_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP1's ``FullyShardedDataParallel`` units under ``model``."""
    return [m for m in model.modules() if is_fsdp1_unit(m)]


def is_fsdp1_unit(module: torch.nn.Module) -> bool:
    """``module`` is one of FSDP1's ``FullyShardedDataParallel`` units."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed
        return False
    return isinstance(module, FullyShardedDataParallel)


def _fsdp1_reduce_dtype(unit: Any) -> torch.dtype | None:
    policy = getattr(unit, "mixed_precision", None)
    if policy is None:
        return None
    return policy.reduce_dtype or policy.param_dtype


def clean_name(name: str) -> str:
    """A module or parameter path without the wrappers' own attribute names (``_fsdp_wrapped_module``): as the
    user's model names it, and as ``torch.distributed.checkpoint`` keys it. Whole segments only (a user's
    ``my_orig_mod`` keeps its name)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def flat_parameters(model: torch.nn.Module) -> dict[int, tuple[Any, list[str]]]:
    """FSDP1's flat parameters under ``model`` (by ``id``), each with the names of the original parameters it
    holds, in its order (``lm_head.weight``: the user's names, not the wrappers')."""
    paths = {m: clean_name(n) for n, m in model.named_modules()}
    found: dict[int, tuple[Any, list[str]]] = {}
    for unit in fsdp1_modules(model):
        flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
        if flat is not None:
            prefix = paths.get(unit, "")
            found[id(flat)] = (flat, [f"{prefix}.{fqn}" if prefix else fqn for fqn in flat._fqns])
    return found


def flat_label(names: list[str]) -> str:
    """How a flat parameter is named where it is measured whole: the original parameters it holds."""
    held = ", ".join(names) if len(names) <= 3 else f"{names[0]}, {names[1]}, ..., {names[-1]}"
    return f"flat parameter ({held})"


def first_nonfinite_part(flat: Any, grad: torch.Tensor) -> int | None:
    """Which of a flat parameter's original parameters first holds a non-finite value in this rank's shard of
    ``grad`` (a synchronisation: asked only on trouble)."""
    values = grad.detach().reshape(-1)
    for index, info in enumerate(flat._shard_param_infos):
        if info.in_shard and info.numel_in_shard:
            part = values[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            if not bool(torch.isfinite(part).all()):
                return index
    return None
