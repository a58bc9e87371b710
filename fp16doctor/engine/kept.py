"""States a diagnosis keeps for later stages, held off the accelerator and, past a budget, on disk.

The FP32 trajectory's weights (the same-state comparisons), the AMP probe's snapshots at the LR events and
the failing step's snapshot (localisation, intervention search) are each a copy of the model, the last two
with the optimizer's state too: kept in memory they add up to several copies of the training. A
:class:`StateKeeper` is owned by one diagnosis run (a context manager): every state it keeps is moved to host
memory (a CUDA run's GPU memory stays the training's), counted against a byte budget, and past that budget
written to a temporary folder that the keeper removes when the run ends, also on an exception or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import torch

from ..userfile.batches import map_tensors_of

Kept = TypeVar("Kept")


def host_copy_of(value: Any) -> Any:
    """A copy of ``value`` with every tensor in it copied to the CPU (dicts, lists, tuples and dataclasses walked;
    anything else deep-copied): one copy, made straight into host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):  # an OrderedDict state_dict keeps its type and its _metadata
        return map_tensors_of(value, {k: host_copy_of(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its fields as arguments
        return type(value)(*(host_copy_of(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy_of(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value, **{f.name: host_copy_of(getattr(value, f.name)) for f in dataclasses.fields(value)}
        )
    return copy.deepcopy(value)


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (walked as :func:`host_copy_of` walks it)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class StateKeeper:
    """The memory budget of the states one diagnosis keeps, and the temporary folder past it.

    ``budget``: bytes of kept states held in memory (None: no limit, nothing goes to disk). The folder is made
    on the first spill only, and removed by :meth:`close` (the ``with`` block's end).
    """

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.in_memory = 0
        """Bytes of kept states held in memory now."""
        self.spilled = 0
        """How many states went to disk (the report and the tests read it)."""
        self._folder: Path | None = None

    def __enter__(self) -> StateKeeper:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def folder(self) -> Path | None:
        """The temporary folder of the spilled states (None until the first spill, and after :meth:`close`)."""
        return self._folder

    def kept(self) -> KeptStates[Any]:
        """A new mapping of states kept under this budget."""
        return KeptStates(self)

    def fits(self, size: int) -> bool:
        return self.budget is None or self.in_memory + size <= self.budget

    def spill(self, value: Any) -> Path:
        """Write ``value`` to a new file of the temporary folder."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="fp16doctor-states-"))
        self.spilled += 1
        path = self._folder / f"state-{self.spilled}.pt"
        torch.save(value, path)
        return path

    def close(self) -> None:
        """Remove the spilled states' folder (kept states in memory go with their mappings)."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


class KeptStates(MutableMapping[int, Kept], Generic[Kept]):
    """States by step, in host memory while the keeper's budget allows, else in its temporary folder.

    Keeping a state copies it (the value given may be a probe's live tensors: ``Probe.snapshot(copy_state=False)``
    or ``model.state_dict()``): into host memory within the budget, else straight into a file, with no copy
    in memory first. Reading a spilled state loads it again, on the CPU (one state at a time is in memory
    for the stage that needs it); :meth:`owned` gives a copy the caller may change.
    """

    def __init__(self, keeper: StateKeeper):
        self.keeper = keeper
        self._memory: dict[int, tuple[Kept, int]] = {}
        self._disk: dict[int, Path] = {}

    def __setitem__(self, step: int, value: Kept) -> None:
        if step in self:
            del self[step]
        size = tensor_bytes(value)
        if self.keeper.fits(size):
            self._memory[step] = (host_copy_of(value), size)
            self.keeper.in_memory += size
        else:
            self._disk[step] = self.keeper.spill(value)

    def __getitem__(self, step: int) -> Kept:
        if step in self._memory:
            return self._memory[step][0]
        if step in self._disk:
            # Our own file, written by spill(); the CPU whatever device the state was saved from.
            loaded: Kept = torch.load(self._disk[step], map_location="cpu", weights_only=False)
            return loaded
        raise KeyError(step)

    def owned(self, step: int) -> Kept:
        """The state at ``step`` as a copy the caller owns (may hand to a probe, which then changes it)."""
        return self[step] if step in self._disk else host_copy_of(self[step])

    def __delitem__(self, step: int) -> None:
        if step in self._memory:
            self.keeper.in_memory -= self._memory.pop(step)[1]
        elif step in self._disk:
            self._disk.pop(step).unlink(missing_ok=True)
        else:
            raise KeyError(step)

    def __contains__(self, step: object) -> bool:
        return step in self._memory or step in self._disk  # Mapping's default would load a spilled state

    def __iter__(self) -> Iterator[int]:
        return iter(sorted({*self._memory, *self._disk}))

    def __len__(self) -> int:
        return len(self._memory) + len(self._disk)

    def on_disk(self, step: int) -> bool:
        return step in self._disk


def owned_copy(kept: MutableMapping[int, Kept], step: int) -> Kept:
    """A copy of the state kept at ``step`` that the caller owns (a probe may take it over and change it)."""
    return kept.owned(step) if isinstance(kept, KeptStates) else copy.deepcopy(kept[step])


def release_memory(device: torch.device) -> None:
    """Hand freed memory back: a full collection (any cycle left), glibc's ``malloc_trim`` (the allocator keeps
    freed blocks of a closed probe otherwise, and the process's resident memory only grows), and on CUDA the
    caching allocator's free blocks. Within :func:`earlier_objects_frozen`, the collection walks only the objects
    made since the block began."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def earlier_objects_frozen() -> Iterator[None]:
    """For the time of the ``with`` block, the objects alive when it began are frozen (``gc.freeze``): the
    collections of :func:`release_memory` then walk only what the block made since (its probes, which they free).

    A full collection walks every object the process holds: once torch and dynamo are imported, 280,000 objects
    and 0.13 s on a CPU, a dozen times per diagnosis, which on a small training was a fifth of its run. What is frozen
    here (torch's, the training file's, the caller's objects) outlives the diagnosis anyway; nothing the block makes
    is ever frozen, so a probe that dies, an out-of-memory one included, is freed by the next release. A process
    that froze objects of its own (``gc.get_freeze_count()`` above 0) is left as it is.
    """
    if gc.get_freeze_count() > 0:
        yield
        return
    import torch._dynamo  # noqa: F401 - every optimizer's constructor imports it: imported first, frozen with the rest

    gc.collect()  # what is garbage already is freed, not frozen
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


MMAP_THRESHOLD = 4 * 2**20
"""Host allocations from this size on (4 MiB: a 1024 x 1024 fp32 weight) get their own mapping."""
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_blocks_on_free(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process, so that every host block of ``threshold`` bytes or more
    is its own mapping and goes back to the system the moment it is freed. Whether it did (False without glibc).

    glibc raises the threshold by itself, up to 32 MiB, each time a mapped block is freed; from then on the
    tensors of a model's size (a 2048 x 2048 weight is 16 MiB) come from its heaps, where a closed probe's
    gradients and optimizer state stay resident around the next probe's blocks. The diagnosis builds and
    frees one probe after another: measured on a 21M-parameter MLP, its peak fell from 1.8x to 1.2x the
    training's (benchmarks/diagnose_scale.py). Fixing the threshold disables that adjustment; it changes
    where blocks come from, never what any code computes, and only the CLI's own diagnosing commands call
    it (the process is theirs; a library caller's allocator is left alone)."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold) == 1


STATE_BYTES_SHARE = 0.9
"""The share of the parameters' bytes whose tensors set :func:`state_block_threshold`."""
MIN_STATE_BLOCK = 2**20
"""Below this a mapping per block costs more (a page fault per 4 KiB, each time an activation of that size
is made) than the heap space it saves: smaller models keep :data:`MMAP_THRESHOLD`."""


def state_block_threshold(parameter_shapes: Iterable[tuple[int, ...]]) -> int:
    """The mmap threshold for diagnosing a model with these parameter shapes: the size of its own tensors.

    Weights, gradients and optimizer moments are the model-sized blocks that probes and restores free and
    make again; in the heap they end up interleaved with the steps' activations and half-precision copies,
    and the holes they leave are not reused: measured on a 5M-parameter MLP (3.2 MB weights) the peak fell
    from 1.65x to 1.43x the training's when blocks of its weights' size were mapped. The threshold is the
    smallest fp32 size among the largest parameters that hold ``STATE_BYTES_SHARE`` of the model's bytes, if
    that lies between :data:`MIN_STATE_BLOCK` and :data:`MMAP_THRESHOLD` (else the latter: larger tensors are
    mapped anyway, smaller ones would make every activation of their size a fresh mapping)."""
    sizes = sorted((4 * math.prod(shape) for shape in parameter_shapes), reverse=True)
    wanted, covered = STATE_BYTES_SHARE * sum(sizes), 0
    for size in sizes:
        covered += size
        if covered >= wanted:
            return size if MIN_STATE_BLOCK <= size < MMAP_THRESHOLD else MMAP_THRESHOLD
    return MMAP_THRESHOLD


class StateBlockMapping:
    """glibc's mmap threshold at :func:`state_block_threshold` for one diagnosis in the CLI's own process, and
    back at :data:`MMAP_THRESHOLD` when it ends (``diagnose --train`` trains in the same process next).

    Blocks from the threshold on are mapped whatever they hold: where the steps' activations fall between it
    and :data:`MMAP_THRESHOLD`, each would be a fresh mapping, page-faulted anew at every step (15-45% slower
    steps, measured). :meth:`saw_activations` puts the threshold back as soon as a probe shows one."""

    def __init__(self, parameter_shapes: Iterable[tuple[int, ...]]):
        self.threshold = state_block_threshold(parameter_shapes)

    @property
    def lowered(self) -> bool:
        return self.threshold < MMAP_THRESHOLD

    def __enter__(self) -> StateBlockMapping:
        if self.lowered and not return_large_blocks_on_free(self.threshold):
            self.threshold = MMAP_THRESHOLD  # no glibc: nothing was changed
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def saw_activations(self, block_bytes: Iterable[int]) -> None:
        """A probe's activations were these sizes (bytes): keep the lowered threshold only if none is mapped by it alone."""
        if self.lowered and any(self.threshold <= size < MMAP_THRESHOLD for size in block_bytes):
            self._restore()

    def _restore(self) -> None:
        if self.lowered:
            return_large_blocks_on_free(MMAP_THRESHOLD)
            self.threshold = MMAP_THRESHOLD


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, where the C library has one."""
    return cast("Callable[[int, int], int] | None", _libc_function("mallopt"))


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, where the C library has one (not on macOS, Windows or musl)."""
    return cast("Callable[[int], int] | None", _libc_function("malloc_trim"))


@functools.cache
def _libc_function(name: str) -> Callable[..., int] | None:
    """The C library's function ``name`` (loaded once), or None where the library or the function is missing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return cast(Callable[..., int], getattr(libc, name))
    except (OSError, AttributeError):
        return None
