"""Counts the copies fp16doctor's own code makes of given tensors (a training's batches): ``.cpu()``, ``.to()``,
``.clone()``, ``.numpy()``, ``.tolist()``, ``.item()``... called from a frame of the ``fp16doctor`` package.

On the CPU ``.cpu()`` of a CPU tensor is free, so a per-step host copy would not show in the time; this shows
the call itself, which on a GPU is a transfer and a synchronisation."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = str(Path(__file__).resolve().parents[1] / "fp16doctor")
TORCH = str(Path(torch.__file__).resolve().parent)
COPIES = {
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.to,
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.copy_,
    torch.Tensor.numpy,
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__deepcopy__,
    torch.Tensor.__reduce_ex__,
}


class HostCopies(TorchFunctionMode):
    """``with HostCopies() as copies: ...; copies.watch(tensors)``: ``copies.count`` of those tensors copied by fp16doctor."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, torch.Tensor] = {}
        """By the address of their data (a ``.detach()``-ed alias shares it); held, so no address is reused."""
        self.count = 0

    def watch(self, *tensors: Any) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.watched[t.data_ptr()] = t

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (
            func in COPIES
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].data_ptr() in self.watched
            and _called_from_fp16doctor()
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _called_from_fp16doctor() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(PACKAGE)
