"""A streak of skipped steps after the scale settled: the optimizer stood still for several steps in a row.

``SKIP_STREAK`` in a row (the watch's default alarm) past the first step taken; the leading skips of a fresh
scaler settling are the scale collapse's to read. A streak that ends a collapse, a climbing gradient norm or the
LR's jump is that finding's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...measure.thresholds import SKIP_STREAK
from ..records import History
from . import Certainty, LogFinding, Pattern, PatternEvidence
from ._series import first_taken_row, runs, skipped_steps


@dataclass(frozen=True)
class SkipStreakEvidence(PatternEvidence):
    """The longest run of skipped steps after the first step taken."""

    longest: int
    """Skipped steps in the longest run."""
    streaks: int
    """Runs of at least ``SKIP_STREAK`` skips."""
    counted_in_intervals: bool
    """The log counts skips per logging interval (Megatron-LM): a run is placed at the interval's end."""


class SkipStreak(Pattern):
    name = "skip-streak"
    evidence_type: ClassVar[type[PatternEvidence]] = SkipStreakEvidence
    needs = ()
    subsumed_by = ("scale-collapse", "grad-norm-growth", "lr-peak-trouble", "nonfinite-loss")

    def check(self, history: History) -> list[LogFinding]:
        taken = first_taken_row(history)
        if taken is None:
            return []
        settled_at = int(history.step[taken])
        streaks = [r for r in runs([s for s in skipped_steps(history) if s > settled_at]) if len(r) >= SKIP_STREAK]
        if not streaks:
            return []
        longest = max(streaks, key=len)
        evidence = SkipStreakEvidence(
            longest=len(longest), streaks=len(streaks), counted_in_intervals=bool((history.span > 1).any())
        )
        return [
            self.finding(
                f"{len(longest)} steps skipped in a row (steps {longest[0]}..{longest[-1]})"
                + (f", {len(streaks)} such streaks" if len(streaks) > 1 else ""),
                longest,
                Certainty.SHOWN,
                "The log shows the skips; a streak past the scale's settling means every step of it overflowed. "
                "What overflowed, the logs do not say.",
                evidence,
                symptoms=("skips",),
            )
        ]
