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


class Table:
    """The probe's instrument tables (``ProbeSummary.tables``), by name: one row per module or parameter and step."""

    FORWARD = "forward"
    """Each module's output (and its inputs') range and non-finite counts."""
    ACTIVATION_GRADS = "activation_grads"
    """The gradient flowing into each module's output, at the loss scale."""
    PARAM_GRADS = "param_grads"
    """Each parameter's gradient: its norm, range, zero and underflow shares."""
    UPDATES = "updates"
    """Each parameter's optimizer update against its weight, and the share of it that rounding lost."""


class Reading:
    """The columns of the instrument tables (:class:`Table`), by name: readers index them with these."""

    STEP = "step"
    MODULE = "module"
    """The module's dotted path (``<root>`` for the model itself): forward and activation-gradient rows."""
    PARAM = "param"
    """The parameter's dotted name: parameter-gradient and update rows."""
    DTYPE = "dtype"
    ORDER = "order"
    """The module's place in the step's execution order."""
    NUMEL = "numel"
    ABS_MAX = "abs_max"
    NAN = "nan"
    POSINF = "posinf"
    NEGINF = "neginf"
    INPUTS_FINITE = "inputs_finite"
    INPUT_ABS_MAX = "input_abs_max"
    LOSS_SCALE = "loss_scale"
    GRAD_NORM = "grad_norm"
    ZERO_SHARE = "zero_share"
    UNDERFLOW_AT_SCALE = "underflow_at_scale"
    GRAD_ABS_MAX = "grad_abs_max"
    UNDERFLOW_MASS_AT_SCALE = "underflow_mass_at_scale"
    LOST_UPDATE_SHARE = "lost_update_share"
    """The share of the update's elements that rounding to the weight's dtype lost (the weight did not move)."""
    UPDATE_TO_WEIGHT = "update_to_weight"
    """The update's norm over the weight's."""
    NONFINITE = (NAN, POSINF, NEGINF)
    """The columns counting non-finite elements, by kind."""


class Inventory:
    """The columns of the module inventory (one row per module: how it is stored, computed and trained)."""

    MODULE = "module"
    TYPE = "type"
    """The module's class name."""
    LIBRARY = "library"
    """The class comes from a library (torch, transformers...), not the user's code."""
    COMPUTE_DTYPE = "compute_dtype"
    PARAM_DTYPES = "param_dtypes"
    """Comma-joined dtypes of the module's own parameters; None where it has none."""
    BUFFER_DTYPES = "buffer_dtypes"
    OPTIMIZER_STATE_DTYPES = "optimizer_state_dtypes"
    TRAINED_PARAM_DTYPES = "trained_param_dtypes"
    """The dtypes of the parameters an optimizer trains."""
    FROZEN = "frozen"
    """It has parameters and no optimizer trains any."""


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
