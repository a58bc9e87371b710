"""The user's model as the doctor walks it: the modules that take Python hooks, by the names the user knows.

Shared by everything that hooks the model (the instruments, the localisation's tracer, the runtime overrides),
so that each sees the same modules: a parallel wrapper's inside, no TorchScript module.
"""

from __future__ import annotations

from typing import Any

import torch

PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
"""The wrappers whose ``.module`` runs the model the user wrote."""


def compile_wrapper_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds; None: ``module`` is no such wrapper."""
    inner = getattr(module, "_orig_mod", None)
    return inner if type(module).__name__ == "OptimizedModule" and isinstance(inner, torch.nn.Module) else None


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's own model inside the wrappers that run it: (Distributed)DataParallel and ``torch.compile``'s
    ``OptimizedModule``, however nested. Its names are the ones the user knows, and its class the one a capsule
    rebuilds."""
    while True:  # read from _modules: a failed attribute lookup raises (and formats) an AttributeError each step
        inner = model._modules.get("module" if isinstance(model, PARALLEL_WRAPPERS) else "_orig_mod")
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def compiled_call(module: torch.nn.Module) -> object | None:
    """What ``torch.compile`` returned for the program a call of ``module`` runs: its ``OptimizedModule``, or the
    compiled ``_call_impl`` of a module compiled in place (``Module.compile()``), through parallel wrappers; None:
    the call runs eager."""
    while True:
        if compile_wrapper_inner(module) is not None:
            return module
        in_place = getattr(module, "_compiled_call_impl", None)
        if in_place is not None:
            return in_place
        if not isinstance(module, PARALLEL_WRAPPERS):
            return None
        module = module.module


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


def fsdp2_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: every one where this torch keeps several (a grouped
    ``fully_shard([a, b])``, whose singular property refuses), else its one group (older torch)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []
