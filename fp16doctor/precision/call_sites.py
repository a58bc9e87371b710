"""Where in the code a torch call is made: the line an operator-level finding names and an operator-level override
(``overrides.fp32_lines``) acts on.

The call site of a torch call is the innermost frame of the Python stack that is neither PyTorch, nor the doctor, nor
the standard library: the user's own code (a ``nn.Linear`` called from the model's forward is that forward's line,
since ``nn.Linear``'s own code is PyTorch's), or an installed library's where its code makes the call (a Hugging
Face model's attention line).

The finding and the override read the stack the same way, so a line the attribution names is the line the override
matches. A line is written ``file:line``; ``file`` is matched by the trailing parts of the frame's path
(``model.py:42`` matches ``/home/me/project/model.py`` at line 42; ``models/net.py:7`` that folder's ``net.py``).
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError


def _folders(*paths: str | Path) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(Path(p).resolve()) + os.sep for p in paths))


_OUTSIDE = _folders(Path(torch.__file__).parent, Path(__file__).resolve().parents[1])  # PyTorch and the doctor
_STDLIB = _folders(sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
_INSTALLED = _folders(sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
"""Installed packages: inside the standard library's folder on most installations, and not part of it."""
_OUTSIDE_FILES: dict[str, bool] = {}
"""Whether each code file lies outside the code a call site may be in, by the name its code objects carry."""


def _outside(filename: str) -> bool:
    known = _OUTSIDE_FILES.get(filename)
    if known is None:
        if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            known = True
        else:
            try:
                path = str(Path(filename).resolve())
            except OSError:
                path = filename
            known = path.startswith(_OUTSIDE) or (path.startswith(_STDLIB) and not path.startswith(_INSTALLED))
        _OUTSIDE_FILES[filename] = known
    return known


def in_call_site_code(filename: str) -> bool:
    """Whether code in ``filename`` can be a call site: neither PyTorch's, nor the doctor's, nor the standard
    library's."""
    return not _outside(filename)


def calling_frame(start: types.FrameType | None = None) -> types.FrameType | None:
    """The frame that made the running torch call (see the module docstring), or None where no frame but
    PyTorch's, the doctor's and the standard library's is on the stack."""
    frame: types.FrameType | None = start if start is not None else sys._getframe(1)
    while frame is not None and _outside(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


@functools.lru_cache(maxsize=4096)  # resolving paths is the costly part of naming an attribution's lines
def site_label(filename: str, lineno: int, base: Path | None = None) -> str:
    """``file:line`` as findings and configs write it: a file under ``base`` (the training file's folder) by its
    path from there, any other by its full path."""
    path = Path(filename)
    if base is not None:
        try:
            return f"{path.resolve().relative_to(base.resolve()).as_posix()}:{lineno}"
        except (ValueError, OSError):
            pass
    return f"{path.as_posix()}:{lineno}"


@dataclass(frozen=True)
class SourceLine:
    """One ``file:line`` entry of ``overrides.fp32_lines``."""

    parts: tuple[str, ...]
    """The file's path parts as written (matched against the end of a frame's path)."""
    line: int

    @classmethod
    def parse(cls, entry: str) -> SourceLine:
        file, sep, line = entry.strip().rpartition(":")
        if not sep or not file or not line.isdigit() or int(line) < 1:
            raise ConfigError(
                f"overrides.fp32_lines entry {entry!r} is not a source line written as file:line.",
                hint="For example fp32_lines: ['model.py:42'] (as the precision-gap finding names it).",
            )
        return cls(tuple(Path(file).as_posix().split("/")), int(line))

    def matches(self, filename: str, lineno: int) -> bool:
        if lineno != self.line:
            return False
        parts = tuple(Path(filename).as_posix().split("/"))
        return parts[-len(self.parts) :] == self.parts


class SourceLines:
    """The lines of ``overrides.fp32_lines``, matched against the call site of each torch call."""

    def __init__(self, entries: list[str]):
        self.entries = [SourceLine.parse(e) for e in entries]
        self._lines = {e.line for e in self.entries}
        self._matched: dict[tuple[str, int], bool] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def holds(self, frame: types.FrameType | None) -> bool:
        """Whether ``frame`` (a call site, :func:`calling_frame`) is at one of the lines."""
        if frame is None or frame.f_lineno not in self._lines:
            return False
        key = (frame.f_code.co_filename, frame.f_lineno)
        found = self._matched.get(key)
        if found is None:
            found = self._matched[key] = any(e.matches(key[0], key[1]) for e in self.entries)
        return found
