"""Megatron-LM's training log line, every ``--log-interval`` iterations.

Quoted from Megatron-LM's source (``megatron/training/training.py``, ``training_log``), which builds it as::

    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)
    log_string += f' learning rate: {learning_rate:.6E} |'
    log_string += ' {}: {:.6E} |'.format(key, avg)          # 'lm loss', only when avg >= 0.0 (never NaN)
    log_string += f' loss scale: {loss_scale:.1f} |'
    log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(...)
    log_string += ' number of nan iterations: {:3d} |'.format(...)

The loss is the mean over the interval's iterations that were not skipped; the counts are the interval's.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import ClassVar

from ..records import HistoryRow, Quantity
from .text import TextFormat

ITERATION = re.compile(r"\biteration\s+(?P<iteration>\d+)\s*/\s*\d+\s*\|")
KEYS = {
    "lr": " learning rate: ",
    "loss": " lm loss: ",
    "loss_scale": " loss scale: ",
    "grad_norm": " grad norm: ",
    "skipped": " number of skipped iterations: ",
    "nonfinite": " number of nan iterations: ",
}
"""The fields read, as ``training_log`` writes them (each ends at the next ``|``)."""
OTHER_LOSS = re.compile(r"\|\s*([A-Za-z][\w \-]*?loss):\s*([^|]+?)\s*\|")
"""A loss logged under another name (``loss``, ``lm-loss``): the first ``... loss:`` field that is no validation's."""


def fields_of(line: str, start: int) -> dict[str, float]:
    """The fields the doctor reads, found by ``str.find`` (no regular expression per field: a million lines in
    seconds)."""
    found: dict[str, float] = {}
    for name, key in KEYS.items():
        at = line.find(key, start)
        if at < 0:
            continue
        begin = at + len(key)
        end = line.find("|", begin)
        try:
            found[name] = float(line[begin : end if end >= 0 else None])
        except ValueError:
            continue
    if "loss" not in found and "loss:" in line:
        for match in OTHER_LOSS.finditer(line, start - 1):
            if "validation" not in match.group(1):
                try:
                    found["loss"] = float(match.group(2))
                except ValueError:
                    continue
                break
    return found


class MegatronLog(TextFormat):
    """A row per iteration line, covering the iterations since the previous one."""

    name = "megatron"
    title = "Megatron-LM training log (also Megatron-DeepSpeed)"
    source = "Megatron-LM `megatron/training/training.py` (`training_log`)"
    steps = "`iteration` (attempted iterations, skipped ones included); a row per `--log-interval`"
    carries: ClassVar[dict[Quantity, str]] = {
        Quantity.LOSS: "`lm loss` (or the first `... loss`): the interval's mean; left out by Megatron when NaN",
        Quantity.LOSS_SCALE: "`loss scale` (1.0 without a scaler: bf16)",
        Quantity.SKIPPED: "`number of skipped iterations` in the interval (and `number of nan iterations`)",
        Quantity.GRAD_NORM: "`grad norm`",
        Quantity.LR: "`learning rate`",
    }

    def __init__(self) -> None:
        super().__init__()
        self.last_step: int | None = None
        self.held: HistoryRow | None = None
        """The first row, held until the second says how long an interval is (a resumed run starts past 0)."""

    def wants(self, line: str) -> bool:
        return "iteration" in line and "|" in line

    def feed(self, line: str) -> None:
        match = ITERATION.search(line)
        if not match:
            return
        self.matched += 1
        fields = fields_of(line, match.end())
        skipped, nan = fields.get("skipped"), fields.get("nonfinite")
        step = int(match.group("iteration"))
        row = HistoryRow(
            step=step,
            steps=step - self.last_step if self.last_step is not None else 1,
            loss=fields.get("loss"),
            loss_scale=fields.get("loss_scale"),
            skipped=None if skipped is None else int(skipped),
            nonfinite=None if nan is None else int(nan),
            grad_norm=fields.get("grad_norm"),
            lr=fields.get("lr"),
        )
        if self.held is not None:
            self.add(replace(self.held, steps=max(step - self.held.step, 1)))
            self.held = None
        if self.last_step is None:
            self.held = row
        else:
            self.add(row)
        self.last_step = step

    def finish(self) -> None:
        if self.held is not None:
            self.add(self.held)
            self.held = None
