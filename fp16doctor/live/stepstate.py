"""The state a model's forward writes to, kept as it was when the optimizer step started.

A capsule replays the failing step from the state it started from. Weights and optimizer state only move in
``optimizer.step()``, after the watch's check; but a model may also write to itself in its forward: a memory
module's buffers (a temporal graph network's per-node memory and last-update times), BatchNorm's running
statistics, a cache kept on a module attribute, a step counter. Taken after the forward, such state already holds
what the failing forward wrote (NaN, where that forward overflowed), and the replay would start from it.

So at the step's first forward the watch keeps, per module, a reference to each buffer and tensor attribute with
its version counter (no copy, no synchronisation), a copy of those that earlier steps' forwards wrote in place
(every one at the first step, when nothing is known yet), and the plain values (numbers, strings). At the capsule
they are put back for the time the capsule is written; what changed in a way the watch could not undo (written in
place without a copy, a list or dict changed) is listed as not captured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

PLAIN = (bool, int, float, complex, str, bytes, type(None))
"""Attribute values kept by value (immutable)."""
CONTAINERS = (list, tuple, dict, set)
"""Attribute values the watch cannot copy cheaply: a change is reported, not undone."""
SKIPPED = frozenset({"training"})
"""Attributes that are no state written in forward (``train()``/``eval()`` sets ``training``)."""
KEPT = PLAIN + CONTAINERS
PLAIN_TYPES = frozenset(PLAIN)


@dataclass(slots=True)
class Held:
    """One piece of state as the step found it."""

    value: Any
    """The tensor (the very object), the plain value, or the container."""
    version: int | None = None
    """A tensor's version counter when taken (in-place writes advance it)."""
    copy: torch.Tensor | None = None
    """A copy of the tensor, where forwards write it in place."""
    length: int | None = None
    """A container's length when taken."""


@dataclass
class StateReport:
    """What a capsule put back, and what it could not."""

    restored: list[str] = field(default_factory=list)
    """State the forward wrote, put back as the step started (``module.attribute``)."""
    uncaptured: list[str] = field(default_factory=list)
    """State the forward changed that the watch could not put back (written in place without a copy, a list or
    dict changed): the replay starts from what the failing forward left there."""

    def to_json(self) -> dict[str, list[str]]:
        return {"restored": self.restored, "uncaptured": self.uncaptured}


Slot = tuple[str, torch.nn.Module, str, bool]
"""(key, module, name, is_buffer): where a piece of state lives."""


def _slots(model: torch.nn.Module) -> list[Slot]:
    """Every buffer and public attribute of the model's modules: where state may be, whatever it holds now."""
    found: list[Slot] = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        found += [(prefix + name, module, name, True) for name in module._buffers]
        found += [
            (prefix + name, module, name, False)
            for name in vars(module)
            if not name.startswith("_") and name not in SKIPPED
        ]
    return found


def _state(
    model: torch.nn.Module, slots: list[Slot] | None = None
) -> Iterator[tuple[str, torch.nn.Module, str, Any, bool]]:
    """(key, module, name, value, is_buffer) of every buffer and non-parameter attribute of the model's modules
    (at ``slots``, where the caller knows them already)."""
    for key, module, name, buffer in _slots(model) if slots is None else slots:
        if buffer:
            value = module._buffers.get(name)
            if value is not None:
                yield key, module, name, value, True
            continue
        value = module.__dict__.get(name)
        if type(value) in PLAIN_TYPES:  # most attributes (sizes, flags, epsilons): one lookup, no isinstance
            yield key, module, name, value, False
            continue
        if isinstance(value, torch.nn.Module):
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            if _holds_its_elements(value):
                yield key, module, name, value, False
        elif isinstance(value, KEPT):
            yield key, module, name, value, False


class StateSlots:
    """A model's :func:`_slots`, found again only when a module's attributes or buffers change in number or its
    submodules change: a step's two reads of its state then walk a list instead of the module tree and every
    ``__dict__``."""

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._modules: list[torch.nn.Module] = []
        self._shape: list[tuple[int, int, tuple[int, ...]]] = []
        self._slots: list[Slot] = []

    def of(self, model: torch.nn.Module) -> list[Slot]:
        if model is not self._model or self._shape != self._shape_now():
            self._model = model
            self._modules = list(model.modules())
            self._shape = self._shape_now()
            self._slots = _slots(model)
        return self._slots

    def _shape_now(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Per module: its attributes' and buffers' counts and its children (by identity: a submodule replaced in
        place keeps the counts)."""
        return [(len(m.__dict__), len(m._buffers), tuple(map(id, m._modules.values()))) for m in self._modules]


def _holds_its_elements(tensor: torch.Tensor) -> bool:
    """The tensor's storage holds every element it addresses. FSDP1 leaves its modules' weights as plain tensor
    attributes viewing the flat parameter, whose storage it frees between forwards: such a view is no state the
    forward writes, and reading it reads freed memory (a segmentation fault)."""
    if tensor.numel() == 0 or tensor.layout != torch.strided or tensor.is_meta:
        return True
    try:
        last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        return (last + 1) * tensor.element_size() <= tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass with no storage of its own (a DTensor's wrapper)
        return True


@dataclass
class StepStart:
    """The model's writable state at the step's first forward (see the module docstring)."""

    held: dict[str, Held]
    tensor_slots: list[Slot] = field(default_factory=list)
    """Where each held tensor lives: what :meth:`written_in_place` reads again, without walking the model."""

    @classmethod
    def take(cls, model: torch.nn.Module, copied: set[str] | None, slots: list[Slot] | None = None) -> StepStart:
        """References (and versions) of every piece of state; a copy of the tensors in ``copied`` (None: all)."""
        held: dict[str, Held] = {}
        tensor_slots: list[Slot] = []
        with torch.no_grad():
            for key, module, name, value, buffer in _state(model, slots):
                if type(value) in PLAIN_TYPES:
                    held[key] = Held(value)
                elif isinstance(value, torch.Tensor):
                    copy = value.detach().clone() if copied is None or key in copied else None
                    held[key] = Held(value, value._version, copy)
                    tensor_slots.append((key, module, name, buffer))
                elif isinstance(value, CONTAINERS):
                    held[key] = Held(value, length=len(value))
                else:
                    held[key] = Held(value)
        return cls(held, tensor_slots)

    def written_in_place(self) -> set[str]:
        """The held tensors the forward wrote in place since (still there, the same object, a later version)."""
        written = set()
        for key, module, name, buffer in self.tensor_slots:
            value = (module._buffers if buffer else module.__dict__).get(name)
            held = self.held[key]
            if value is not None and value is held.value and value._version != held.version:
                written.add(key)
        return written

    @contextlib.contextmanager
    def restored(self, model: torch.nn.Module) -> Iterator[StateReport]:
        """The model with its written state put back as the step started, for the time of the ``with`` block."""
        report = StateReport()
        undo: list[tuple[torch.nn.Module, str, Any, bool]] = []  # (module, name, its value now, is a buffer)
        try:
            now = {key: (module, name, value, buffer) for key, module, name, value, buffer in _state(model)}
            for key, (module, name, value, buffer) in now.items():
                start = self._start_value(key, value, report)
                if start is _UNCHANGED or start is _UNDONE:
                    continue
                undo.append((module, name, value, buffer))
                _set(module, name, start, buffer)
                report.restored.append(key)
            for key, (module, name, value, buffer) in now.items():
                if key not in self.held and isinstance(value, torch.Tensor) and not buffer:
                    undo.append((module, name, value, buffer))  # made by the failing forward: not there yet
                    del module.__dict__[name]
                    report.restored.append(key)
            yield report
        finally:
            for module, name, value, buffer in reversed(undo):
                _set(module, name, value, buffer)

    def _start_value(self, key: str, value: Any, report: StateReport) -> Any:
        """What ``key`` held at the step's start, ``_UNCHANGED`` where it still does, ``_UNDONE`` where the watch
        cannot tell (listed in ``report.uncaptured``)."""
        held = self.held.get(key)
        if held is None:
            return _UNCHANGED
        if isinstance(value, torch.Tensor):
            if held.value is value and value._version == held.version:
                return _UNCHANGED
            if held.copy is not None:
                return held.copy
            if held.value is not value and isinstance(held.value, torch.Tensor) and held.value._version == held.version:
                return held.value  # rebound: the start's tensor is untouched
            report.uncaptured.append(key)
            return _UNDONE
        if isinstance(value, CONTAINERS):
            if held.value is not value or len(value) != held.length:
                report.uncaptured.append(key)
            return _UNDONE
        return _UNCHANGED if held.value is value or held.value == value else held.value


_UNCHANGED = object()
_UNDONE = object()


def _set(module: torch.nn.Module, name: str, value: Any, buffer: bool) -> None:
    if buffer:
        module._buffers[name] = value
    else:
        module.__dict__[name] = value


class StepStartKeeper:
    """Takes a model's :class:`StepStart` at each step's first forward, copying the tensors earlier forwards wrote in
    place (all of them before the first step was checked)."""

    def __init__(self) -> None:
        self.written: set[str] | None = None
        """The tensors forwards wrote in place so far; None before the first step was checked."""
        self.start: StepStart | None = None
        self.slots = StateSlots()

    def begin(self, model: torch.nn.Module) -> None:
        """The step's first forward is about to run (a no-op while a start is held)."""
        if self.start is None:
            self.start = StepStart.take(model, self.written, self.slots.of(model))

    def end(self) -> StepStart | None:
        """The step was checked: learn what its forward wrote in place; hand over its start."""
        start, self.start = self.start, None
        if start is not None:
            self.written = (self.written or set()) | start.written_in_place()
        return start
