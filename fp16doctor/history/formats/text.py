"""Plain-text training logs, read line by line in one pass by every text format at once.

Each format recognises its own lines by a cheap substring test (:meth:`TextFormat.wants`) before any regular
expression runs, so a million-line log is read in seconds and never held in memory. The format that read the most
lines is the file's; a Megatron-DeepSpeed log, which prints both Megatron's iteration lines and DeepSpeed's
overflow messages, is read as Megatron's (its lines count every step).
"""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import HistoryError
from ..records import HistoryBuilder, HistoryRow, LogEvent
from . import Reader, Reading

NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan|Infinity|NaN)"


def as_float(text: str) -> float:
    return float(text)  # Python reads "inf", "nan", "Infinity" and "NaN" as logs print them


class TextFormat(Reader):
    """A framework's own log messages; rows and events are collected as the lines are fed."""

    def __init__(self) -> None:
        self.builder = HistoryBuilder()
        self.events: list[LogEvent] = []
        self.notes: list[str] = []
        self.matched = 0
        """Lines this format read."""

    @classmethod
    def recognises(cls, path: Path) -> bool:
        return path.is_file()

    def wants(self, line: str) -> bool:
        """A cheap test: might this line be one of the format's messages?"""
        raise NotImplementedError

    def feed(self, line: str) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """The end of the file: rows still held back are written."""

    def add(self, row: HistoryRow) -> None:
        self.builder.add(row)

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        return read_text(path, builder, [type(self)])


def read_text(path: Path, builder: HistoryBuilder, formats: list[type[TextFormat]] | None = None) -> Reading:
    """Every text format over the file in one pass; the rows of the one that read the most lines go to ``builder``."""
    from . import all_readers

    parsers = [cls() for cls in (formats or [r for r in all_readers() if issubclass(r, TextFormat)])]
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                for parser in parsers:
                    if parser.wants(line):
                        parser.feed(line)
    except OSError as exc:
        raise HistoryError(f"'{path}' cannot be read ({exc}).") from exc
    for parser in parsers:
        parser.finish()
    best = max(parsers, key=lambda p: p.matched)
    if best.matched == 0:
        raise HistoryError(
            f"'{path}': no line in a format the doctor reads.",
            hint="fp16doctor logs reads trainer_state.json, metrics.csv, TensorBoard events, wandb-history.jsonl, "
            "capsules, and DeepSpeed, fairseq and Megatron-LM text logs; see docs/logs.md.",
        )
    for name in ("steps", "spans"):
        getattr(builder, name).extend(getattr(best.builder, name))
    for key, column in best.builder.columns.items():
        builder.columns[key].values.extend(column.values)
        builder.columns[key].present.extend(column.present)
    others = [p.name for p in parsers if p is not best and p.matched]
    notes = list(best.notes) + ([f"also lines of {', '.join(others)}; read as {best.name}"] if others else [])
    return Reading(notes=notes, events=best.events, format=best.name)


def first_number(text: str) -> float | None:
    match = re.search(NUMBER, text)
    return as_float(match.group(0)) if match else None
