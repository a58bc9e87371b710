"""Reading a CSV of logged metrics as a stream, with one clear error for a file that is not one."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path

from ...errors import HistoryError

csv.field_size_limit(1 << 24)  # a logged text field (a hyperparameter dump) may be long


def header(path: Path) -> list[str]:
    """The first row of a CSV file ([] for an empty or unreadable one)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as handle:
            return next(csv.reader(handle), [])
    except (OSError, csv.Error):
        return []


def rows(path: Path) -> Iterator[dict[str, str]]:
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            yield from csv.DictReader(handle)
    except (csv.Error, UnicodeDecodeError) as exc:
        raise HistoryError(f"'{path}' is not a readable CSV file ({exc}).") from exc


def number(text: str | None) -> float | None:
    """A CSV cell as a float: empty is absent; ``inf``, ``nan`` and ``NaN`` are values (logs write them so)."""
    if text is None or not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        lowered = text.strip().lower()
        return {"true": 1.0, "false": 0.0}.get(lowered)


def integer(text: str | None) -> int | None:
    value = number(text)
    return int(value) if value is not None and math.isfinite(value) else None
