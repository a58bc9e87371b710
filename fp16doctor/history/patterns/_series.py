"""What the patterns read off the columns: skipped steps, runs of them, the first non-finite step."""

from __future__ import annotations

import math

import numpy as np

from ..records import History


def skipped_steps(history: History) -> list[int]:
    """Every skipped step: a per-step row's own step; for a row covering an interval, its last ``skipped`` steps
    (the log counts them, it does not place them)."""
    return placed_steps(history, history.skipped())


def nonfinite_steps(history: History) -> list[int]:
    """Every step with a non-finite loss, placed as :func:`skipped_steps` places skips."""
    return placed_steps(history, history.nonfinite())


def placed_steps(history: History, counts: np.ndarray) -> list[int]:
    """The steps a per-row count names: each row's last ``count`` steps of those it covers."""
    out: list[int] = []
    for i in np.flatnonzero(counts > 0):
        k, step = int(min(counts[i], history.span[i])), int(history.step[i])
        out.extend(range(step - k + 1, step + 1))
    return out


def runs(steps: list[int]) -> list[list[int]]:
    """Consecutive runs of steps."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][-1] + 1:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def first_taken_row(history: History) -> int | None:
    """The first row with a step the optimizer took (fewer skips than steps covered)."""
    taken = np.flatnonzero(history.skipped() < history.span)
    return int(taken[0]) if len(taken) else None


def first_nonfinite_row(history: History) -> int | None:
    """The first row with a non-finite loss (or counted NaN steps), or with a non-finite gradient norm the
    optimizer was not known to skip."""
    loss_bad = history.nonfinite() > 0
    norm = history.values["grad_norm"]
    norm_bad = history.present["grad_norm"] & ~np.isfinite(norm) & (history.skipped() == 0)
    bad = np.flatnonzero(loss_bad | norm_bad)
    return int(bad[0]) if len(bad) else None


def power_of_two(value: float) -> str:
    """2^16 for 65536, else the number (the scales of a dynamic scaler are powers of two)."""
    if value > 0 and math.isfinite(value) and float(2 ** round(math.log2(value))) == value:
        return f"2^{round(math.log2(value))}"
    return f"{value:g}"
