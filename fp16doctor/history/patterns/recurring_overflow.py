"""Skips keep coming after the scale settled.

At a regular interval, with the scale back where it was between them, they are the scaler's growth overshooting
(``scale-growth``: it doubles every ``growth_interval`` clean steps and overflows right after; the interval
between the skips is about that ``growth_interval``). Past a quarter of the steps, irregular, they are a scale
that stays too high (``scale-overflow``, as that rule's ``PERSISTENT_OVERFLOW_SHARE``). Below that, the
``skips`` symptom alone: ``RECURRING_SKIPS`` skips making up ``RECURRING_SHARE`` of the steps, as the doctor
measures it. Regular skips count once they cost ``SCALE_GROWTH_SHARE`` of the steps: a default GradScaler skips
about once per 2000 steps, and that is its growth working.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...measure.thresholds import (
    PERSISTENT_OVERFLOW_SHARE,
    RECURRING_SHARE,
    RECURRING_SKIPS,
    SCALE_GROWTH_RECURRENCES,
    SCALE_GROWTH_SHARE,
)
from ..records import History
from . import Certainty, LogFinding, Pattern, PatternEvidence
from ._series import first_taken_row, runs, skipped_steps

REGULAR_SPREAD = 0.5
"""Gaps between skips whose standard deviation is under half their mean recur at an interval (a scaler's growth
is a fixed count of clean steps)."""


@dataclass(frozen=True)
class RecurringOverflowEvidence(PatternEvidence):
    """The skips after the first step the optimizer took, and how regularly they came."""

    skipped_after_settling: int
    steps_after_settling: int
    share: float
    """Skipped over attempted steps after settling."""
    recurrences: int
    """Separate runs of skips."""
    median_gap: float | None
    """The median number of steps from one run of skips to the next (about the growth_interval when regular)."""
    regular: bool
    """The gaps spread less than half their mean."""
    scale_holds: bool | None
    """The scale at the last skip is no lower than a quarter of the first one's (the growth brings it back);
    None: the log has no scale."""


class RecurringOverflow(Pattern):
    name = "recurring-overflow"
    evidence_type: ClassVar[type[PatternEvidence]] = RecurringOverflowEvidence
    needs = ()
    subsumed_by = ("scale-collapse", "nonfinite-loss")

    def check(self, history: History) -> list[LogFinding]:
        taken = first_taken_row(history)
        if taken is None:
            return []
        settled_at = int(history.step[taken])
        later = [s for s in skipped_steps(history) if s > settled_at]
        attempted = int(history.span[taken + 1 :].sum()) if taken + 1 < len(history) else 0
        if len(later) < RECURRING_SKIPS or attempted == 0 or len(later) / attempted < SCALE_GROWTH_SHARE:
            return []
        share = len(later) / attempted
        groups = runs(later)
        gaps = [b[0] - a[-1] for a, b in zip(groups, groups[1:])]
        regular = len(gaps) >= SCALE_GROWTH_RECURRENCES and statistics.pstdev(gaps) < REGULAR_SPREAD * (
            sum(gaps) / len(gaps)
        )
        holds = self._scale_holds(history, later)
        if not (regular and holds is not False) and share < RECURRING_SHARE:
            return []
        evidence = RecurringOverflowEvidence(
            skipped_after_settling=len(later),
            steps_after_settling=attempted,
            share=round(share, 4),
            recurrences=len(groups),
            median_gap=float(statistics.median(gaps)) if gaps else None,
            regular=regular,
            scale_holds=holds,
        )
        where = f"{len(later)} skipped of {attempted} steps after step {settled_at}, in {len(groups)} runs"
        if regular and holds is not False:
            return [
                self.finding(
                    f"Skips recur every ~{statistics.median(gaps):.0f} steps ({where}): the scale grows past "
                    "what the gradients allow, again and again",
                    later,
                    Certainty.LIKELY,
                    "Skips at a regular interval with the scale climbing back between them are the scaler's growth "
                    "overshooting; its growth_interval is about the gap. A data pattern repeating at that period "
                    "would look the same.",
                    evidence,
                    cause="scale-growth",
                    symptoms=("skips",),
                )
            ]
        if share >= PERSISTENT_OVERFLOW_SHARE and holds is not False:
            return [
                self.finding(
                    f"{share:.0%} of the steps after settling overflow ({where}): the loss scale stays too high",
                    later,
                    Certainty.LIKELY,
                    "A scale the gradients overflow at on a quarter of the steps is one it keeps returning to: too "
                    "high for them. Overflow from activations would show the same skips; the logs cannot tell.",
                    evidence,
                    cause="scale-overflow",
                    symptoms=("skips",),
                )
            ]
        return [
            self.finding(
                f"Skips recur after the scale settled ({where})",
                later,
                Certainty.SHOWN,
                "The log counts the skips; why they recur, at no regular interval, it does not say.",
                evidence,
                symptoms=("skips",),
            )
        ]

    @staticmethod
    def _scale_holds(history: History, skipped: list[int]) -> bool | None:
        steps, scales = history.column("loss_scale")
        if not len(scales):
            return None
        first = scales[np.searchsorted(steps, skipped[0]).clip(0, len(scales) - 1)]
        last = scales[np.searchsorted(steps, skipped[-1]).clip(0, len(scales) - 1)]
        return bool(last >= first / 4)
