"""What the measurements produce, as plain data: where a non-finite value came from, the loss-scale window,
the exception a probe raised.

Kept apart from the measuring code (:mod:`.localise`, :mod:`.numerics`, which drive the probe) so that
whatever only reads these records (the rules and their hand-built cases, the renderers) loads neither the
probe nor its instruments. Only the standard library, pandas and the probe's plain records here (whose
table and column names are re-exported for the renderers, which sit above the engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from ..engine.emulated_ranks import REDUCTION
from ..engine.records import Column as Column
from ..engine.records import Inventory as Inventory
from ..engine.records import Reading as Reading
from ..engine.records import Table as Table

INFINITE_AT_ZERO = frozenset(
    {
        "aten::div",
        "aten::div_",
        "aten::true_divide",
        "aten::reciprocal",
        "aten::rsqrt",
        "aten::log",
        "aten::log2",
        "aten::log10",
        "aten::addcdiv",
        "aten::xlogy",
        "aten::pow",
    }
)
"""Operators that make an infinity from a finite argument that reached 0 (x / 0, log 0, 0 ** -1): not a result past
fp16's range."""
OUTSIDE_MODEL = "<loss: outside the model>"
ROOT = "<root>"
"""The model's own forward code, outside its submodules (what the instruments name the root module)."""
OMITTED_WHEN_NONE = "fp16doctor_omitted_when_none"
"""A field's metadata key: its JSON key is left out while it is None (the findings' ``omitted_when_none``)."""
FP16_MAX_VALUE = 65504.0
"""fp16's largest finite value (``fp16doctor.tensors.FP16_MAX``, repeated: this module loads no torch)."""


class GradientColumn:
    """The columns of the per-tensor gradient tables (the scale window's, observed and predicted underflow), by
    name: one row per gradient tensor, keyed by (kind, name)."""

    KIND = "kind"
    """``activation`` or ``param``: a module output's gradient or a parameter's."""
    NAME = "name"
    ABS_MAX = "abs_max"
    RMS = "rms"
    NEGLIGIBLE = "negligible"
    """The gradient is rounding noise, many orders below its kind's median RMS: its flushing is no loss."""
    QUANTILE_SMALL = "quantile_small"
    MIN_SCALE = "min_scale"
    MAX_SCALE = "max_scale"
    SCALE = "scale"
    OBSERVED_UNDERFLOW = "observed_underflow"
    """The share of FP32's nonzero elements that are zero in AMP's gradient."""
    OBSERVED_UNDERFLOW_MASS = "observed_underflow_mass"
    """The share of FP32's gradient L1 mass that is zero in AMP's."""
    PREDICTED_UNDERFLOW = "predicted_underflow"
    """The share of the gradient's nonzero elements that would flush to zero at the loss scale."""
    PREDICTED_UNDERFLOW_MASS = "predicted_underflow_mass"


@dataclass(frozen=True)
class FlushedConstant:
    """A Python number the traced forward gave an operator (a clamp bound, an epsilon added, a fill value) that is 0
    in the operator's low-precision dtype: 1e-10 is 0 in float16. Recorded on the culprit's input that the
    operator made, seen through casts and views."""

    value: float
    """The constant as the code wrote it."""
    in_dtype: float
    """What it is in ``dtype``: 0.0 (below half its smallest subnormal). A constant past the largest finite value is
    the ``input_constants`` record's."""
    dtype: str
    """The low-precision dtype the operator ran in (``float16``)."""
    operator: str
    """The operator it was given, which made the culprit's input (``aten::clamp``)."""
    input: int
    """Which of the culprit's inputs that operator made."""
    location: str | None = None
    """``file:line`` of the code outside PyTorch and the doctor that called that operator."""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}  # every field, in order: the docs read this shape


@dataclass
class Localisation:
    """Where the first non-finite value came from."""

    step: int
    batch_index: int
    phase: str
    """data | forward | loss | backward | optimizer"""
    module: str | None
    operator: str
    input_ranges: list[tuple[float, float]]
    output: str
    """What came out: "nan", "+inf", "-inf" or a mix, and its dtype."""
    note: str = ""
    mode: str = "amp"
    peak: float | None = None
    """The largest magnitude of the result that overflowed when rounded to low precision, when it was seen."""
    scalars: list[float] = field(default_factory=list)
    """The Python numbers the culprit operator was called with (a mask's fill value, a scale)."""
    input_spreads: list[int] = field(default_factory=list)
    """Per input, how many distinct values beyond fp16's range it holds, at about three significant digits (0: none;
    counted up to 64): a constant fill (a mask's -1e9, ``finfo(float32).min``) shows one or two, an activation
    that grew past 65504 many."""
    input_constants: list[bool | None] = field(default_factory=list)
    """Per input, where the traced step made it: True when it carries a constant beyond fp16's range (a fill with
    a Python number, or arithmetic on one: ``(1 - mask) * finfo(float32).min``), False when an operator computed it
    (an ``exp``, a matmul: an activation, however few distinct values it holds), None when the step did not make
    it (a parameter, a buffer, a batch field: its spread tells)."""
    parameter: str | None = None
    """The model parameter whose cast to low precision overflowed, when the culprit is one (a weight fp16 cannot
    hold: not a constant in the code)."""
    autograd_node: str | None = None
    """In backward: the autograd node that ran the culprit op (``MulBackward0``, or a custom Function's)."""
    custom_function: str | None = None
    """In backward: the ``torch.autograd.Function`` subclass whose hand-written ``backward`` made it, if any."""
    loss_scale: float | None = None
    """The loss scale the traced step's backward ran with (1 where the step never called ``scaler.scale``): a
    backward value divided by it is what fp16 would have had to hold unscaled. None where no step was traced
    from the start (an absorbed overflow's forward)."""
    flushed_constant: FlushedConstant | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    """The Python number that made one of the culprit's inputs and that its low-precision dtype cannot hold (a
    clamp's ``min=1e-10``, 0 in fp16), when one did; omitted from the JSON when none did."""
    line: str | None = field(default=None, metadata={OMITTED_WHEN_NONE: True})
    """``file:line`` of the code that called the culprit operator, in the forward or the loss: the training file's
    line where one is on the stack, else the deepest outside PyTorch and the doctor (a library's model). Omitted
    in the backward (autograd ran it: ``autograd_node`` says which) and where no line called it."""
    replayed: list[tuple[float, float]] = field(default_factory=list, repr=False)
    """(loss, loss scale) of each step the replay took before the traced one: compared with the original
    run's, they tell whether the fault reproduces deterministically."""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "replayed" and not (v is None and k in _OMITTED)}

    @property
    def place(self) -> str:
        """Where, as prose reads it: ``module '6' (forward)``, ``the optimizer``. Module names are quoted: a
        Sequential's children are numbers ("in 6" reads as a count)."""
        outside = {"optimizer": "the optimizer", "data": "the data", "loss": "the loss", "reduction": REDUCTION}
        at = f" at {Path(self.line).name}" if self.line else ""
        if not self.module:
            return outside.get(self.phase, f"the {self.phase}") + at
        if self.module == OUTSIDE_MODEL:
            return "the loss computation, outside the model" + (f" ({self.phase})" if self.phase != "loss" else at)
        if self.module == ROOT:
            return "the model's own forward code, outside its submodules" + (
                at if self.phase == "forward" else f" ({self.phase})"
            )
        return f"module '{self.module}' ({self.phase}{at.replace(' at ', ', at ')})"

    @property
    def overflowed(self) -> bool:
        """Whether the culprit left a range: it made an infinity, a result past fp16's 65504 was seen, or an input
        already lay beyond it. A NaN made from finite inputs inside fp16's range (the square root of a variance
        that cancellation drove below 0) is rounding's, not range's."""
        return "inf" in self.output or self._past_range_seen

    @property
    def _past_range_seen(self) -> bool:
        """A result past 65504 was seen, or an input already lay beyond it."""
        if self.peak is not None and self.peak >= FP16_MAX_VALUE:
            return True
        return any(not (abs(lo) < FP16_MAX_VALUE and abs(hi) < FP16_MAX_VALUE) for lo, hi in self.input_ranges)

    @property
    def made_past_range(self) -> bool:
        """Whether the culprit's result itself left fp16's range: a result past 65504 was seen, an input already lay
        beyond it, or it made an infinity by anything but dividing by (or taking the log of) a value that reached 0,
        whose infinity tells of its argument's size, not its result's."""
        return self._past_range_seen or ("inf" in self.output and self.operator.split(".")[0] not in INFINITE_AT_ZERO)

    def inside(self, modules: list[str]) -> bool:
        """The culprit ran in one of ``modules`` or in a module inside one of them."""
        return any(self.module == m or (self.module or "").startswith(m + ".") for m in modules)

    def describe(self) -> str:
        note = f"; {self.note}" if self.note else ""
        at = f"at step {self.step}, batch {self.batch_index}"
        if self.phase == "data":  # no operator made it: the batch arrived so
            return f"{self.operator or 'the batch'} {at}: {self.output}{note}"
        ranges = ", ".join(f"[{lo:.4g}, {hi:.4g}]" for lo, hi in self.input_ranges)
        read = f"inputs {ranges}" if ranges else "no floating input"  # a factory, or inputs already non-finite
        return f"{self.operator} in {self.place} {at}: {read} -> {self.output}{note}"


_OMITTED = frozenset(f.name for f in fields(Localisation) if OMITTED_WHEN_NONE in f.metadata)


@dataclass
class ScaleWindow:
    """The loss scales that keep gradients representable in fp16, per tensor and overall."""

    per_tensor: pd.DataFrame
    low: float
    """Smallest scale keeping 99.9% of every tensor's gradient mass (max over tensors carrying signal)."""
    high: float
    """Largest scale keeping every gradient under 65504 (min over tensors)."""

    @property
    def feasible(self) -> bool:
        return self.low <= self.high

    def worst_signal_underflow(self, predicted: pd.DataFrame) -> float:
        """The largest predicted underflow mass (:func:`~fp16doctor.measure.numerics.predicted_underflow`) over the
        tensors carrying signal: a gradient that is rounding noise flushes whole at any scale, and the window
        ignores it (its low bound), so a 100% there is no underflow to act on."""
        if predicted is None or not len(predicted):
            return 0.0
        frame = self.per_tensor
        if frame is not None and len(frame) and GradientColumn.NEGLIGIBLE in frame:
            noise = set(
                zip(
                    frame.loc[frame[GradientColumn.NEGLIGIBLE].astype(bool), GradientColumn.KIND],
                    frame.loc[frame[GradientColumn.NEGLIGIBLE].astype(bool), GradientColumn.NAME],
                )
            )
            predicted = predicted[
                [(k, n) not in noise for k, n in zip(predicted[GradientColumn.KIND], predicted[GradientColumn.NAME])]
            ]
        return float(predicted[GradientColumn.PREDICTED_UNDERFLOW_MASS].max()) if len(predicted) else 0.0

    def recommended(self) -> float:
        """A power of two inside the window, 8x below the top for headroom (gradients grow in training)."""
        if not self.feasible:
            return float(max(2 ** round(math.log2(max(self.high, 1.0))), 1))
        top = 2 ** math.floor(math.log2(self.high))
        candidate = top / 8
        chosen = max(candidate, 2 ** math.ceil(math.log2(self.low))) if candidate >= self.low else top
        return float(max(chosen, 1))  # GradScaler never needs to shrink the loss


@dataclass
class ExceptionInfo:
    """The first exception a probe's training raised: at which step, what, and where in the user's code."""

    step: int
    """The probe step that raised."""
    type: str
    """The exception's class name (``RuntimeError``)."""
    message: str | None
    """The exception's message."""
    location: str | None
    """``file:line`` of the user's frame that raised it (or the innermost frame outside torch)."""
    module: str | None = None
    """The deepest module of the model whose forward was running, when one was."""

    def to_json(self) -> dict[str, Any]:
        """The documented shape: ``step``, ``type``, ``message``, ``location``, and ``module`` when known."""
        out: dict[str, Any] = {"step": self.step, "type": self.type, "message": self.message, "location": self.location}
        if self.module is not None:
            out["module"] = self.module
        return out


@dataclass(frozen=True)
class SiteShare:
    """One line of the user's code and its share of a same-state loss gap: the rounding error its operators add
    in half precision (each recomputed in fp32 from its actual inputs), weighted by the loss's sensitivity to
    their outputs (:mod:`fp16doctor.measure.attribution`)."""

    site: str
    """The line, ``file:line`` (the training file's folder's files by their path from there)."""
    module: str
    """Whose code the line is: a module's path, ``<root>`` for the model's own forward, ``<loss: outside the
    model>`` for the loss."""
    operators: list[str]
    """The torch operators the line ran in half precision (``mul``, ``add``, ``linear``), in their first order."""
    share: float
    """The line's share of the gap (AMP's loss minus FP32's on the same state), from its weighted error."""
    own_share: float
    """The share of the operators the line's own code runs, leaving out those inside the submodules it calls
    (``inside``): what computing the line in fp32 changes beyond keeping those modules in fp32."""
    inside: list[str]
    """The submodules whose operators the line's calls ran (``self.encoder(x)`` runs the encoder's): their errors
    count in ``share``; empty where every operator is the line's own."""
    weighted_error: float
    """The loss change its rounding errors make: the sum over its operators of the error times the loss's gradient
    with respect to their output, the mean of FP32's and AMP's gradients (exact for a quadratic loss)."""
    first_order: float | None
    """The same with FP32's gradient alone (the first-order term); None where no operator of the line was
    matched in the FP32 pass."""
    code: str | None = None
    """The line's source text, stripped; None where it cannot be read."""
    lower_precision: bool = False
    """One of its operators is on autocast's lower-precision list (a matmul, a linear, a convolution): autocast
    casts its inputs down again, so only a region with autocast off keeps it in fp32."""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}  # every field, in order: the docs read this shape


@dataclass(frozen=True)
class OperatorAttribution:
    """Every operator of one AMP step that ran in half precision, recomputed in fp32, its rounding error weighted
    by the loss's gradient and summed by the line of the user's code that called it; the lines ranked by their
    share of the same-state gap."""

    loss_amp: float
    """AMP's loss on the state (the attribution's own AMP pass)."""
    loss_fp32: float
    """FP32's loss on the same state and batch."""
    explained: float
    """The sum of every line's share: how much of the gap the first-order-in-the-error account covers (near 1 where
    the loss is close to quadratic in what rounding changed)."""
    operators: int
    """Operators of the AMP forward whose half-precision result differs from its fp32 recomputation: those that
    added a rounding error."""
    unmatched: int
    """Of those, how many were not found in the FP32 pass (the same program order on the same state gives the
    same sequence; control flow that depends on values can change it): their weight is AMP's gradient alone."""
    sites: list[SiteShare]
    """The lines with the largest shares, the largest first (at most eight)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "loss_amp": self.loss_amp,
            "loss_fp32": self.loss_fp32,
            "explained": self.explained,
            "operators": self.operators,
            "unmatched": self.unmatched,
            "sites": [s.to_json() for s in self.sites],
        }
