"""One exception family for everything the library refuses.

Library code raises these; only :mod:`fp16doctor.cli` catches them and turns
them into one red message and an exit code. Keeping the mapping in one place
means a CI script can rely on the exit codes documented in the README.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2


def first_line(exc: BaseException | str | None) -> str:
    """An exception's message (or a message), its first line only ("" for none): what a record or a table has
    room for."""
    text = "" if exc is None else str(exc).strip()
    return text.splitlines()[0] if text else ""


def one_line(exc: BaseException) -> str:
    """An error in one line, its type first (PyTorch's out-of-memory message runs to several)."""
    message = first_line(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def smaller_run_hint(command: str) -> str:
    """What to do when a probe the command stands on runs out of memory."""
    return (
        f"{command} with smaller batches or a smaller model (the same numerics show at a smaller scale), "
        "or on a device with more memory."
    )


class DoctorError(Exception):
    """Base class: a problem the user can fix, with a hint saying how.

    ``location`` is ``"file:line"`` in the user's code when one is known, so the
    message can point at it instead of at fp16doctor's internals.
    """

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, hint: str = "", location: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.location = location

    def __str__(self) -> str:  # pragma: no cover - convenience for logs
        parts = [self.message]
        if self.location:
            parts.append(f"at {self.location}")
        if self.hint:
            parts.append(self.hint)
        return " - ".join(parts)


class CheckpointError(DoctorError):
    """A checkpoint that cannot start the probes: unreadable, of no known layout, or not of this model."""


class TrainingFileError(DoctorError):
    """The training file is missing, broken, or breaks the contract."""


class ConfigError(DoctorError):
    """A config file or value is invalid (unknown key, wrong type, bad value)."""


class BatchError(DoctorError):
    """``data()`` yielded nothing, or something that is not a supported batch."""


class MemoryLimitError(DoctorError):
    """The diagnosis cannot fit in the memory it has: a --max-memory budget below one probe, or a probe the
    whole diagnosis stands on (the FP32 baseline, AMP as configured) that ran out of memory."""


class HistoryError(DoctorError):
    """A run's history that ``fp16doctor logs`` cannot read: a missing path, a format it does not know, an empty
    file, a corrupt JSON or CSV."""


class RankTimeoutError(DoctorError):
    """A parallel run in which no rank moved for ``--rank-timeout`` seconds: stopped, with where each rank was."""


class ScriptError(DoctorError):
    """A script or module given to ``fp16doctor watch`` cannot be started: Python's message and exit code."""

    def __init__(self, message: str, exit_code: int, hint: str = ""):
        super().__init__(message, hint=hint)
        self.exit_code = exit_code
