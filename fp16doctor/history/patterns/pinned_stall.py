"""The loss stalls while the loss scale is pinned at one value for the whole run.

Over at least ``STALL_ROWS`` rows and ``STALL_STEPS`` steps the loss's last tenth sits within ``STALL_FALL`` of
its start (the first hundredth of the rows, three at least), and the scale never moved: no overflow (that would halve it) and no growth (a dynamic scaler
doubles it every growth_interval clean steps). A scale that never moves is static or capped; a training that does
not learn under it loses its updates (weights stored in half precision: ``lost-updates``) or its gradients (a
scale too low: ``grad-underflow``, named when the scale is pinned at or below 1 yet not at exactly 1.0, which is
how frameworks log no scaler at all: bf16). From logs alone: possible, never shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...measure.thresholds import STALL_FALL, STALL_ROWS, STALL_STEPS
from ..records import History
from . import Certainty, LogFinding, Pattern, PatternEvidence
from ._series import power_of_two

NO_SCALER = 1.0
"""The scale frameworks log without a scaler (Megatron-LM's bf16 runs log ``loss scale: 1.0``)."""


@dataclass(frozen=True)
class PinnedStallEvidence(PatternEvidence):
    """The loss at the start and the end, and the one scale of the whole run."""

    scale: float
    loss_start: float
    """The median loss of the first hundredth of the rows (three at least)."""
    loss_end: float
    """The median loss of the last tenth."""
    fall: float
    """The relative fall from start to end."""
    steps: int
    """Optimizer steps the rows cover."""


class PinnedStall(Pattern):
    name = "pinned-stall"
    evidence_type: ClassVar[type[PatternEvidence]] = PinnedStallEvidence
    needs = ("loss", "loss_scale")

    def check(self, history: History) -> list[LogFinding]:
        _, scales = history.column("loss_scale")
        steps, losses = history.column("loss")
        if len(losses) < STALL_ROWS or int(steps[-1] - steps[0]) < STALL_STEPS or scales.min() != scales.max():
            return []
        if not np.isfinite(losses).all():
            return []
        head, tail = max(len(losses) // 100, 3), max(len(losses) // 10, 1)
        start, end = float(np.median(losses[:head])), float(np.median(losses[-tail:]))
        fall = (start - end) / abs(start) if start else 0.0
        if fall >= STALL_FALL:
            return []
        scale = float(scales[0])
        underflow = scale < NO_SCALER
        evidence = PinnedStallEvidence(scale, start, end, round(fall, 4), int(steps[-1] - steps[0]))
        reading = (
            "no scaler (bf16, or fp16 without one)"
            if scale == NO_SCALER
            else f"a scale pinned at {power_of_two(scale)}, never halved nor grown"
        )
        return [
            self.finding(
                f"The loss stalled ({start:.4g} to {end:.4g} over steps {int(steps[0])}..{int(steps[-1])}) under "
                f"{reading}",
                [int(steps[0]), int(steps[-1])],
                Certainty.POSSIBLE,
                "A training that does not learn while the scale never moves may be losing its updates (weights in "
                "half precision) or its gradients (a scale too low lets them underflow); it may also just be a bad "
                "LR or data. The logs cannot tell which: a diagnosis measures lost updates and underflow.",
                evidence,
                cause="grad-underflow" if underflow else None,
            )
        ]
