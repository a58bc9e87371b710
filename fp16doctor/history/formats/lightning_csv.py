"""Lightning's ``CSVLogger`` ``metrics.csv``: whatever the module logs, by name, one row per log call."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ...errors import HistoryError
from ..records import HistoryBuilder, HistoryRow, Quantity
from . import Reader, Reading, csv_rows
from .doctor_run import DOCTOR_COLUMNS
from .names import keyed_carries, pick


class LightningMetrics(Reader):
    """A CSV with a ``step`` column and the logged metrics as columns; rows of the same step (Lightning writes one
    per log call: the LR monitor's, the module's) are merged."""

    name = "lightning-csv"
    title = "Lightning `CSVLogger` `metrics.csv` (any CSV with a `step` column)"
    source = "lightning `src/lightning/fabric/loggers/csv_logs.py` (`_ExperimentWriter.log_metrics` adds `step`)"
    steps = "`step` is the trainer's `global_step`; a row per step with `log_every_n_steps=1`, else one per interval"
    carries: ClassVar[dict[Quantity, str]] = keyed_carries()

    @classmethod
    def recognises(cls, path: Path) -> bool:
        if path.suffix.lower() != ".csv":
            return False
        head = csv_rows.header(path)
        return "step" in head and head != DOCTOR_COLUMNS

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        head = csv_rows.header(path)
        keys = pick(head)
        if not keys:
            raise HistoryError(
                f"'{path}' logs none of the quantities the doctor reads (columns: {', '.join(head[:12])}).",
                hint="Log the loss (self.log('train_loss', loss)), and the scale and gradient norm where you can.",
            )
        merged: dict[Quantity, float] = {}
        current: int | None = None
        previous = 0
        for row in csv_rows.rows(path):
            step = csv_rows.integer(row.get("step"))
            if step is None:
                continue
            if current is not None and step != current:
                builder.add(_row(current, previous, merged))
                previous, merged = current, {}
            current = step
            for quantity, key in keys.items():
                value = csv_rows.number(row.get(key))
                if value is not None:
                    merged[quantity] = value
        if current is not None:
            builder.add(_row(current, previous, merged))
        return Reading(notes=[f"columns read: {', '.join(f'{q.value}={k}' for q, k in keys.items())}"])


def _row(step: int, previous: int, values: dict[Quantity, float]) -> HistoryRow:
    skipped = values.get(Quantity.SKIPPED)
    return HistoryRow(
        step=step,
        steps=max(step - previous, 1),
        loss=values.get(Quantity.LOSS),
        loss_scale=values.get(Quantity.LOSS_SCALE),
        skipped=None if skipped is None else int(skipped),
        grad_norm=values.get(Quantity.GRAD_NORM),
        lr=values.get(Quantity.LR),
    )
