"""The loss scale collapses: halving at skip after skip, far below its highest.

Two readings, as the doctor's rules make them. A scale that halves from its first step and settles once it is
low enough (clean steps follow, above the floor) started too high: ``scale-overflow``, as that rule counts more
than ``CALIBRATION_SKIPS`` settling skips. A scale that falls to the floor (1, or the framework's "already at
minimum" message) after the training ran clean is no scale too high: every step overflows at any scale, the
gradients are non-finite whatever the scale (activations or weights overflowed, the loss exploded, a NaN came
in); the symptoms are there, the cause is for a diagnosis from the checkpoint before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...measure.thresholds import CALIBRATION_SKIPS, COLLAPSE_HALVINGS, COLLAPSED_SCALE
from ..records import SCALE_AT_MINIMUM, History
from . import Certainty, LogFinding, Pattern, PatternEvidence
from ._series import first_taken_row, power_of_two, skipped_steps


@dataclass(frozen=True)
class ScaleCollapseEvidence(PatternEvidence):
    """The scale's fall: from where, to where, in how many skips."""

    highest_scale: float
    """The highest scale logged before the fall."""
    lowest_scale: float
    """The lowest scale logged after it (NaN where only the framework's message says it)."""
    halvings: float
    """log2 of highest over lowest."""
    skipped_in_fall: int
    """Skipped steps from the highest scale to the lowest."""
    at_minimum_message: str | None
    """The framework's own message that the scale cannot go lower, where the log has one."""
    settled: bool
    """The scale stopped falling above the floor and clean steps followed (the settling of a scale too high)."""


class ScaleCollapse(Pattern):
    name = "scale-collapse"
    evidence_type: ClassVar[type[PatternEvidence]] = ScaleCollapseEvidence
    needs = ()

    def applies(self, history: History) -> bool:
        return history.has("loss_scale") or any(e.kind == SCALE_AT_MINIMUM for e in history.events)

    def check(self, history: History) -> list[LogFinding]:
        message = next((e for e in history.events if e.kind == SCALE_AT_MINIMUM), None)
        steps, scales = history.column("loss_scale")
        positive = scales > 0
        steps, scales = steps[positive], scales[positive]
        skipped = skipped_steps(history)
        if len(scales) < 2:
            if message is None:
                return []
            return [self._at_minimum_only(message.step or history.last_step() or 0, message.message, skipped)]
        taken = first_taken_row(history)
        taken_step = None if taken is None else int(history.step[taken])
        # a fresh scaler's settling skips before its first step taken are not the fall: it starts from there on
        settling = [s for s in skipped if taken_step is None or s < taken_step]
        past_settling = taken_step is not None and len(settling) <= CALIBRATION_SKIPS
        begin = min(int(np.searchsorted(steps, taken_step or 0)), len(scales) - 1) if past_settling else 0
        peak = begin + int(np.argmax(scales[begin:]))
        low = peak + int(np.argmin(scales[peak:]))
        halvings = math.log2(scales[peak] / scales[low]) if scales[low] > 0 else math.inf
        at_floor = scales[low] <= COLLAPSED_SCALE or message is not None
        start, end = int(steps[peak]), int(steps[low])
        after = taken_step if past_settling and taken_step is not None else start - 1
        in_fall = [s for s in skipped if max(start, after + 1) <= s <= end + 1]
        leading = taken_step is None or taken_step >= end
        settled = not at_floor and leading and low < len(scales) - 1
        if settled and len(in_fall) > CALIBRATION_SKIPS:
            return [self._settling(history, start, end, float(scales[peak]), float(scales[low]), halvings, in_fall)]
        if halvings < COLLAPSE_HALVINGS or not at_floor:
            return []
        evidence = ScaleCollapseEvidence(
            highest_scale=float(scales[peak]),
            lowest_scale=float(scales[low]),
            halvings=round(halvings, 2),
            skipped_in_fall=len(in_fall),
            at_minimum_message=message.message if message else None,
            settled=False,
        )
        nonfinite = bool(history.nonfinite()[(history.step >= start) & (history.step <= end + 1)].any())
        first, last = (in_fall[0], in_fall[-1]) if in_fall else (start, end)
        return [
            self.finding(
                f"The loss scale fell from {power_of_two(scales[peak])} to {power_of_two(scales[low])} "
                f"({len(in_fall)} skipped steps, steps {first}..{last}): every step overflows at any scale",
                in_fall or [start, end],
                Certainty.SHOWN,
                "The log shows the scale halving at each skip down to the floor. A scale that low still overflowing "
                "means the gradients are non-finite whatever the scale (activations or weights overflowed, the loss "
                "exploded, a NaN came in): not a scale too high. Which one, the logs cannot say.",
                evidence,
                symptoms=("skips", "nonfinite") if nonfinite or message else ("skips",),
            )
        ]

    def _settling(
        self, history: History, start: int, end: int, high: float, low: float, halvings: float, in_fall: list[int]
    ) -> LogFinding:
        evidence = ScaleCollapseEvidence(high, low, round(halvings, 2), len(in_fall), None, True)
        return self.finding(
            f"The loss scale took {len(in_fall)} skipped steps to settle from {power_of_two(high)} to "
            f"{power_of_two(low)} (steps {start}..{end}): the initial scale is too high",
            in_fall,
            Certainty.LIKELY,
            f"A fresh scaler settles in up to {CALIBRATION_SKIPS} skips; this one needed {len(in_fall)} and then "
            "trained clean at the lower scale, as a too-high init_scale does. A loss summed over the batch makes "
            "gradients that large too.",
            evidence,
            cause="scale-overflow",
            symptoms=("skips",),
        )

    def _at_minimum_only(self, step: int, message: str, skipped: list[int]) -> LogFinding:
        evidence = ScaleCollapseEvidence(math.nan, math.nan, math.nan, len(skipped), message, False)
        return self.finding(
            f"The scaler reached its minimum scale at step {step} and the run stopped: every step overflows at "
            "any scale",
            skipped or [step],
            Certainty.SHOWN,
            "The framework's own message says the scale cannot go lower; a scale at its floor still overflowing "
            "means the gradients are non-finite whatever the scale. The logs do not say why.",
            evidence,
            symptoms=("skips", "nonfinite"),
        )
