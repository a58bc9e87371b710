"""The AMP run falls behind an FP32 run of the same training (``--reference``): the ``trajectory-drift``
symptom, as the doctor measures it, from the logs.

Over the last quarter of the steps both histories cover, the AMP loss's mean is more than ``DRIFT_ERROR`` above
FP32's, relative to FP32's (at least ``LOSS_FLOOR_SHARE`` of FP32's first loss). A plateau: the AMP loss stopped
falling (under ``STALL_FALL`` over that quarter) while FP32's went on. Which cause (a precision-sensitive layer,
lost updates, underflowing gradients) the diagnosis measures; the two runs must share data order and seed for
the gap to be the precision's, which the logs cannot check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...measure.thresholds import DRIFT_ERROR, LOSS_FLOOR_SHARE, STALL_FALL
from ..records import History
from . import Certainty, LogFinding, PatternEvidence, ReferencePattern

MIN_COMMON_ROWS = 8
"""Rows of the AMP run inside FP32's steps that a comparison needs (two per quarter)."""


@dataclass(frozen=True)
class BehindFp32Evidence(PatternEvidence):
    """Both runs' losses over the last quarter of the steps they share."""

    amp_loss: float
    """The AMP run's mean loss over the last quarter."""
    fp32_loss: float
    """FP32's, at the same steps (interpolated between its logged rows)."""
    deviation: float
    """(AMP - FP32) / max(FP32, LOSS_FLOOR_SHARE x FP32's first loss)."""
    plateau: bool
    """The AMP loss fell less than STALL_FALL over the quarter while FP32's fell more."""
    from_step: int
    to_step: int


class BehindFp32(ReferencePattern):
    name = "behind-fp32"
    evidence_type: ClassVar[type[PatternEvidence]] = BehindFp32Evidence
    needs = ("loss",)

    def compare(self, history: History, reference: History) -> list[LogFinding]:
        steps, losses = history.column("loss")
        ref_steps, ref_losses = reference.column("loss")
        finite = np.isfinite(ref_losses)
        ref_steps, ref_losses = ref_steps[finite], ref_losses[finite]
        if len(ref_steps) < 2:
            return []
        inside = (steps >= ref_steps[0]) & (steps <= ref_steps[-1]) & np.isfinite(losses)
        steps, losses = steps[inside], losses[inside]
        if len(steps) < MIN_COMMON_ROWS:
            return []
        matched = np.interp(steps, ref_steps, ref_losses)
        quarter = slice(len(steps) - len(steps) // 4, None)
        amp, fp32 = float(losses[quarter].mean()), float(matched[quarter].mean())
        floor = max(abs(fp32), LOSS_FLOOR_SHARE * abs(float(ref_losses[0])))
        deviation = (amp - fp32) / floor if floor else 0.0
        if deviation <= DRIFT_ERROR:
            return []
        q_amp, q_ref = losses[quarter], matched[quarter]
        amp_fall = (q_amp[0] - q_amp[-1]) / abs(q_amp[0]) if q_amp[0] else 0.0
        ref_fall = (q_ref[0] - q_ref[-1]) / abs(q_ref[0]) if q_ref[0] else 0.0
        plateau = bool(amp_fall < STALL_FALL <= ref_fall)
        first, last = int(steps[quarter][0]), int(steps[-1])
        evidence = BehindFp32Evidence(amp, fp32, round(deviation, 4), plateau, first, last)
        shape = "plateaus" if plateau else "ends"
        return [
            self.finding(
                f"The AMP loss {shape} {deviation:.0%} above FP32's over steps {first}..{last} ({amp:.4g} against "
                f"{fp32:.4g})",
                [first, last],
                Certainty.LIKELY,
                "The AMP run ends behind FP32's, by more than the doctor's drift tolerance. That is the precision's "
                "only if both ran the same data order and seed, which the logs cannot check; the cause (a "
                "precision-sensitive layer, lost updates, underflow) a diagnosis measures.",
                evidence,
                symptoms=("trajectory-drift",),
            )
        ]
