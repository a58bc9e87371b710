"""Writing files so that a crash never leaves a half-written one and nothing is overwritten silently."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target.

    The file gets the permissions a plain ``open(path, "w")`` would give it (the replaced file's, else
    0666 less the umask), not the temporary file's private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    current = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(current)
    return current


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(path: str | Path, obj: Any, pickle_module: Any = None) -> None:
    """``torch.save`` into memory, then the atomic write: a crash never leaves a half-written checkpoint.

    ``pickle_module`` (e.g. cloudpickle) replaces the standard pickle, for objects whose classes are stored by value."""
    import io
    import pickle

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_module=pickle_module or pickle)
    atomic_write_bytes(path, buffer.getvalue())
