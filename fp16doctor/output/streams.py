"""Where output goes: with ``--json`` stdout carries one JSON object and nothing else.

While a command runs, whatever the training file prints (``print``, C extensions, DataLoader workers: file
descriptor 1 itself) goes to stderr; the JSON goes to the real stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from typing import IO, Any, TextIO

from rich.console import Console

_json_stream: TextIO | None = None
"""Where ``--json`` output goes while :func:`stdout_for_json_only` holds the real stdout."""


def print_json(payload: dict[str, Any]) -> None:
    stream = _json_stream or sys.stdout
    try:
        stream.write(json.dumps(payload, indent=2, allow_nan=False) + "\n")
        stream.flush()
    except BrokenPipeError:
        reader_gone(stream)


def reader_gone(stream: IO[str]) -> None:
    """The reader of ``stream`` stopped reading (``fp16doctor diagnose ... | head``): what is left to write goes
    to the null device, and the command ends with its own exit code (the diagnosis's verdict), not a broken
    pipe's. Python's buffered rest is flushed there too, at exit, without a second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # no descriptor of its own: nothing more is written to it after this
    finally:
        os.close(devnull)


class PipedConsole(Console):
    """A console of the command's stdout or stderr: a reader that stops reading ends its printing only (rich's own
    console exits 1 there, whatever the diagnosis found, and sends stdout to the null device even for stderr)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        reader_gone(self.file)


def whole_line_to_stderr(text: str) -> None:
    """One line, written in one call: under torchrun every rank shares stderr, and ``print`` writes the text and
    its newline separately, so another rank's line could land between them."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def print_json_error(message: str, hint: str | None, location: str | None, exit_code: int) -> None:
    """``--json``'s one object when the command fails: why, and the exit code it ends with."""
    print_json({"error": {"message": message, "hint": hint, "location": location, "exit_code": exit_code}})


@contextlib.contextmanager
def stdout_for_json_only(active: bool) -> Iterator[None]:
    """With ``active``, everything written to stdout inside goes to stderr, and :func:`print_json` to stdout."""
    global _json_stream
    if not active:
        yield
        return
    sys.stdout.flush()
    original = sys.stdout
    fd: int | None = None
    saved: int | None = None
    try:
        descriptor = original.fileno()
        saved = os.dup(descriptor)
        os.dup2(sys.stderr.fileno(), descriptor)
        fd = descriptor
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        saved = None  # no descriptor (a test runner's buffer): redirect Python-level writes only
    stream = os.fdopen(os.dup(saved), "w", encoding="utf-8") if saved is not None else original
    _json_stream = stream
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = original
        stream.flush()
        if saved is not None and fd is not None:
            stream.close()
            os.dup2(saved, fd)
            os.close(saved)
        _json_stream = None
