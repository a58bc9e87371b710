"""The readers: one module per format, each declaring what it carries (the log formats reference is made from
these declarations by ``tools/gen_docs.py``).

A reader recognises its files cheaply (by name, by a header, by the first bytes) and streams them into a
:class:`~fp16doctor.history.records.HistoryBuilder`. Plain-text logs are read in one pass by every text format at
once (:mod:`.text`): DeepSpeed, fairseq and Megatron-LM print their own messages, and a Megatron-DeepSpeed log
holds two of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..records import HistoryBuilder, LogEvent, Quantity

NOT_CARRIED = ""


@dataclass
class Reading:
    """What reading one file gave besides its rows."""

    notes: list[str] = field(default_factory=list)
    events: list[LogEvent] = field(default_factory=list)
    format: str | None = None
    """The format that matched, where a reader reads several (the text logs)."""


class Reader:
    """One log format. ``carries`` says, per quantity, how the format holds it (empty: never)."""

    name: ClassVar[str]
    """The format's name in the output and the reference."""
    title: ClassVar[str]
    """What a user calls the file."""
    source: ClassVar[str]
    """Where the format is defined (the framework's source file that writes it)."""
    carries: ClassVar[dict[Quantity, str]]
    steps: ClassVar[str]
    """What the format's step is, and how rows map to optimizer steps."""

    @classmethod
    def recognises(cls, path: Path) -> bool:
        raise NotImplementedError

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        raise NotImplementedError


def all_readers() -> list[type[Reader]]:
    """Every format, in the order they are tried (structured files first, plain text last)."""
    from .deepspeed import DeepSpeedLog
    from .doctor_run import DoctorRunMetrics
    from .fairseq import FairseqLog
    from .hf_trainer import HfTrainerState
    from .lightning_csv import LightningMetrics
    from .megatron import MegatronLog
    from .tensorboard import TensorBoardEvents
    from .wandb import WandbHistory
    from .watch_capsule import WatchCapsule

    return [
        HfTrainerState,
        LightningMetrics,
        DoctorRunMetrics,
        TensorBoardEvents,
        WandbHistory,
        WatchCapsule,
        DeepSpeedLog,
        FairseqLog,
        MegatronLog,
    ]


def structured_readers() -> list[type[Reader]]:
    from .text import TextFormat

    return [r for r in all_readers() if not issubclass(r, TextFormat)]


LOG_SUFFIXES = (".log", ".txt", ".out", ".err", "")
"""The plain-text logs a folder is searched for (a file passed by name is read whatever its suffix)."""
SEARCH_DEPTH = 4
"""How deep a folder is searched for logs (``lightning_logs/version_0/metrics.csv`` is two down)."""


def files_under(folder: Path, depth: int = SEARCH_DEPTH) -> Iterator[Path]:
    """The files under ``folder``, shallowest first, checkpoint folders' and hidden folders' contents left out
    (a checkpoint-N/trainer_state.json is found through its output_dir instead)."""
    level = [folder]
    for _ in range(depth + 1):
        below: list[Path] = []
        for directory in level:
            try:
                entries = sorted(directory.iterdir())
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if entry.is_dir():
                    below.append(entry)
                elif entry.is_file():
                    yield entry
        level = below
