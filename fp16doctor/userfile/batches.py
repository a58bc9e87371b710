"""Batches: the contract's allowed shapes and the operations the probes need on them.

A batch is a tensor, a tuple/list of tensors or a dict of tensors, nested in
any combination; a dict is any mapping (Hugging Face's ``BatchEncoding`` is a
``UserDict``). Non-tensor leaves (ints, strings) are tolerated inside
containers because real datasets carry ids and lengths.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

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
        return map_tensors_of(
            batch, {k: map_named_tensors(v, fn, f"{prefix}.{k}" if prefix else str(k)) for k, v in batch.items()}
        )
    if isinstance(batch, (list, tuple)):
        items = [map_named_tensors(v, fn, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(batch)]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def floats_to(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors cast to ``dtype``; other tensors and leaves as they are."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


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


def batch_rows(batch: Any) -> tuple[int | None, str]:
    """The number of rows a batch splits into (its tensors' common leading dimension), or None and why not.

    Only a batch made of tensors alone (a tensor, tuples/lists/dicts of them, nested) whose every tensor has
    the same leading dimension is split: a non-tensor leaf (a token count, a list of captions) or a tensor
    that is not per row (a shared mask, a scalar) has no rows to follow, so its meaning after a split is a
    guess. Non-tensor containers' own types are kept by :func:`split_rows`.
    """
    if not isinstance(batch, (torch.Tensor, Mapping, list, tuple)):
        return None, f"the batch is a {type(batch).__name__}"
    leaves = list(_leaves(batch))
    odd = next((type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)), None)
    if odd is not None:
        return None, f"the batch holds a {odd}, not only tensors"
    if not leaves:
        return None, "the batch holds no tensor"
    if any(t.dim() == 0 for t in leaves):
        return None, "the batch holds a scalar tensor"
    sizes = {t.shape[0] for t in leaves}
    if len(sizes) > 1:
        return None, f"the batch's tensors have different leading dimensions ({', '.join(map(str, sorted(sizes)))})"
    return sizes.pop(), ""


def _leaves(batch: Any) -> Iterator[Any]:
    """Every leaf of a batch, tensors and anything else."""
    if isinstance(batch, Mapping):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _leaves(value)
    else:
        yield batch


def row_counts(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` contiguous pieces as even as can be (the first ones one row longer)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts) if base + (1 if i < extra else 0)]


def split_rows(batch: Any, counts: list[int]) -> list[Any]:
    """The batch cut into consecutive pieces of ``counts`` rows (views: nothing is copied), each in the
    batch's own container types. Only for a batch :func:`batch_rows` accepts."""
    pieces, start = [], 0
    for count in counts:
        pieces.append(map_tensors(batch, functools.partial(_rows, start=start, count=count)))
        start += count
    return pieces


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t.narrow(0, start, count)


def first_rows(batch: Any, count: int) -> Any:
    """The batch's first ``count`` rows (views)."""
    return split_rows(batch, [count])[0]
