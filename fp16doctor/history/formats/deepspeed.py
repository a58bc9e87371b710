"""DeepSpeed's fp16 messages: an overflow line per skipped step, the progress line, the minimum-scale error.

Quoted from DeepSpeed's source (``deepspeed/runtime/fp16/loss_scaler.py``, ``DynamicLossScaler.update_scale``)::

    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1
    Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.

the fused and unfused fp16 optimizers (``deepspeed/runtime/fp16/fused_optimizer.py``)::

    [deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: 65536, reducing to 32768
    Overflow detected. Skipping step. Attempted loss scale: 65536, reducing to 32768

and the engine's progress line every ``steps_per_print`` steps (``deepspeed/runtime/engine.py``,
``_report_progress``), ``step`` counting attempted steps and ``skipped`` the skipped ones so far::

    [Rank 0] step=100, skipped=7, lr=[0.0001], mom=[(0.9, 0.999)]
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from ..records import SCALE_AT_MINIMUM, HistoryRow, LogEvent, Quantity
from . import NOT_CARRIED
from .text import NUMBER, TextFormat, as_float, first_number

OVERFLOW = re.compile(
    r"(?:OVERFLOW! Rank \d+ Skipping step\.|fp16 dynamic loss scale overflow! Skipping step\.|"
    r"Overflow detected\. Skipping step\.)"
    rf"(?: Attempted loss scale: (?P<attempted>{NUMBER}),"
    rf" (?:reducing to (?P<reduced>{NUMBER})|but hysteresis is \d+))?"
)
PROGRESS = re.compile(r"\bstep=(?P<step>\d+), skipped=(?P<skipped>\d+), lr=\[(?P<lr>[^\]]*)\]")
AT_MINIMUM = "Current loss scale already at minimum"


class DeepSpeedLog(TextFormat):
    """Overflow lines between two progress lines make one row (the steps between them, the skips counted by the
    progress line, the scale the last overflow set); overflow lines after the last progress line (a run that
    stopped) are placed one step apart after it. The scale the first overflow after a progress line attempted is
    the scale the run had at that progress line (DeepSpeed prints no other): its row takes it, so that a fall is
    measured from where it began."""

    name = "deepspeed"
    title = "DeepSpeed fp16 text log (stdout of a DeepSpeed run)"
    source = (
        "DeepSpeed `deepspeed/runtime/fp16/loss_scaler.py` (`DynamicLossScaler.update_scale`), "
        "`deepspeed/runtime/fp16/fused_optimizer.py`, `deepspeed/runtime/engine.py` (`_report_progress`)"
    )
    steps = (
        "`step=N` of the progress line (attempted steps); a row per progress line; overflow lines carry no "
        "step and are counted between progress lines"
    )
    carries: ClassVar[dict[Quantity, str]] = {
        Quantity.LOSS: NOT_CARRIED,
        Quantity.LOSS_SCALE: "`reducing to S` of each overflow line (the scale set after the skip)",
        Quantity.SKIPPED: "`skipped=K` of the progress line; each `OVERFLOW!` line after the last one",
        Quantity.GRAD_NORM: NOT_CARRIED,
        Quantity.LR: "`lr=[...]` of the progress line (the first group's)",
    }

    def __init__(self) -> None:
        super().__init__()
        self.last_step = 0
        self.last_skipped = 0
        self.pending: list[float | None] = []
        """The scale each overflow line since the last progress line set (None: not printed, as for bf16)."""
        self.held: HistoryRow | None = None
        """The last progress line's row, held until the next line says the scale it had."""

    def wants(self, line: str) -> bool:
        return "kipping step" in line or "skipped=" in line or AT_MINIMUM in line

    def feed(self, line: str) -> None:
        if AT_MINIMUM in line:
            self.matched += 1
            self.events.append(LogEvent(SCALE_AT_MINIMUM, self.last_step + len(self.pending) + 1, line.strip()))
            return
        overflow = OVERFLOW.search(line)
        if overflow:
            self.matched += 1
            reduced, attempted = overflow.group("reduced"), overflow.group("attempted")
            if self.held is not None and self.held.loss_scale is None and attempted:
                self.held = dataclasses.replace(self.held, loss_scale=as_float(attempted))
            self._release()
            self.pending.append(as_float(reduced or attempted) if (reduced or attempted) else None)
            return
        progress = PROGRESS.search(line)
        if progress:
            self.matched += 1
            step, skipped = int(progress.group("step")), int(progress.group("skipped"))
            scales = [s for s in self.pending if s is not None]
            counted = skipped - self.last_skipped  # negative after a restart: the overflow lines are what is left
            self._release()
            self.held = HistoryRow(
                step=step,
                steps=max(step - self.last_step, 1),
                loss_scale=scales[-1] if scales else None,
                skipped=counted if counted >= 0 else len(self.pending),
                lr=first_number(progress.group("lr")),
            )
            self.last_step, self.last_skipped, self.pending = step, skipped, []

    def _release(self) -> None:
        if self.held is not None:
            self.add(self.held)
            self.held = None

    def finish(self) -> None:
        self._release()
        if not self.pending:
            return
        self.notes.append(
            f"{len(self.pending)} overflow line(s) after the last progress line: placed one step apart from step "
            f"{self.last_step + 1} (DeepSpeed prints no step with them)"
        )
        for i, scale in enumerate(self.pending, 1):
            self.add(HistoryRow(step=self.last_step + i, loss_scale=scale, skipped=1))
        self.pending = []
