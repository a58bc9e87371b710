"""Batches: the contract's allowed shapes and the operations the probes need on them.

A batch is a tensor, a tuple/list of tensors or a dict of tensors, nested in
any combination; a dict is any mapping (Hugging Face's ``BatchEncoding`` is a
``UserDict``). Non-tensor leaves (ints, strings) are tolerated inside
containers because real datasets carry ids and lengths.
"""

from __future__ import annotations

import copy

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from ..errors import BatchError


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor leaf, keeping the container structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):  # keeps OrderedDict, BatchEncoding and friends; falls back to a plain dict
        return map_tensors_of(batch, {k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def map_named_tensors(batch: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], prefix: str = "") -> Any:
    """:func:`map_tensors` with each leaf's field path (as :func:`iter_tensors` names it) passed to ``fn``."""
    if isinstance(batch, torch.Tensor):
        return fn(prefix or "batch", batch)
    if isinstance(batch, Mapping):
        return map_tensors_of(batch, {k: map_named_tensors(v, fn, f"{prefix}.{k}" if prefix else str(k)) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        items = [map_named_tensors(v, fn, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(batch)]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def map_tensors_of(original: Mapping, mapped: dict) -> Mapping:
    """``mapped`` in ``original``'s dict type where it can be rebuilt (OrderedDict, ModelOutput-like), with a
    ``state_dict``'s ``_metadata`` (module versions ``load_state_dict`` reads) carried over."""
    if type(original) is dict:
        return mapped
    rebuild: Any = type(original)  # a concrete mapping class: its constructor takes the items
    try:
        rebuilt = rebuild(mapped)
    except Exception:  # noqa: BLE001
        return mapped
    if hasattr(original, "_metadata"):
        rebuilt._metadata = copy.deepcopy(original._metadata)
    return rebuilt


def iter_tensors(batch: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(field path, tensor) for every tensor leaf: ``"0"``, ``"input_ids"``, ``"x.1"``."""
    if isinstance(batch, torch.Tensor):
        yield prefix or "batch", batch
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from iter_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from iter_tensors(value, f"{prefix}.{index}" if prefix else str(index))


def check_batch(batch: Any, index: int) -> None:
    """Raise :class:`BatchError` unless ``batch`` holds at least one tensor in a supported container."""
    if not isinstance(batch, (torch.Tensor, Mapping, list, tuple)):
        raise BatchError(
            f"batch {index} from data() is a {type(batch).__name__}, which is not a supported batch.",
            hint="Yield a tensor, a tuple/list of tensors, or a dict of tensors (numpy arrays: wrap with torch.as_tensor).",
        )
    if next(iter_tensors(batch), None) is None:
        raise BatchError(
            f"batch {index} from data() contains no tensor.",
            hint="Yield a tensor, a tuple/list of tensors, or a dict of tensors.",
        )


def detach_copy(batch: Any) -> Any:
    """A private copy, so a training step that edits its batch in place cannot change later probes."""
    return map_tensors(batch, lambda t: t.detach().clone())


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Copy to ``device``; with ``float_dtype``, floating leaves are cast too (the fp32 probe uses it)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, copy=True)
        if float_dtype is not None and t.is_floating_point():
            t = t.to(float_dtype)
        return t

    return map_tensors(batch, move)
