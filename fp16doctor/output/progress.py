"""Progress displays on stderr: a running diagnosis and a training run (rich's progress bars).

Shown only while stderr is a terminal: logs and pipes get no control sequences, and stdout (``--json``'s
one object) is never touched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class DiagnosisProgress:
    """The stage, the step of the probe it runs, the time spent and an estimate of the time left. Removed when
    the diagnosis ends, before the report prints."""

    def __init__(self, console: Console, stages: Sequence[str]):
        self.console = console
        self.stages = list(stages)
        self.index = 0.0
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def __enter__(self) -> DiagnosisProgress:
        if not self.console.is_terminal:
            return self
        columns = [
            TextColumn("[bold]diagnose"),
            TextColumn("{task.fields[stage]}"),
            BarColumn(),
            TextColumn("{task.fields[step]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
        ]
        # stdout is not redirected: what the training file prints stays on stdout (or, with --json, stderr)
        self.progress = Progress(*columns, console=self.console, transient=True, redirect_stdout=False)
        self.progress.start()
        self.task = self.progress.add_task("diagnose", total=len(self.stages), stage="preparing", step="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def stage(self, name: str) -> None:
        """A stage starts: the bar counts the stages done."""
        if name in self.stages:
            self.index = max(self.index, self.stages.index(name))
        self._show(self.index, stage=name, step="")

    def probe_step(self, mode: str, step: int, steps: int) -> None:
        """A probe's step starts: its place among the probe steps the stage planned (every probe step of the
        diagnosis reports itself, see :mod:`fp16doctor.engine.progress`), and the bar's share of the stage
        (never moving back, so that the estimate of the time left follows the work done)."""
        done = min(step, steps) / max(steps, 1)
        self._show(self.index + 0.9 * done, step=f"{mode} step {min(step + 1, steps)}/{steps}")

    def _show(self, completed: float, **fields: Any) -> None:
        if self.progress is None or self.task is None:
            return
        current = self.progress.tasks[0].completed
        # drawn now, not at the next tick: a stage or a probe of a small model can end within one
        self.progress.update(self.task, completed=max(current, completed), refresh=True, **fields)


class TrainingProgress:
    """A training run's steps: done of total, the last loss and scale, skipped steps, steps per second."""

    def __init__(self, console: Console, steps: int):
        columns = [
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
        ]
        self.progress = Progress(*columns, console=console, transient=False)
        self.task = self.progress.add_task("train", total=steps, completed=0, stats="")
        self.skipped = 0
        self.seen = 0
        self.started: float | None = None

    def __enter__(self) -> TrainingProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def step(self, row: dict[str, Any]) -> None:
        """One step's record (:meth:`fp16doctor.run.train.Trainer.run` calls it after each)."""
        self.started = self.started or time.perf_counter()
        self.seen += 1
        self.skipped += int(row["skipped"])
        rate = self.seen / max(time.perf_counter() - self.started, 1e-9)
        stats = f"loss {row['loss']:.4g}  scale {row['loss_scale']:.0f}  skipped {self.skipped}  {rate:.1f} it/s"
        self.progress.update(self.task, completed=row["step"] + 1, stats=stats)
