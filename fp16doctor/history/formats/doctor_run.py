"""``fp16doctor train``'s ``metrics.csv``: every quantity, one row per step."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ..records import HistoryBuilder, HistoryRow, Quantity
from . import Reader, Reading, csv_rows

DOCTOR_COLUMNS = ["step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "nonfinite", "seconds", "micro_step"]
"""The header ``fp16doctor.run.train`` writes (``METRIC_COLUMNS``)."""


class DoctorRunMetrics(Reader):
    """The run directory's ``metrics.csv``; gradient-accumulation micro-steps (no optimizer step) are left out."""

    name = "fp16doctor-train"
    title = "`fp16doctor train`'s `metrics.csv`"
    source = "fp16doctor `fp16doctor/run/train.py` (`METRIC_COLUMNS`)"
    steps = "one row per optimizer step; accumulation micro-steps are left out"
    carries: ClassVar[dict[Quantity, str]] = {
        Quantity.LOSS: "`loss`",
        Quantity.LOSS_SCALE: "`loss_scale`",
        Quantity.SKIPPED: "`skipped`",
        Quantity.GRAD_NORM: "`grad_norm` (unscaled)",
        Quantity.LR: "`lr`",
    }

    @classmethod
    def recognises(cls, path: Path) -> bool:
        return path.suffix.lower() == ".csv" and csv_rows.header(path) == DOCTOR_COLUMNS

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        for row in csv_rows.rows(path):
            step = csv_rows.integer(row.get("step"))
            if step is None or csv_rows.number(row.get("micro_step")) == 1.0:
                continue
            skipped = csv_rows.number(row.get("skipped"))
            builder.add(
                HistoryRow(
                    step=step,
                    loss=csv_rows.number(row.get("loss")),
                    loss_scale=csv_rows.number(row.get("loss_scale")),
                    skipped=None if skipped is None else int(skipped),
                    grad_norm=csv_rows.number(row.get("grad_norm")),
                    lr=csv_rows.number(row.get("lr")),
                )
            )
        return Reading()
