"""Writing files so that a crash never leaves a half-written one and nothing is overwritten silently."""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target.

    The file gets the permissions a plain ``open(path, "w")`` would give it: a replaced file keeps its
    mode; a new one is created 0666 and the kernel applies the umask. The process's umask is never read
    or changed (that would race every other thread creating files, e.g. a trainer a capsule is written in)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replaced_mode = path.stat().st_mode & 0o777 if path.exists() else None
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if replaced_mode is not None:
                os.fchmod(handle.fileno(), replaced_mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new hidden file next to ``path``, created exclusively with mode 0666 less the umask (as ``open`` does)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


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


def jsonable(value: Any) -> Any:
    """Plain JSON types only; non-finite floats become strings ("inf", "nan") in evidence."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if is_dataclass(value) and not isinstance(value, type) and hasattr(value, "to_json"):
        return jsonable(value.to_json())  # a record inside evidence: its own documented shape
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            return str(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    return str(value)
