"""Input magnitudes that overflow fp16 in the forward pass while fp32 is fine.

Evidence: a floating input field with values in the thousands and up, and the
first non-finite AMP operator fed directly by such magnitudes (fp32 finite), where the
model's own inputs (what its forward is called with, in the FP32 run) hold magnitudes that
large: an extreme field the model never sees is a target, read by the loss.

Found by intervention too: where a few rows hold values extreme enough to break
FP32 as well (a sentinel such as 1e30 for a missing value, a sensor glitch),
the data without those rows repairs FP32 and AMP; where the whole field is
raw, standardising it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ...engine.records import Reading, Table
from ...measure.thresholds import EXTREME_INPUT
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind, evidence_of
from ..verify import Intervention, standardise
from . import Rule
from ._helpers import fp32_finite, model_input_peak


@dataclass(frozen=True)
class ExtremeDataEvidence(EvidenceRecord):
    """The input field with the largest magnitudes, and the localised operator they overflow fp16 in."""

    field: str
    """The field's name in the batch (what the intervention standardises)."""
    abs_max: float
    extreme_share: float
    """The share of the field's values in the thousands and up."""
    module: str | None
    operator: str
    step: int
    batch: int
    operator_input_ranges: list[tuple[float, float]]


class ExtremeData(Rule):
    code = "extreme-data"
    order = 20
    evidence_type: ClassVar[type[EvidenceRecord]] = ExtremeDataEvidence
    explains = ("nonfinite", "skips", "amp-exception", "trajectory-drift")
    repair_explains = ("fp32-nonfinite",)  # rows extreme enough break FP32 too: without them it trains
    repairs = (RepairKind.STANDARDISE, RepairKind.DROP_EXTREME_ROWS)
    names_cases = (
        lambda: (fx.repair("standardise"), fx.evidence()),
        lambda: (fx.repair("drop-extreme-rows", symptoms=("fp32-nonfinite", "nonfinite")), fx.evidence()),
    )
    verifiable = False
    triggers = ("raw_sensor_features.py",)
    fires_on = (
        lambda: fx.evidence(
            data=[fx.field(abs_max=5e4, extreme=300)],
            amp=fx.probe(record=fx.records(skipped=[0, 1])),
            localisation=fx.localisation("forward", "0", "aten::addmm", [(-5e4, 5e4)]),
        ),
        # model(**batch): the forward hook sees no positional input, 0 recorded: unknown, not small
        lambda: fx.evidence(
            data=[fx.field(abs_max=5e4, extreme=300)],
            amp=fx.probe(record=fx.records(skipped=[0, 1])),
            fp32=fx.probe(
                "fp32",
                tables={
                    Table.FORWARD: pd.DataFrame(
                        [{Reading.MODULE: "<root>", Reading.ABS_MAX: 3.0, Reading.INPUT_ABS_MAX: 0.0}]
                    )
                },
            ),
            localisation=fx.localisation("forward", "0", "aten::addmm", [(-5e4, 5e4)]),
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            data=[fx.field(abs_max=8.0)], localisation=fx.localisation("forward", "0", "aten::addmm", [(-8.0, 8.0)])
        ),
        # a regression target of 3.2e5 the model never sees; its own forward un-normalises to that scale
        lambda: fx.evidence(
            data=[fx.field(abs_max=3.2e5, extreme=300)],
            amp=fx.probe(record=fx.records(skipped=[0, 1])),
            fp32=fx.probe(
                "fp32",
                tables={
                    Table.FORWARD: pd.DataFrame(
                        [{Reading.MODULE: "<root>", Reading.ABS_MAX: 3.2e5, Reading.INPUT_ABS_MAX: 4.1}]
                    )
                },
            ),
            localisation=fx.localisation("forward", "<root>", "aten::add", [(-6e4, 6e4)]),
        ),
    )
    suppresses = (
        "activation-overflow",
        "scale-overflow",
        "scheduler-skip-drift",
        "fp32-loss-rises",
    )  # inputs that large make a large loss

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        """For the rows dropped: which field holds the extreme values, and what they broke."""
        extreme = [f for f in ev.data if f.floating and not f.nonfinite and f.abs_max >= EXTREME_INPUT]
        if repair.kind != RepairKind.DROP_EXTREME_ROWS or not extreme:
            return super().repair_title(repair, ev)
        field = max(extreme, key=lambda f: f.abs_max)
        broke = "FP32 and AMP" if "fp32-nonfinite" in repair.symptoms else "AMP"
        return (
            f"A few rows of '{field.field}' hold values up to {field.abs_max:.3g} ({field.extreme_share:.2%} of its "
            f"values past {EXTREME_INPUT:g}): they break {broke}; {repair.description} train finite"
        )

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        if repair.kind != RepairKind.DROP_EXTREME_ROWS:
            return super().repair_fix(repair, ev)
        return (
            f"Drop or repair the rows whose values are extreme before the model sees them (measured: "
            f"{repair.description} trains finite in FP32 and AMP): a sentinel for a missing value (1e30, "
            "float32's max) or a glitch, then standardise the field.",
            "# in data(): drop the rows holding a sentinel or an outlier\n"
            f"keep = (x.abs() < {EXTREME_INPUT:g}).flatten(1).all(1)\n"
            "x, y = x[keep], y[keep]",
        )

    def intervention(self, finding: Finding, ev: Evidence) -> Intervention:
        field = evidence_of(finding, ExtremeDataEvidence).field
        return Intervention(f"the batches with '{field}' standardised per feature", batches=standardise(field))

    def check(self, ev: Evidence) -> list[Finding]:
        extreme = [f for f in ev.data if f.floating and not f.nonfinite and f.abs_max >= EXTREME_INPUT]
        loc = ev.localisation
        if not extreme or loc is None or loc.phase != "forward" or not fp32_finite(ev):
            return []
        fed = max((max(abs(lo), abs(hi)) for lo, hi in loc.input_ranges), default=0.0)
        if fed < EXTREME_INPUT:
            return []
        entering = model_input_peak(ev.fp32)
        if entering is not None and entering < EXTREME_INPUT:
            return []  # the model's own inputs are small: the extreme field is a target the loss reads
        field = max(extreme, key=lambda f: f.abs_max)
        return [
            self.finding(
                f"Raw inputs up to {field.abs_max:.3g} in '{field.field}' overflow fp16 in module '{loc.module}' ({loc.operator})",
                ExtremeDataEvidence(
                    field=field.field,
                    abs_max=field.abs_max,
                    extreme_share=field.extreme_share,
                    module=loc.module,
                    operator=loc.operator,
                    step=loc.step,
                    batch=loc.batch_index,
                    operator_input_ranges=loc.input_ranges,
                ),
                Fix(
                    f"Standardise '{field.field}' (zero mean, unit variance per feature) before the model sees it.",
                    code=(
                        "# compute once over the training set, then in data():\n"
                        "mean, std = features.mean(0), features.std(0).clamp_min(1e-6)\n"
                        "x = (x - mean) / std"
                    ),
                ),
                confidence=0.9,
            )
        ]
