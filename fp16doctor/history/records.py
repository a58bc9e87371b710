"""The typed records of a run's history: one row per logged step, the run they make, and where they came from.

Every reader turns its format into :class:`HistoryRow` values; :class:`HistoryBuilder` keeps them as columns (a
million rows stay a few tens of megabytes) and :class:`History` is what the patterns read. The step axis is the
optimizer steps *attempted*, as PyTorch's GradScaler, the Hugging Face Trainer, DeepSpeed and Megatron-LM count
them: a skipped step is a step.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from ..files import jsonable


class Quantity(StrEnum):
    """What a history can hold per step; each format carries some of them (the log formats reference)."""

    LOSS = "loss"
    """The training loss (a logging interval's mean where the format averages)."""
    LOSS_SCALE = "loss_scale"
    """The loss scale of the dynamic scaler (GradScaler, DeepSpeed's, fairseq's, Megatron's)."""
    SKIPPED = "skipped"
    """Steps the scaler skipped on overflow (inf/NaN gradients)."""
    GRAD_NORM = "grad_norm"
    """The global gradient norm (unscaled where the framework logs it so)."""
    LR = "lr"
    """The learning rate."""


QUANTITIES = tuple(Quantity)


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One logged row: the optimizer steps up to ``step`` since the previous row, and what the log says of them."""

    step: int
    """The last optimizer step the row covers (attempted steps, skipped ones included)."""
    steps: int = 1
    """How many optimizer steps the row covers: 1 for a per-step log, the logging interval for an averaged one."""
    loss: float | None = None
    loss_scale: float | None = None
    """The loss scale the log reports for the row (DeepSpeed and fairseq: the scale set after an overflow)."""
    skipped: int | None = None
    """Skipped steps among those the row covers; None: the format does not say."""
    nonfinite: int | None = None
    """Steps among those the row covers whose loss was inf/NaN (Megatron-LM counts them); None: read off the loss."""
    grad_norm: float | None = None
    lr: float | None = None


def nonfinite_value(value: float | None) -> bool:
    return value is not None and not math.isfinite(value)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint found beside the logs, and the optimizer step it holds."""

    path: Path
    """The checkpoint's file or folder."""
    step: int
    """The optimizer step it was written at (read off its name)."""
    kind: str
    """Which layout: ``hf`` (checkpoint-N/), ``lightning`` (.ckpt), ``fp16doctor`` (step_N.pt), ``deepspeed``
    (global_stepN/), ``megatron`` (iter_N/), ``fairseq`` (checkpoint_E_U.pt)."""

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "kind": self.kind}


@dataclass(frozen=True)
class LogEvent:
    """A message the log prints once, that no row holds: the scale reaching its minimum, the run stopping."""

    kind: str
    """``scale-at-minimum``: the framework's own message that the scale cannot go lower."""
    step: int | None
    """The step it was printed at, as far as the log places it."""
    message: str
    """The line as the log has it (stripped)."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "message": self.message}


SCALE_AT_MINIMUM = "scale-at-minimum"


@dataclass(frozen=True)
class LogSource:
    """One file read: its format, how many rows it gave, and what it carried."""

    path: Path
    """The file (or one-history folder) read."""
    format: str
    """The reader's name (the log formats reference)."""
    rows: int
    """The rows it gave."""
    carried: list[str]
    """The quantities present in at least one row."""
    notes: list[str] = field(default_factory=list)
    """What the reader could not read as the format says, or had to infer."""

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "format": self.format,
            "rows": self.rows,
            "carried": self.carried,
            "notes": self.notes,
        }


class _Column:
    """One quantity's values as float64, with a presence mask: a NaN loss is data, an absent one is not."""

    def __init__(self) -> None:
        self.values = array("d")
        self.present = bytearray()

    def add(self, value: float | int | None) -> None:
        if value is None:
            self.present.append(0)
            self.values.append(math.nan)
        else:
            self.present.append(1)
            self.values.append(value)


class HistoryBuilder:
    """Collects rows as columns, in the order a reader yields them."""

    def __init__(self) -> None:
        self.steps = array("q")
        self.spans = array("q")
        self.columns = {name: _Column() for name in ("loss", "loss_scale", "skipped", "nonfinite", "grad_norm", "lr")}

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, row: HistoryRow) -> None:
        self.steps.append(row.step)
        self.spans.append(max(row.steps, 1))
        c = self.columns  # unrolled: a million rows are read in seconds
        c["loss"].add(row.loss)
        c["loss_scale"].add(row.loss_scale)
        c["skipped"].add(row.skipped)
        c["nonfinite"].add(row.nonfinite)
        c["grad_norm"].add(row.grad_norm)
        c["lr"].add(row.lr)

    def extend(self, rows: Iterable[HistoryRow]) -> None:
        for row in rows:
            self.add(row)

    def build(self, sources: list[LogSource], events: list[LogEvent], notes: list[str]) -> History:
        order = np.argsort(np.frombuffer(self.steps, dtype=np.int64), kind="stable") if len(self) else np.array([], int)

        def values(name: str) -> np.ndarray:
            return np.frombuffer(self.columns[name].values, dtype=np.float64)[order].copy()

        def present(name: str) -> np.ndarray:
            return np.frombuffer(bytes(self.columns[name].present), dtype=np.bool_)[order].copy()

        return History(
            step=np.frombuffer(self.steps, dtype=np.int64)[order].copy(),
            span=np.frombuffer(self.spans, dtype=np.int64)[order].copy(),
            values={name: values(name) for name in self.columns},
            present={name: present(name) for name in self.columns},
            sources=sources,
            events=events,
            notes=notes,
        )


@dataclass
class History:
    """A run's history as columns, sorted by step: what the patterns read and the plot draws."""

    step: np.ndarray
    span: np.ndarray
    values: dict[str, np.ndarray]
    present: dict[str, np.ndarray]
    sources: list[LogSource]
    events: list[LogEvent] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.step)

    def has(self, quantity: str) -> bool:
        return bool(self.present[quantity].any())

    def column(self, quantity: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the rows that hold ``quantity``."""
        mask = self.present[quantity]
        return self.step[mask], self.values[quantity][mask]

    def skipped(self) -> np.ndarray:
        """Skipped steps per row: as logged, or read off the scale where the log gives only the scale (a scaler
        halves its scale on each skip); 0 where neither says."""
        logged = np.where(self.present["skipped"], self.values["skipped"], 0.0)
        if self.has("skipped") or not self.has("loss_scale"):
            return logged.astype(np.int64)
        steps, scales = self.column("loss_scale")
        rows = np.flatnonzero(self.present["loss_scale"])
        inferred = np.zeros(len(self), dtype=np.int64)
        falls = np.flatnonzero(scales[1:] < scales[:-1])
        # the scale a row reports is the one its step ran at: a fall at the next row marks this row's step skipped
        inferred[rows[falls]] = 1
        return inferred

    def skips_inferred(self) -> bool:
        return not self.has("skipped") and self.has("loss_scale")

    def nonfinite(self) -> np.ndarray:
        """Non-finite steps per row: as counted by the log, else 1 where the row's loss is inf/NaN."""
        counted = np.where(self.present["nonfinite"], self.values["nonfinite"], 0.0).astype(np.int64)
        loss = self.values["loss"]
        from_loss = (self.present["loss"] & ~np.isfinite(loss)).astype(np.int64)
        return np.maximum(counted, from_loss)

    def first_step(self) -> int | None:
        return int(self.step[0]) if len(self) else None

    def last_step(self) -> int | None:
        return int(self.step[-1]) if len(self) else None

    def carried(self) -> list[str]:
        return [q.value for q in QUANTITIES if self.has(q.value)]

    def rows(self, start: int = 0, stop: int | None = None) -> Iterator[HistoryRow]:
        """The rows back as records (for a reader's test or a small slice of the plot)."""
        stop = len(self) if stop is None else min(stop, len(self))
        for i in range(start, stop):

            def value(name: str, i: int = i) -> float | None:
                return float(self.values[name][i]) if self.present[name][i] else None

            skipped, nonfinite = value("skipped"), value("nonfinite")
            yield HistoryRow(
                step=int(self.step[i]),
                steps=int(self.span[i]),
                loss=value("loss"),
                loss_scale=value("loss_scale"),
                skipped=None if skipped is None else int(skipped),
                nonfinite=None if nonfinite is None else int(nonfinite),
                grad_norm=value("grad_norm"),
                lr=value("lr"),
            )

    def summary_json(self) -> dict[str, Any]:
        return jsonable(
            {
                "rows": len(self),
                "first_step": self.first_step(),
                "last_step": self.last_step(),
                "carried": self.carried(),
                "skipped_steps": int(self.skipped().sum()),
                "nonfinite_steps": int(self.nonfinite().sum()),
            }
        )
