"""The gradient norm climbs for many steps before the first non-finite one: a growing instability, not a
sudden overflow.

The median of the last third of the finite norms before the first non-finite step is at least
``GRAD_GROWTH_FACTOR`` times the first third's (``GRAD_GROWTH_ROWS`` norms at least). Weights or activations
growing, often under a too-high LR, end in an overflow: the ``nonfinite`` symptom; which of them, and whether FP32
diverges too (``fp32-divergence``) or only fp16 overflows (``activation-overflow``), a diagnosis from the
checkpoint before the climb measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...measure.thresholds import GRAD_GROWTH_FACTOR, GRAD_GROWTH_ROWS
from ..records import History
from . import Certainty, LogFinding, Pattern, PatternEvidence
from ._series import first_nonfinite_row


@dataclass(frozen=True)
class GradNormGrowthEvidence(PatternEvidence):
    """The climb of the gradient norm up to the first non-finite step."""

    first_nonfinite_step: int
    growth_start_step: int
    """The first step whose norm is past twice the first third's median: where the climb begins."""
    norm_at_start: float
    """The median of the first third of the finite norms."""
    norm_before_nonfinite: float
    """The median of the last third."""
    growth: float
    """Their ratio."""


class GradNormGrowth(Pattern):
    name = "grad-norm-growth"
    evidence_type: ClassVar[type[PatternEvidence]] = GradNormGrowthEvidence
    needs = ("grad_norm",)

    def check(self, history: History) -> list[LogFinding]:
        bad = first_nonfinite_row(history)
        if bad is None:
            return []
        rows = np.flatnonzero(history.present["grad_norm"][:bad])
        norms = history.values["grad_norm"][rows]
        keep = np.isfinite(norms) & (norms > 0)
        rows, norms = rows[keep], norms[keep]
        if len(norms) < GRAD_GROWTH_ROWS:
            return []
        third = len(norms) // 3
        start, end = float(np.median(norms[:third])), float(np.median(norms[-third:]))
        if start <= 0 or end / start < GRAD_GROWTH_FACTOR:
            return []
        climbing = int(np.argmax(norms > 2 * start))
        growth_start, nonfinite_step = int(history.step[rows[climbing]]), int(history.step[bad])
        evidence = GradNormGrowthEvidence(nonfinite_step, growth_start, start, end, round(end / start, 2))
        return [
            self.finding(
                f"The gradient norm climbed {end / start:.3g}x from step {growth_start} to the first non-finite "
                f"step {nonfinite_step} ({start:.3g} to {end:.3g})",
                [growth_start, nonfinite_step],
                Certainty.LIKELY,
                "A norm climbing for many steps before the first non-finite one is a growing instability (weights or "
                "activations growing, often a too-high LR), not one bad batch. Whether FP32 diverges too, only a run "
                "from a checkpoint before the climb can tell.",
                evidence,
                symptoms=("nonfinite",),
            )
        ]
