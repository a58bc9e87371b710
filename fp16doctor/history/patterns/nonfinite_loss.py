"""The loss turns inf/NaN: the ``nonfinite`` symptom, read off the log where no other pattern explains it.

Every non-finite logged loss (and Megatron-LM's counted NaN iterations). A collapse of the scale, a gradient norm
climbing before it, or an LR event right before it says more, and takes its steps; alone, the log shows where the
training broke, not why: the diagnosis from the checkpoint before it (or the watch's capsule) measures that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ..records import History
from . import Certainty, LogFinding, Pattern, PatternEvidence
from ._series import nonfinite_steps


@dataclass(frozen=True)
class NonfiniteLossEvidence(PatternEvidence):
    """Where the loss went non-finite, and how often."""

    first_nonfinite_step: int
    nonfinite_steps: int
    """Steps with a non-finite loss (as logged or counted)."""
    last_finite_loss: float | None
    """The last finite loss logged before the first non-finite one."""


class NonfiniteLoss(Pattern):
    name = "nonfinite-loss"
    evidence_type: ClassVar[type[PatternEvidence]] = NonfiniteLossEvidence
    needs = ()
    subsumed_by = ("scale-collapse", "grad-norm-growth", "lr-peak-trouble")

    def check(self, history: History) -> list[LogFinding]:
        counts = history.nonfinite()
        rows = np.flatnonzero(counts > 0)
        if not len(rows):
            return []
        first = int(rows[0])
        before = history.values["loss"][:first][history.present["loss"][:first]]
        finite = before[np.isfinite(before)]
        steps = nonfinite_steps(history)
        # a count the log kept (Megatron-LM's NaN iterations) names its interval's last steps; a NaN mean over
        # several steps (Hugging Face's loss over logging_steps) says only that one of them was
        placed = bool((history.present["nonfinite"][rows] | (history.span[rows] == 1)).all())
        evidence = NonfiniteLossEvidence(steps[0], len(steps), float(finite[-1]) if len(finite) else None)
        where = (
            _where(len(steps), steps[0], steps[-1])
            if placed
            else f"The loss is non-finite in {len(rows)} logged row(s), from the row ending at step "
            f"{int(history.step[rows[0]])} to the one ending at step {int(history.step[rows[-1]])}"
        )
        return [
            self.finding(
                where,
                steps,
                Certainty.SHOWN,
                "The log shows the non-finite loss; nothing before it in the log (no collapse of the scale, no "
                "climbing gradient norm, no LR event) says why.",
                evidence,
                symptoms=("nonfinite",),
            )
        ]


def _where(count: int, first: int, last: int) -> str:
    if count == 1:
        return f"The loss is non-finite at step {first}"
    return f"The loss is non-finite at {count} steps, from step {first} to {last}"
