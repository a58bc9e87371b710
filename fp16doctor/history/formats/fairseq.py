"""fairseq's training log: ``train_inner`` stats every ``--log-interval`` updates, one line per overflow.

Quoted from fairseq's source: ``fairseq/trainer.py`` (``Trainer.train_step``) logs each overflow as::

    NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0

with the text of ``fairseq/optim/dynamic_loss_scaler.py`` (``DynamicLossScaler.check_overflow`` raises
``OverflowError("setting loss scale to: " + str(self.loss_scale))``, and at the floor ``FloatingPointError("Minimum
loss scale reached (0.0001). Your loss is probably exploding. ...")``). ``fairseq_cli/train.py`` logs the
``train_inner`` stats through ``fairseq/logging/progress_bar.py``: ``--log-format simple``
(``epoch 001:    100 / 1000 loss=9.2, ..., num_updates=100, lr=0.0005, gnorm=1.23, loss_scale=64, ...``) or
``json`` (``{"epoch": 1, "update": 0.1, "loss": "9.2", ..., "num_updates": "100", ...}``). An overflow does not
count as an update, so the attempted step of a stats line is ``num_updates`` plus the overflows so far.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from ..records import SCALE_AT_MINIMUM, HistoryRow, LogEvent, Quantity
from .text import NUMBER, TextFormat, as_float

OVERFLOW = re.compile(rf"gradient overflow detected, ignoring gradient, setting loss scale to: (?P<scale>{NUMBER})")
AT_MINIMUM = "Minimum loss scale reached"
PAIR = re.compile(rf"(\w+)=({NUMBER})(?=,|\s|$)")


def _stats(line: str) -> dict[str, Any] | None:
    """The stats of a ``train_inner`` line in either format (None: not one)."""
    if "{" in line:
        try:
            stats = json.loads(line[line.index("{") :])
        except ValueError:
            return None
        return stats if isinstance(stats, dict) and "num_updates" in stats else None
    pairs = dict(PAIR.findall(line))
    return pairs if "num_updates" in pairs else None


def _value(stats: dict[str, Any], key: str) -> float | None:
    value = stats.get(key)
    if value is None:
        return None
    try:
        return as_float(str(value))
    except ValueError:
        return None


class FairseqLog(TextFormat):
    """Each stats line makes a row covering the updates and overflows since the previous one; overflow lines
    after the last stats line (a run that stopped) are placed one step apart after it."""

    name = "fairseq"
    title = "fairseq training log (`--log-format simple` or `json`)"
    source = (
        "fairseq `fairseq/trainer.py` (`train_step`: the overflow note), `fairseq/optim/dynamic_loss_scaler.py` "
        "(`check_overflow`), `fairseq/logging/progress_bar.py` (the `train_inner` stats formats)"
    )
    steps = "`num_updates` plus the overflows so far (attempted steps); a row per `train_inner` line"
    carries: ClassVar[dict[Quantity, str]] = {
        Quantity.LOSS: "`loss` (the mean over the log interval)",
        Quantity.LOSS_SCALE: "`loss_scale` of the stats; `setting loss scale to: S` of each overflow line",
        Quantity.SKIPPED: "each `gradient overflow detected` line",
        Quantity.GRAD_NORM: "`gnorm` (the mean over the log interval)",
        Quantity.LR: "`lr`",
    }

    def __init__(self) -> None:
        super().__init__()
        self.overflows = 0
        self.last_step = 0
        self.pending: list[float] = []

    def wants(self, line: str) -> bool:
        return "num_updates" in line or "gradient overflow" in line or AT_MINIMUM in line

    def feed(self, line: str) -> None:
        if AT_MINIMUM in line:
            self.matched += 1
            self.events.append(LogEvent(SCALE_AT_MINIMUM, self.last_step + len(self.pending) + 1, line.strip()))
            return
        overflow = OVERFLOW.search(line)
        if overflow:
            self.matched += 1
            self.overflows += 1
            self.pending.append(as_float(overflow.group("scale")))
            return
        stats = _stats(line)
        if stats is None:
            return
        updates = _value(stats, "num_updates")
        if updates is None:
            return
        self.matched += 1
        step = int(updates) + self.overflows
        self.add(
            HistoryRow(
                step=step,
                steps=max(step - self.last_step, 1),
                loss=_value(stats, "loss"),
                loss_scale=_value(stats, "loss_scale") or (self.pending[-1] if self.pending else None),
                skipped=len(self.pending),
                grad_norm=_value(stats, "gnorm"),
                lr=_value(stats, "lr"),
            )
        )
        self.last_step, self.pending = step, []

    def finish(self) -> None:
        if not self.pending:
            return
        self.notes.append(
            f"{len(self.pending)} overflow line(s) after the last stats line: placed one step apart from step "
            f"{self.last_step + 1}"
        )
        for i, scale in enumerate(self.pending, 1):
            self.add(HistoryRow(step=self.last_step + i, loss_scale=scale, skipped=1))
        self.pending = []
