"""Capsules of sharded runs: the alarming step of an FSDP training, captured by every rank together.

No rank holds the whole state of a ``fully_shard``-ed model (FSDP2) or of a ``FullyShardedDataParallel`` one
(FSDP1), so no rank can write its capsule alone. The ranks
meet in ``GradScaler.update()`` every step (:mod:`.ranks`); where one of them raised an alarm, they write it there,
together:

* the whole model and optimizer state, gathered to rank 0 on the CPU with ``torch.distributed.checkpoint``'s
  state-dict API (``full_state_dict=True``, offloaded to the CPU from a GPU); or, where it is larger whole than the
  watch's ``gather_limit_mb``, each rank's own shards saved with ``torch.distributed.checkpoint`` into the capsule,
  which its replay reads whole (the module itself pickled on the meta device);
* every rank's micro-batches of the step and the gradients that reached its outputs (a ``gather_object`` to rank 0);
* the world size and the policy (``param_dtype``, ``reduce_dtype``), as the capsule's ``sharding`` config, which
  ``diagnose --capsule`` replays with the ranks emulated in one process (:mod:`fp16doctor.engine.emulated_ranks`).

Only a step that every rank skipped starts from the state the ranks hold in ``update()`` (the optimizer did not
move it): a step that was applied has left no copy of its starting state, and gets no capsule, with that reason.
The model itself is stored as a plain module of the user's classes (FSDP's class swap, hooks and state taken off),
so the capsule rebuilds in a process with no process group.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..tensors import whole_state_options
from .capsule import SHARDS, cpu_copy, drop_foreign_hooks
from .sharding import clean_name, is_fsdp1_unit

FSDP_ATTRIBUTES = ("_fsdp", "_is_fsdp", "__composable_api_state_key")
"""The attributes ``fully_shard`` sets on a module (its state, its marks), left out of the plain copy."""


@dataclass(frozen=True)
class RankStep:
    """What one rank holds of the alarming step, on the host: its micro-batches (with ``replay_index`` numbering
    its own output gradients) and those gradients (None where the watch saw none)."""

    batches: list[Any]
    output_grads: list[list[torch.Tensor | None]] | None
    loss: float | None = None
    """The loss this rank's step optimised (its own micro-batches'), as its watch measured it."""


def ranks_loss(steps: list[RankStep]) -> float | None:
    """The step's loss over the ranks, as the capsule records it: the first rank's non-finite loss where one is
    (a NaN on rank 1 is the run's NaN, whatever rank 0 saw), else the ranks' mean (the global batch's loss)."""
    losses = [s.loss for s in steps if s.loss is not None]
    if not losses:
        return None
    bad = next((loss for loss in losses if not math.isfinite(loss)), None)
    return bad if bad is not None else sum(losses) / len(losses)


def ddp_hook_dtype(hooks: list[str]) -> str | None:
    """The dtype a DDP compression hook reduces in, by its name (``fp16_compress_hook``: float16), or None."""
    for hook in hooks:
        if "bf16" in hook:
            return "bfloat16"
        if "fp16" in hook:
            return "float16"
    return None


def policy_dtypes(model: torch.nn.Module) -> dict[str, Any]:
    """The root ``fully_shard`` state's (or FSDP1 root unit's) ``param_dtype`` and ``reduce_dtype``, by name (None:
    not set), and whether the model's floating inputs are cast to ``param_dtype``: FSDP2's ``cast_forward_inputs``,
    FSDP1's ``cast_root_forward_inputs`` (true by default) for its root."""
    from ..engine.parallel import policy_of  # the diagnosis's engine: loaded only when a capsule is written

    policy = policy_of(model) or {}
    root_cast = getattr(getattr(model, "mixed_precision", None), "cast_root_forward_inputs", False)
    return {
        "param_dtype": policy.get("param_dtype"),
        "reduce_dtype": policy.get("reduce_dtype"),
        "output_dtype": _dtype_name(policy.get("output_dtype")),
        "cast_forward_inputs": bool(policy.get("cast_forward_inputs", True)) or bool(root_cast),
        "module_policies": module_policies(model),
    }


def module_policies(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """FSDP2's submodules whose own ``fully_shard`` policy differs from the root's as it takes effect, by path:
    what the replay applies to each (:class:`~fp16doctor.engine.emulated_ranks.OwnPolicy`)."""
    from ..engine.parallel import policy_of

    root = _in_effect(policy_of(model) or {})
    found = {}
    for name, module in model.named_modules():
        if module is model or not callable(getattr(module, "_get_fsdp_state", None)):
            continue
        own = _in_effect(policy_of(module) or {})
        if own != root:
            found[clean_name(name)] = own
    return found


def _dtype_name(value: Any) -> str | None:
    return None if value in (None, "None") else str(value)


def not_emulated(model: torch.nn.Module) -> list[str]:
    """What the run's policies did that the replay leaves out: FSDP1's units with a policy of their own that
    differs from the root's as it takes effect (grouped by policy; FSDP2's own policies are replayed, see
    :func:`module_policies`), and FSDP1's ``buffer_dtype`` where the model has floating-point buffers (the replay
    keeps them in their own dtype)."""
    from ..engine.parallel import policy_of

    root_policy = policy_of(model) or {}
    root = _in_effect(root_policy)
    differing: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if module is model or not is_fsdp1_unit(module):
            continue
        own = _in_effect(policy_of(module) or {})
        fields = ", ".join(f"{k} {v}" for k, v in own.items() if v != root.get(k))
        if fields:
            differing.setdefault(fields, []).append(f"'{clean_name(name)}'")
    said = [
        f"FSDP1 {'unit' if len(names) == 1 else 'units'} {', '.join(names)} had a policy of their own ({fields}); "
        "the replay applies the root's"
        for fields, names in differing.items()
    ]
    floating_buffers = any(b.is_floating_point() for b in model.buffers())
    buffer_dtype = root_policy.get("buffer_dtype")
    if is_fsdp1_unit(model) and buffer_dtype not in (None, "None") and floating_buffers:
        said.append(f"FSDP1's buffer_dtype {buffer_dtype} (the replay keeps buffers in their own dtype)")
    return said


def _in_effect(policy: dict[str, Any]) -> dict[str, Any]:
    """A policy's fields that change the computation, as they take effect (no ``reduce_dtype`` is ``param_dtype``;
    no ``param_dtype``, the parameters' own dtype, stays None)."""
    param = policy.get("param_dtype")
    return {
        "param_dtype": param,
        "reduce_dtype": policy.get("reduce_dtype") or param,
        "output_dtype": _dtype_name(policy.get("output_dtype")),
        "cast_forward_inputs": bool(policy.get("cast_forward_inputs", True)),
    }


def applied_on(skipped: list[bool]) -> str | None:
    """Why the ranks cannot capture a step some of them applied, or None where every rank skipped it."""
    applied = [r for r, was_skipped in enumerate(skipped) if not was_skipped]
    if not applied:
        return None
    return (
        f"the step was applied on rank(s) {', '.join(map(str, applied))}: the state it started from is gone (a "
        "sharded capsule is written for a step every rank skipped)"
    )


def uneven(micro_batches: list[int]) -> str | None:
    """Why the ranks' batches cannot be replayed rank by rank, or None."""
    if len(set(micro_batches)) == 1 and micro_batches[0]:
        return None
    return f"the ranks' micro-batches of the step do not pair up ({micro_batches} seen per rank)"


def gathered_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model and optimizer state on rank 0's CPU (empty on the other ranks): a collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = whole_state_options(model)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    return dict(model_state), dict(optimizer_state)


_OBJECT_GROUPS: dict[Any, Any] = {}
"""Per default process group, the gloo group the capsule's object collectives use where the default is not gloo."""


@dataclass(frozen=True)
class ShardedState:
    """The model's and optimizer's state as the ranks hold it, each its own shards."""

    model: dict[str, Any]
    optimizer: dict[str, Any]


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ShardedState:
    """Each rank's shards of the state (``torch.distributed.checkpoint``'s state-dict API, unsharded only where the
    rank holds a tensor whole). A collective under FSDP1."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)
    return ShardedState(
        get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)
    )


def save_shards(state: ShardedState, folder: Path) -> None:
    """Every rank writes its own shards into ``folder`` (a collective: the folder is the same on every rank; its
    object collectives on a gloo group, see :func:`object_group`)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state.model, "optimizer": state.optimizer}, checkpoint_id=folder, process_group=object_group())


def shards_complete(folder: Path) -> str | None:
    """Why the ranks' shards in ``folder`` are not all there, or None: a capsule folder the ranks do not share (a
    relative one from different working folders, nodes without a shared filesystem) gets each rank's shards in its
    own, and the replay would find only rank 0's."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - no metadata: nothing readable
        return f"its shards are unreadable ({type(exc).__name__})"
    missing = sorted({info.relative_path for info in storage.values() if not (folder / info.relative_path).is_file()})
    if missing:
        return (
            f"the ranks' shards of the state are not in one folder ({', '.join(missing[:3])} missing beside rank 0's): "
            "give --capsule-dir a folder every rank writes to"
        )
    return None


def shard_keys(module: torch.nn.Module) -> dict[str, str]:
    """Each key of the plain module's state, and its key in the shards: the plain module keeps an activation
    checkpointing wrapper, whose segment the shards' keys leave out."""
    return {key: clean_name(key) for key in module.state_dict()}


def whole_from_shards(folder: Path, state_keys: dict[str, str], parameter_keys: list[str]) -> dict[str, Any]:
    """The whole state of a capsule saved in shards, read in one process without a process group: ``model`` keyed as
    the capsule's plain module loads it (``state_keys``: each of its keys' key in the shards), ``optimizer`` as its
    optimizer loads it (``parameter_keys``: the model's parameters' keys in the shards, in its order)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    missing = shards_complete(folder / SHARDS)
    if missing is not None:
        raise FileNotFoundError(f"this capsule's state cannot be read whole: {missing}")
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(folder / SHARDS, Path(scratch) / "whole.pt")
        whole = torch.load(Path(scratch) / "whole.pt", weights_only=True)
    model = {key: whole["model"][saved] for key, saved in state_keys.items()}
    return {"model": model, "optimizer": indexed_optimizer_state(whole["optimizer"], parameter_keys)}


def load_whole(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give ``module`` (its parameters on the meta device) copies of ``state``: one copy per tensor it holds, so
    that a parameter two modules share (tied weights) stays one, with its ``requires_grad``."""
    made: dict[int, torch.Tensor] = {}
    copies = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in made:
            copy = state[key].clone()
            parameter = isinstance(tensor, torch.nn.Parameter)
            made[id(tensor)] = torch.nn.Parameter(copy, tensor.requires_grad) if parameter else copy
        copies[key] = made[id(tensor)]
    module.load_state_dict(copies, assign=True)


def object_group() -> Any:
    """The group to send pickled objects in: the default one under gloo, else a gloo group of the same ranks, made
    once (every rank reaches it together, in the update where they capture). Object collectives on nccl would
    copy every pickle to a GPU and rely on the current device being each rank's own."""
    default = dist.group.WORLD
    if dist.get_backend(default) == "gloo":
        return None
    if default not in _OBJECT_GROUPS:
        _OBJECT_GROUPS[default] = dist.new_group(backend="gloo")
    return _OBJECT_GROUPS[default]


def gather_steps(mine: RankStep) -> list[RankStep] | None:
    """Every rank's :class:`RankStep`, on rank 0 (None on the others): a collective."""
    everyone: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=object_group())
    return everyone


def flattened(steps: list[RankStep]) -> tuple[list[Any], list[list[torch.Tensor | None]] | None]:
    """The ranks' micro-batches rank by rank (rank r's are the r-th run), their ``replay_index`` renumbered into
    the one list of output gradients; the gradients None unless every rank has them."""
    from .capsule import REPLAY_INDEX

    batches: list[Any] = []
    grads: list[list[torch.Tensor | None]] = []
    complete = all(step.output_grads is not None for step in steps)
    for step in steps:
        for index, batch in enumerate(step.batches):
            if complete and isinstance(batch, dict) and REPLAY_INDEX in batch:
                batch = {**batch, REPLAY_INDEX: torch.tensor(len(grads) + index)}
            batches.append(batch)
        if complete and step.output_grads is not None:
            grads += step.output_grads
    return batches, grads if complete else None


def indexed_optimizer_state(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``torch.distributed.checkpoint``'s optimizer state (keyed by parameter name) keyed as ``Optimizer.state_dict``
    keys it, by position in ``names`` (the plain model's parameters, in their order): what the capsule's optimizer
    loads."""
    position = {name: index for index, name in enumerate(names)}
    # each group's parameters in the plain model's order, as the capsule's optimizer takes them: FSDP1 lists them in
    # its flat parameters' order (the root unit's first), and loading pairs saved and current parameters by place
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": sorted(position[n] for n in group["params"])}
        for group in state.get("param_groups", [])
    ]
    moments = {position[name]: value for name, value in state.get("state", {}).items() if name in position}
    return {"state": moments, "param_groups": groups}


def checkpoint_key(model: torch.nn.Module, name: str) -> str:
    """The key ``torch.distributed.checkpoint``'s state dicts give ``model``'s parameter ``name``: its own
    ``_get_fqns`` where this torch has it, else the name without the wrappers' segments."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns

        return next(iter(_get_fqns(model, name)))
    except Exception:  # noqa: BLE001 - a private helper: without it, the segments it is known to drop
        return clean_name(name)


def plain_module(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """A copy of ``model`` as the user's classes build it: each ``fully_shard``-ed module back in its own class,
    each FSDP1 unit replaced by the module it wraps, its parameters the whole ``state`` (plain tensors on the CPU,
    keyed as ``torch.distributed.checkpoint`` keys them; None: on the meta device, with their whole shapes, for a
    state saved in shards), without FSDP's hooks and state and without the watch's own hooks: what ``model.pt``
    pickles."""
    prefix_of = {module: name for name, module in model.named_modules()}
    held = _fsdp1_originals(model)
    copies: dict[int, torch.nn.Module] = {}

    def whole(key: str, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return state[key].clone() if state is not None else torch.empty(shape, dtype=dtype, device="meta")

    made: dict[int, torch.nn.Parameter] = {}

    def parameter(p: torch.Tensor, key: str) -> torch.nn.Parameter:
        """One copy per parameter of the run: a parameter two modules share (tied weights, FSDP2 holding the same
        DTensor in both) stays one, as the optimizer holds it once."""
        if id(p) not in made:
            made[id(p)] = torch.nn.Parameter(whole(key, p.shape, p.dtype), p.requires_grad)
        return made[id(p)]

    def rebuild(module: torch.nn.Module) -> torch.nn.Module:
        module = _unwrapped(module)
        if id(module) in copies:
            return copies[id(module)]
        # made without __init__ (FSDP's class builds the original class anew in __new__), then filled with the
        # module's own attributes
        clone: torch.nn.Module = object.__new__(_user_class(type(module)))
        clone.__dict__.update({k: v for k, v in module.__dict__.items() if not k.startswith(FSDP_ATTRIBUTES)})
        prefix = prefix_of.get(module, "")
        clone._parameters = {
            name: None if p is None else parameter(p, checkpoint_key(model, _join(prefix, name)))
            for name, p in module._parameters.items()
            if not _is_flat(p)
        }
        for name, key, requires_grad, shape, dtype in held.get(id(module), []):
            clone.__dict__.pop(name, None)  # FSDP1's view of the unsharded parameter, not the parameter
            clone._parameters[name] = torch.nn.Parameter(whole(key, shape, dtype), requires_grad)
        clone._buffers = {name: None if b is None else cpu_copy(b) for name, b in module._buffers.items()}
        drop_foreign_hooks(module, clone)
        clone._modules = {name: None if m is None else rebuild(m) for name, m in module._modules.items()}
        copies[id(module)] = clone
        return clone

    plain = rebuild(model)
    _tie_fsdp1_shared(model, copies)
    return plain


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """An FSDP1 unit's wrapped module (the user's), or ``module`` itself."""
    while is_fsdp1_unit(module):
        wrapped = module._fsdp_wrapped_module
        assert isinstance(wrapped, torch.nn.Module)
        module = wrapped
    return module


def _is_flat(parameter: Any) -> bool:
    """FSDP1's flat parameter: the unit's shard of all its modules' parameters, not one of the user's. (A plain
    ``Parameter`` marked as flat; ``FlatParameter``'s metaclass recognises the mark.)"""
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # pragma: no cover - builds without distributed
        return False
    return isinstance(parameter, FlatParameter)


def _fsdp1_originals(model: torch.nn.Module) -> dict[int, list[tuple[str, str, bool, torch.Size, torch.dtype]]]:
    """By ``id`` of each module whose parameters an FSDP1 unit flattened: (name on the module, key in the whole
    state, requires_grad, whole shape, dtype) of each, in the module's order. FSDP1 takes them out of the module's
    ``_parameters``."""
    from .sharding import flat_parameters

    originals: dict[int, list[tuple[str, str, bool, torch.Size, torch.dtype]]] = {}
    for flat, keys in flat_parameters(model).values():
        for info, key, shape in zip(flat._param_infos, keys, flat._shapes):
            originals.setdefault(id(info.module), []).append(
                (info.param_name, key, flat.requires_grad, shape, flat.dtype)
            )
    return originals


def _tie_fsdp1_shared(model: torch.nn.Module, copies: dict[int, torch.nn.Module]) -> None:
    """A parameter an FSDP1 unit holds once for several modules (tied weights) is one parameter in the copy too."""
    from .sharding import flat_parameters

    for flat, _ in flat_parameters(model).values():
        for info in getattr(flat, "_shared_param_infos", ()):
            owner, primary = copies.get(id(info.module)), copies.get(id(info.prim_module))
            if owner is not None and primary is not None:
                owner.__dict__.pop(info.param_name, None)
                owner._parameters[info.param_name] = primary._parameters[info.prim_param_name]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _user_class(cls: type) -> type:
    """The class ``fully_shard`` swapped out (it makes ``FSDP<Class>(FSDPModule, Class)``), or ``cls`` itself."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - builds without distributed
        return cls
    if not issubclass(cls, FSDPModule):
        return cls
    return next(base for base in cls.__mro__[1:] if not issubclass(base, FSDPModule) and base is not object)


TOGETHER = "the ranks write it together in GradScaler.update()"
"""A sharded watch's placeholder until the ranks meet: replaced there by the capsule, or by why there is none."""
NO_MEETING = (
    "a sharded model's capsule is written by every rank together in GradScaler.update(), and this loop has no "
    "GradScaler"
)


def capture_together(
    watch: Any,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    calls: list[Any],
    skipped: list[bool],
    reduction: dict[str, Any],
) -> tuple[Path | None, str | None]:
    """Every rank's part of the step's capsule, written by rank 0; on every rank, its folder or why there is none.

    A collective: every rank calls it at the same ``update()`` with the same ``skipped`` (the ranks' table), so that
    every rank makes the same collectives or none. ``reduction``: the ``sharding`` config keys that say how the ranks
    computed and reduced (``wrapper``, ``param_dtype``, ``reduce_dtype``, ``autocast``)."""
    from .capsule import replay_inputs

    reason = applied_on(skipped)
    if reason is not None:
        return None, reason
    numbers = watch.history[-1]
    try:
        batches, grads = replay_inputs(
            [c.batch for c in calls], [(c.grads, c.scaled) for c in calls], numbers.loss_scale
        )
        mine = RankStep(batches, grads, numbers.loss)
        pickle.dumps(mine)  # what gather_object will send: a part that cannot travel fails here, not mid-collective
    except Exception:  # noqa: BLE001 - the watch's own failure: the rank still takes part, with nothing
        mine = RankStep([], None, numbers.loss)
    steps = gather_steps(mine)
    shards = _shards_past_limit(watch, optimizer, numbers.step)
    if shards is None:
        model_state, optimizer_state = gathered_state(watch.model, optimizer)
    else:
        model_state, optimizer_state = None, {"param_groups": shards[1]}  # the moments stay in the shards
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        assert steps is not None
        parts = _Parts(steps, model_state, optimizer_state, reduction, shards[0] if shards else None)
        result[0] = _write(watch, optimizer, scaler, dataclasses.replace(numbers, loss=ranks_loss(steps)), parts)
    dist.broadcast_object_list(result, src=0, group=object_group())
    if shards is not None and shards[0].exists():  # not moved into a capsule (none written, or another rank's own)
        shutil.rmtree(shards[0], ignore_errors=True)
    folder, why = result[0]
    return (Path(folder) if folder else None), why


def _shards_past_limit(watch: Any, optimizer: torch.optim.Optimizer, step: int) -> tuple[Path, Any] | None:
    """Where the state is larger whole than the watch's gather limit: every rank's shards saved (a collective), in a
    hidden folder beside the capsules that rank 0 moves into the capsule, and the optimizer's parameter groups;
    else None (the state is gathered)."""
    if agreed_whole_bytes(watch.model, optimizer) <= watch.options.gather_limit_mb * 2**20:
        return None
    state = sharded_state(watch.model, optimizer)
    folder = shards_folder(Path(watch.options.capsule_dir), step)
    try:
        shutil.rmtree(folder, ignore_errors=True)  # an earlier run's, killed mid-capture: no shard of it is kept
        dist.barrier(group=object_group())  # every rank's view cleared before any rank writes
        save_shards(state, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # a partial save: nothing to keep
        raise
    return folder, state.optimizer["param_groups"]


def shards_folder(capsule_dir: Path, step: int) -> Path:
    """Where the ranks save their shards before rank 0 moves them into the capsule: the same path on every rank."""
    return capsule_dir / f".ranks_step_{step:08d}.{SHARDS}"


def agreed_whole_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The model's and optimizer's state whole, in bytes, from what this rank holds (a DTensor knows its whole
    size; an FSDP1 flat parameter its unsharded one, and its optimizer state scales with it), the largest of the
    ranks' answers (a collective of one number): every rank then takes the same branch."""
    originals = _fsdp1_original_sizes(model)

    def whole_numel(tensor: torch.Tensor) -> int:
        return originals.get(id(tensor)) or _whole_numel(tensor)

    local = sum(whole_numel(t) * t.dtype.itemsize for t in [*model.parameters(), *model.buffers()])
    for param, moments in optimizer.state.items():
        for value in moments.values():
            if isinstance(value, torch.Tensor):  # a moment the shape of its parameter's shard is as large whole
                whole = whole_numel(param) if value.shape == param.shape else _whole_numel(value)
                local += whole * value.dtype.itemsize
    agreed = torch.tensor([float(local)], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=object_group())
    return int(agreed.item())


def _fsdp1_original_sizes(model: torch.nn.Module) -> dict[int, int]:
    """By ``id``, the whole number of elements of each original parameter FSDP1 with ``use_orig_params=True``
    exposes as a view of this rank's shard (its flat parameter is then no parameter of the model)."""
    from .sharding import flat_parameters

    sizes = {}
    for flat, _ in flat_parameters(model).values():
        for original, shape in zip(getattr(flat, "_params", None) or (), flat._shapes):
            sizes[id(original)] = int(math.prod(shape))
    return sizes


def _whole_numel(tensor: torch.Tensor) -> int:
    unsharded = getattr(tensor, "_unpadded_unsharded_size", None)  # an FSDP1 flat parameter
    return int(math.prod(unsharded)) if unsharded is not None else tensor.numel()  # a DTensor's numel is whole


@dataclass(frozen=True)
class _Parts:
    """What rank 0 holds after the collectives."""

    steps: list[RankStep]
    model_state: dict[str, Any] | None
    """Whole; None: in ``shards``."""
    optimizer_state: dict[str, Any]
    reduction: dict[str, Any]
    shards: Path | None = None
    """The folder the ranks saved their shards of the state into, past the gather limit."""


def _write(
    watch: Any, optimizer: torch.optim.Optimizer, scaler: Any, numbers: Any, parts: _Parts
) -> tuple[str | None, str | None]:
    """On rank 0: the capsule from every rank's part (its folder), or why none."""
    from .capsule import CapsuleContents, StateInShards, import_roots

    try:
        reason = uneven([len(s.batches) for s in parts.steps])
        if reason is None and parts.shards is not None:
            reason = shards_complete(parts.shards)
        if reason is not None:
            return None, reason
        module = plain_module(watch.model, parts.model_state)
        names = [checkpoint_key(watch.model, name) for name, _ in module.named_parameters()]
        batches, grads = flattened(parts.steps)
        contents = CapsuleContents(
            module=module,
            # keyed as the rebuilt module loads it, wrappers and all; in the shards, read whole by the replay
            model_state=module.state_dict() if parts.shards is None else {},
            optimizer_state=indexed_optimizer_state(parts.optimizer_state, names),
            optimizer_by_position=True,
            batches=batches,
            output_grads=grads,
            import_paths=import_roots(module),
            sharding={"world": len(parts.steps), "micro_batches": len(parts.steps[0].batches), **parts.reduction},
            not_emulated=not_emulated(watch.model),
            shards=None if parts.shards is None else StateInShards(parts.shards, shard_keys(module), names),
        )
        return str(watch.write_ranks_capsule(optimizer, scaler, numbers, contents)), None
    except Exception as exc:  # noqa: BLE001 - the watch's own failure, never the training's
        text = str(exc).strip()
        return None, f"writing it failed ({type(exc).__name__}: {text.splitlines()[0] if text else ''})"
