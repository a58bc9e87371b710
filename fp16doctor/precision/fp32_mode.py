"""The FP32 baseline: the user's training with every low-precision path switched off.

A baseline that still contained the user's explicit ``.half()`` calls or their
own ``torch.autocast`` blocks would not be a baseline. While
:func:`full_precision` is active:

* every low-precision dtype requested through the torch API (``.half()``,
  ``.bfloat16()``, ``.to(torch.float16)``, ``.type(torch.HalfTensor)``,
  ``dtype=torch.float16`` in factories and ops, ``Module.half()``) is replaced
  by fp32, through a ``TorchFunctionMode`` so nothing is patched for other code;
* every ``torch.autocast`` (also ``torch.cuda.amp.autocast``) the user's code
  opens is disabled.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .autocast_policy import rewritten_autocast

LOW = (torch.float16, torch.bfloat16)
_LOW_TENSOR_TYPES = {
    "torch.HalfTensor": "torch.FloatTensor",
    "torch.BFloat16Tensor": "torch.FloatTensor",
    "torch.cuda.HalfTensor": "torch.cuda.FloatTensor",
    "torch.cuda.BFloat16Tensor": "torch.cuda.FloatTensor",
}
_DOWNCAST_METHODS = {"half", "bfloat16"}


def _fp32_arg(value: Any) -> Any:
    """Replace one argument that asks for low precision by its fp32 equivalent."""
    if isinstance(value, torch.dtype) and value in LOW:
        return torch.float32
    if isinstance(value, str) and value in _LOW_TENSOR_TYPES:
        return _LOW_TENSOR_TYPES[value]
    if (
        isinstance(value, type)
        and getattr(value, "__module__", "").startswith("torch")
        and value.__name__ in ("HalfTensor", "BFloat16Tensor")
    ):
        return torch.FloatTensor
    return value


class NeutraliseHalfCasts(TorchFunctionMode):
    """Rewrites low-precision dtype requests to fp32 (see module docstring); ``on_rewrite`` is told of each."""

    def __init__(self, on_rewrite: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_rewrite = on_rewrite

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _DOWNCAST_METHODS and args and isinstance(args[0], torch.Tensor):
            # x.half() -> x.float(), keeping memory_format and the like
            self._rewrote()
            return torch.Tensor.float(args[0], **kwargs)
        asked, dtype = args, kwargs.get("dtype")
        args = tuple(_fp32_arg(a) for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _fp32_arg(kwargs["dtype"])
        if name == "to" and len(args) >= 2 and isinstance(args[1], torch.Tensor) and args[1].dtype in LOW:
            args = (args[0], args[1].device, torch.float32) + args[2:]  # x.to(other_half_tensor)
        if len(args) != len(asked) or any(a is not b for a, b in zip(args, asked)) or kwargs.get("dtype") is not dtype:
            self._rewrote()
        return func(*args, **kwargs)

    def _rewrote(self) -> None:
        if self.on_rewrite is not None:
            self.on_rewrite()


@contextlib.contextmanager
def loads_as_saved() -> Iterator[None]:
    """``torch.load`` out of the modes' reach while the block runs: unpickling rebuilds each saved fp16 tensor as an
    fp16 ``torch.empty`` it then points at the saved storage, which an fp32 rewrite cannot hold ("Trying to resize
    storage that is not resizable"). What it loads keeps its saved dtype; the FP32 baseline casts the model up."""
    original = torch.load

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


@contextlib.contextmanager
def half_casts_in_fp32(on_rewrite: Callable[[], None] | None = None) -> Iterator[None]:
    """The file's half casts run in fp32 (:class:`NeutraliseHalfCasts`), and ``torch.load`` as saved."""
    with NeutraliseHalfCasts(on_rewrite), loads_as_saved():
        yield


def disable_autocast(device_type: str, dtype: Any, enabled: bool) -> tuple[str, Any, bool]:
    """The rewrite of every ``torch.autocast(...)`` in the FP32 baseline: created disabled."""
    return device_type, dtype, False


def autocast_disabled() -> contextlib.AbstractContextManager[None]:
    """Every ``torch.autocast(...)`` opened inside is created disabled."""
    return rewritten_autocast(disable_autocast)


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Both guards together: what the fp32 probe runs under."""
    with autocast_disabled(), half_casts_in_fp32():
        yield
