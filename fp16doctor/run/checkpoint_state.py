"""The model's and its optimizers' state a checkpoint holds: whole, however the ranks hold it.

Under DDP, or in one process, every rank holds the whole model, and ``state_dict()`` is all of it. Under FSDP (FSDP1's
``FullyShardedDataParallel`` units, FSDP2's ``fully_shard``) each rank holds a shard: FSDP2's ``state_dict()`` is
that rank's DTensor shards and its optimizer state that shard's, so a checkpoint of rank 0's state dicts, loaded on
every rank, gives rank 1 rank 0's shard. There the state is gathered whole with ``torch.distributed.checkpoint``'s
state-dict API (a collective every rank makes), keyed by the user's parameter names, and loaded back the same way,
each rank keeping its own shard of it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.optimizers import ProbeOptimizers
from ..tensors import whole_state_options
from ..userfile.modules import compile_wrapper_inner


def shards_parameters(model: torch.nn.Module) -> bool:
    """FSDP1 or FSDP2 holds ``model``'s parameters: each rank has its own shard of them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules()) or any(
        hasattr(p, "placements")
        for p in model.parameters()  # FSDP2: each parameter a DTensor
    )


def whole_state(
    built: torch.nn.Module, run: torch.nn.Module, optimizers: ProbeOptimizers
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the model's state dict, every optimizer's by name), whole. ``built``: the model as ``model()`` built it;
    ``run``: the module the training runs (the ranks' wrapper). On sharded ranks a collective: every rank calls it,
    and every rank gets the whole state."""
    if not shards_parameters(run):
        return built.state_dict(), optimizers.state(copy_state=False)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, options = _dcp_model(run), whole_state_options(run)
    device = next(run.parameters()).device
    states = {
        name: get_optimizer_state_dict(model, opt, options=options)
        if _stepped_anywhere(opt, device)
        else opt.state_dict()
        for name, opt in optimizers.by_name.items()
    }
    return get_model_state_dict(model, options=options), states


def load_whole_state(
    built: torch.nn.Module,
    run: torch.nn.Module,
    optimizers: ProbeOptimizers,
    model_state: dict[str, Any],
    optimizer_states: dict[str, dict[str, Any]],
) -> None:
    """Put back what :func:`whole_state` took (on sharded ranks, each rank keeps its shard: a collective)."""
    if not shards_parameters(run):
        built.load_state_dict(model_state)
        optimizers.load(optimizer_states, owned=True)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, options = _dcp_model(run), whole_state_options(run)
    set_model_state_dict(model, model_state, options=options)
    for name, opt in optimizers.by_name.items():
        saved = optimizer_states[name]
        if saved["state"]:
            set_optimizer_state_dict(model, opt, saved, options=options)
        else:  # saved before any step: its settings only, as the uninterrupted run has it (see _stepped_anywhere)
            opt.load_state_dict(saved)


def _dcp_model(run: torch.nn.Module) -> torch.nn.Module:
    """The module the state-dict API reads: the ranks' wrapper, inside a ``torch.compile`` wrapper if any."""
    return compile_wrapper_inner(run) or run


def _stepped_anywhere(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether the optimizer has state on some rank (the ranks agree: a collective). One that has none yet (every
    step so far skipped) is saved as its own ``state_dict()``: the state-dict API would first make one, by a step at
    learning rate 0 on zero gradients, and that step would change the training (Adam's step count, its moments)."""
    flag = torch.tensor([1.0 if optimizer.state else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)
