"""A failed run's history, read from what it left behind, and the patterns of trouble in it.

Nothing is run: the readers (:mod:`.formats`, one module per log format) turn each file into typed rows, the
patterns (:mod:`.patterns`, one module each) return typed findings, and the command line renders them
(``fp16doctor logs``, :mod:`fp16doctor.output.history`).
"""

from __future__ import annotations

from .patterns import Certainty, LogFinding, classify
from .read import read_history
from .records import Checkpoint, History, HistoryRow, LogEvent, LogSource, Quantity
from .report import LogsReport, read_logs

__all__ = [
    "Certainty",
    "Checkpoint",
    "History",
    "HistoryRow",
    "LogEvent",
    "LogFinding",
    "LogSource",
    "LogsReport",
    "Quantity",
    "classify",
    "read_history",
    "read_logs",
]
