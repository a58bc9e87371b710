"""The probe's record as plain data: the columns of a step record and one row of it.

Kept apart from :mod:`.probe` so that whatever only reads records (the rules' hand-built cases in
:mod:`fp16doctor.diagnosis.rule_cases`, the symptom definitions) can use them without loading the probe,
its instruments and the precision patches behind them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the trace is the probe's, attached at run time; reading a record never needs it
    from ..precision.recording import StepTrace


class Column:
    """The columns of a probe's step record, by name: readers index a record with these, never a literal."""

    STEP = "step"
    BATCH_INDEX = "batch_index"
    LOSS = "loss"
    GRAD_NORM = "grad_norm"
    LR = "lr"
    LOSS_SCALE = "loss_scale"
    SKIPPED = "skipped"
    OPTIMIZER_STEPPED = "optimizer_stepped"
    MICRO_STEP = "micro_step"
    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRADS = "nonfinite_grads"
    EXCEPTION_TYPE = "exception_type"
    EXCEPTION = "exception"
    EXCEPTION_LOCATION = "exception_location"
    EXCEPTION_MODULE = "exception_module"


RECORD_COLUMNS = [
    Column.STEP,
    Column.BATCH_INDEX,
    Column.LOSS,
    Column.GRAD_NORM,
    Column.LR,
    Column.LOSS_SCALE,
    Column.SKIPPED,
    Column.OPTIMIZER_STEPPED,
    Column.MICRO_STEP,
    Column.NONFINITE_LOSS,
    Column.NONFINITE_GRADS,
    Column.EXCEPTION_TYPE,
    Column.EXCEPTION,
    Column.EXCEPTION_LOCATION,
    Column.EXCEPTION_MODULE,
]
"""``skipped``: an optimizer step was attempted and did not happen (the scaler found inf/NaN);
``micro_step``: no optimizer step was attempted (gradient accumulation); ``optimizer_stepped``: the weights moved."""


@dataclass
class StepRecord:
    """One row of a probe's record (see ``RECORD_COLUMNS``)."""

    step: int
    batch_index: int
    loss: float
    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool
    optimizer_stepped: bool
    micro_step: bool
    nonfinite_loss: bool
    nonfinite_grads: bool
    exception_type: str | None = None
    exception: str | None = None
    exception_location: str | None = None
    exception_module: str | None = None
    """The deepest module of the model whose forward was running when the exception was raised."""
    trace: StepTrace | None = field(default=None, repr=False)

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RECORD_COLUMNS}
