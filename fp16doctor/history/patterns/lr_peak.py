"""The trouble starts right at the LR schedule's peak or largest jump (``lr-schedule-peak``).

The peak is where the LR first reaches its highest after rising (a warm-up's end); a jump is an LR at least
``LR_JUMP_RATIO`` times the row before, to at least half the highest (a restart, a step schedule). The trouble is
the first loss ``LOG_SPIKE_FACTOR`` times the median of the rows before the event, a non-finite loss or a skip,
within ``LR_EVENT_STEPS`` steps (or three logged rows) after it, with no non-finite loss before it. From logs alone this is
a coincidence in time: the doctor's pause at the peak (``diagnose``) measures the same step at both LRs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ...measure.thresholds import LOG_SPIKE_FACTOR, LR_EVENT_STEPS, LR_JUMP_RATIO, SPIKE_BASELINE_ROWS
from ..records import History
from . import Certainty, LogFinding, Pattern, PatternEvidence

EVENT_ROWS = 3
"""Logged rows after the event that count as "at it" where the log is sparser than ``LR_EVENT_STEPS``."""
STRONG_JUMP = 10.0
"""A jump of 10x or more makes the coincidence likely rather than possible."""


@dataclass(frozen=True)
class LrPeakTroubleEvidence(PatternEvidence):
    """The schedule's event and the first trouble after it."""

    event: str
    """``peak`` (the LR first at its highest after rising) or ``jump``."""
    event_step: int
    lr_before: float
    """The LR of the row before the event."""
    lr_at_event: float
    trouble_step: int
    trouble: str
    """``spike``, ``nonfinite`` or ``skip``."""
    loss_at_trouble: float | None
    baseline_loss: float | None
    """The median loss of the rows before the event that the spike is compared with."""


class LrPeakTrouble(Pattern):
    name = "lr-peak-trouble"
    evidence_type: ClassVar[type[PatternEvidence]] = LrPeakTroubleEvidence
    needs = ("lr",)

    def check(self, history: History) -> list[LogFinding]:
        event = self._event(history)
        if event is None:
            return []
        kind, row, before = event
        losses = np.where(history.present["loss"], history.values["loss"], np.nan)
        baseline_rows = losses[max(0, row - SPIKE_BASELINE_ROWS) : row]
        finite = baseline_rows[np.isfinite(baseline_rows)]
        baseline = float(np.median(finite)) if len(finite) else None
        if history.nonfinite()[:row].any():
            return []  # the trouble started before the schedule's event
        last = max(int(history.step[row]) + LR_EVENT_STEPS, int(history.step[min(row + EVENT_ROWS, len(history) - 1)]))
        end = int(np.searchsorted(history.step, last, side="right"))
        trouble = self._trouble_at(history, losses, baseline, row, end)
        if trouble is None:
            return []
        at, what = trouble
        lr_before, lr_at = float(history.values["lr"][before]), float(history.values["lr"][row])
        ratio = lr_at / lr_before if lr_before > 0 else math.inf
        step, trouble_step = int(history.step[row]), int(history.step[at])
        loss_at = float(losses[at]) if np.isfinite(losses[at]) or history.present["loss"][at] else None
        evidence = LrPeakTroubleEvidence(kind, step, lr_before, lr_at, trouble_step, what, loss_at, baseline)
        said = {"spike": "the loss spikes", "nonfinite": "the loss turns non-finite", "skip": "steps are skipped"}[what]
        return [
            self.finding(
                f"{said[0].upper() + said[1:]} at step {trouble_step}, {trouble_step - step} step(s) after the LR's "
                f"{kind} at step {step} ({lr_before:.3g} to {lr_at:.3g})",
                [step, trouble_step],
                Certainty.LIKELY if ratio >= STRONG_JUMP else Certainty.POSSIBLE,
                "The trouble starts right after the schedule's event and not before it. From logs alone that is a "
                "coincidence in time; the doctor's pause at the peak measures the same step at both LRs.",
                evidence,
                cause="lr-schedule-peak",
                symptoms=("nonfinite",) if what == "nonfinite" else ("skips",) if what == "skip" else (),
            )
        ]

    @staticmethod
    def _event(history: History) -> tuple[str, int, int] | None:
        """(kind, row, row before) of the schedule's jump, else its peak after a rise; None for a flat or falling
        schedule."""
        rows = np.flatnonzero(history.present["lr"])
        if len(rows) < 2:
            return None
        lrs = history.values["lr"][rows]
        highest = float(np.nanmax(lrs))
        if not highest > 0:
            return None
        ratios = np.where(lrs[:-1] > 0, lrs[1:] / np.where(lrs[:-1] > 0, lrs[:-1], 1.0), 0.0)
        jumps = np.flatnonzero((ratios >= LR_JUMP_RATIO) & (lrs[1:] >= highest / 2))
        if len(jumps):
            best = jumps[int(np.argmax(ratios[jumps]))]
            return "jump", int(rows[best + 1]), int(rows[best])
        peak = int(np.argmax(lrs >= highest))
        if peak == 0 or lrs[0] >= highest / 2 or peak == len(lrs) - 1:
            return None  # no rise, or the last rate logged, still rising as far as the log shows: no peak
        return "peak", int(rows[peak]), int(rows[peak - 1])

    @staticmethod
    def _trouble_at(
        history: History, losses: np.ndarray, baseline: float | None, start: int, stop: int
    ) -> tuple[int, str] | None:
        nonfinite = history.nonfinite()
        skipped = history.skipped()
        for i in range(start, stop):
            if nonfinite[i] > 0:
                return i, "nonfinite"
            if skipped[i] > 0 and i > 0:
                return i, "skip"
            if baseline is not None and np.isfinite(losses[i]) and losses[i] > LOG_SPIKE_FACTOR * baseline > 0:
                return i, "spike"
        return None
