"""The measured symptoms of a mixed-precision training, defined once.

A verdict comes from what was measured, never from the rules alone: rules
explain symptoms, they do not decide whether there are any. ``diagnose`` and
``compare`` both call :func:`measure` on a probe's record against the FP32
baseline's; a training with any symptom is never called healthy.

The symptoms (``code``: what it means):

* ``fp32-nonfinite``: the FP32 baseline itself turns inf/NaN or raises (diagnose only:
  the data, the learning rate or the model is at fault, or a precision fix must hold there too).
* ``nonfinite``: the loss turns inf/NaN under AMP, or inf/NaN gradients reach the
  optimizer, while FP32 stays finite (gradients the GradScaler caught are ``skips``).
* ``amp-exception``: the training raises under AMP but not in FP32.
Every number is in :mod:`fp16doctor.measure.thresholds`, with its source.

* ``skips``: the GradScaler skips steps beyond its calibration: more than
  ``CALIBRATION_SKIPS`` before the first step taken (a scale settling from far too
  high), or, after it, at least ``RECURRING_SKIPS`` skipped steps making up
  ``RECURRING_SHARE`` of the attempted optimizer steps (a default scaler grows once
  per 2000 clean steps, so it skips about once per 2000).
* ``lost-updates``: a share of parameter updates rounded away (gradient non-zero,
  weight unchanged) that exceeds FP32's by ``LOST_UPDATE_EXCESS``.
* ``same-state-gap``: on the same weights and batch, the AMP loss deviates from
  FP32's by more than ``GAP_ERROR`` (measured by the precision-gap stage).
* ``trajectory-drift``: the AMP loss curve ends more than ``DRIFT_ERROR`` away
  from FP32's (mean over the last quarter of the batches, matched batch for batch).

Gradient-accumulation micro-steps (no optimizer step attempted) are neither
skips nor steps: they are left out of every count here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pandas as pd

from ..engine.records import Column, Reading
from .records import ExceptionInfo
from .thresholds import (
    BF16_FACTOR,
    CALIBRATION_SKIPS,
    DRIFT_ERROR,
    GAP_ERROR,
    LOSS_FLOOR_SHARE,
    LOST_UPDATE_EXCESS,
    RECURRING_SHARE,
    RECURRING_SKIPS,
)


class SymptomCode(StrEnum):
    """Every symptom the doctor measures (the table in the README). String-valued: the codes in the JSON, in
    each rule's ``explains`` and in the findings' evidence are these values."""

    FP32_NONFINITE = "fp32-nonfinite"
    NONFINITE = "nonfinite"
    AMP_EXCEPTION = "amp-exception"
    SKIPS = "skips"
    LOST_UPDATES = "lost-updates"
    SAME_STATE_GAP = "same-state-gap"
    TRAJECTORY_DRIFT = "trajectory-drift"


SYMPTOM_CODES = tuple(code.value for code in SymptomCode)


@dataclass
class Symptom:
    """One measured symptom: what, where it starts, and the numbers."""

    code: str
    """A :class:`SymptomCode` value (checked: a misspelt code raises instead of matching no rule)."""
    description: str
    """The symptom in a sentence, with its numbers."""
    measured: dict[str, Any] = field(default_factory=dict)
    """The numbers it was measured from."""
    step: int | None = None
    """The step where it starts, where it has one."""

    def __post_init__(self) -> None:
        self.code = SymptomCode(self.code).value  # a plain str: JSON and YAML carry it as it is

    def to_json(self) -> dict[str, Any]:
        return {"symptom": self.code, "description": self.description, "step": self.step, "measured": self.measured}


def attempts(records: pd.DataFrame) -> pd.DataFrame:
    """The rows that attempted an optimizer step (accumulation micro-steps left out)."""
    if "micro_step" not in records:
        return records
    return records[~records[Column.MICRO_STEP].astype(bool)]


def first_step(records: pd.DataFrame, mask: pd.Series) -> int | None:
    hits = records.loc[mask.astype(bool), "step"]
    return int(hits.iloc[0]) if len(hits) else None


def exception_of(records: pd.DataFrame) -> ExceptionInfo | None:
    """The first exception the record holds (a probe stops at it), or None."""
    bad = records[records[Column.EXCEPTION_TYPE].notna()]
    if bad.empty:
        return None
    row = bad.iloc[0]
    module = row.get("exception_module")
    return ExceptionInfo(
        step=int(row[Column.STEP]),
        type=row[Column.EXCEPTION_TYPE],
        message=row[Column.EXCEPTION],
        location=row[Column.EXCEPTION_LOCATION],
        module=module if isinstance(module, str) else None,
    )


def unhandled_nonfinite(records: pd.DataFrame) -> pd.Series:
    """Steps with an inf/NaN loss, or inf/NaN gradients that the optimizer applied.

    Inf gradients on a step the GradScaler skipped are its calibration working
    (counted by the ``skips`` symptom), not a non-finite training.
    """
    applied = records[Column.NONFINITE_GRADS].astype(bool) & records[Column.OPTIMIZER_STEPPED].astype(bool)
    return (records[Column.NONFINITE_LOSS].astype(bool) | applied) & records[Column.EXCEPTION_TYPE].isna()


def first_nonfinite(records: pd.DataFrame) -> int | None:
    """The first step whose loss was inf/NaN or whose inf/NaN gradients were applied, exceptions left out."""
    return first_step(records, unhandled_nonfinite(records))


def skip_runs(steps: list[int]) -> list[list[int]]:
    """Consecutive runs of skipped steps."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


def skip_profile(records: pd.DataFrame, skipped_before: int = 0) -> dict[str, Any]:
    """Skips before the first step taken (calibration) and after it, over attempted optimizer steps.

    ``skipped_before``: the steps the run had skipped in a row just before the record's first (a capsule's replay
    resumes the scaler where the watched run left it): leading skips continue that streak, not a calibration."""
    tried = attempts(records[records[Column.EXCEPTION_TYPE].isna()])
    skipped = tried[Column.SKIPPED].astype(bool).tolist()
    steps = [int(s) for s, bad in zip(tried[Column.STEP], skipped) if bad]
    own = next((i for i, bad in enumerate(skipped) if not bad), len(skipped))
    after = skipped[own:]
    return {
        "attempted": len(skipped),
        "skipped": len(steps),
        "skipped_steps": steps,
        "leading": own + skipped_before if own else 0,
        "after_settling": sum(after),
        "after_share": sum(after) / len(after) if after else 0.0,
        "settled": own < len(skipped),
    }


def excess_skips(profile: dict[str, Any]) -> bool:
    """Skips beyond the scale's calibration (see the module docstring)."""
    if profile[Column.SKIPPED] == 0:
        return False
    never_settled = not profile["settled"] and profile["attempted"] > 0
    slow_settling = profile["leading"] > CALIBRATION_SKIPS
    recurring = profile["after_settling"] >= RECURRING_SKIPS and profile["after_share"] >= RECURRING_SHARE
    return never_settled or slow_settling or recurring


def lost_update_share(updates: pd.DataFrame | None) -> float | None:
    """Mean share of updates lost (gradient non-zero, weight unchanged) over every parameter and step."""
    if updates is None or updates.empty or Reading.LOST_UPDATE_SHARE not in updates:
        return None
    return float(updates[Reading.LOST_UPDATE_SHARE].mean())


def loss_by_batch(records: pd.DataFrame) -> dict[int, float]:
    """The loss each batch of the run gave (a retried batch: its last attempt)."""
    rows = records[records[Column.EXCEPTION_TYPE].isna()]
    return {int(b): float(v) for b, v in zip(rows[Column.BATCH_INDEX], rows[Column.LOSS])}


def loss_by_update(records: pd.DataFrame) -> dict[int, float]:
    """The loss seen after k optimizer updates, for each k (the last row before update k+1)."""
    rows = records[records[Column.EXCEPTION_TYPE].isna()]
    updates = rows[Column.OPTIMIZER_STEPPED].astype(bool).cumsum() - rows[Column.OPTIMIZER_STEPPED].astype(bool)
    return {int(k): float(v) for k, v in zip(updates, rows[Column.LOSS])}


def _tail_means(ours: dict[int, float], theirs: dict[int, float]) -> tuple[float, float] | None:
    common = sorted(set(ours) & set(theirs))
    window = common[-max(1, len(common) // 4) :] if common else []
    pairs = [(ours[k], theirs[k]) for k in window if math.isfinite(ours[k]) and math.isfinite(theirs[k])]
    if not pairs:
        return None
    return sum(a for a, _ in pairs) / len(pairs), sum(b for _, b in pairs) / len(pairs)


def tail_losses(mode: pd.DataFrame, fp32: pd.DataFrame) -> tuple[float, float] | None:
    """Mean loss of both runs over the last quarter of the curve, in the alignment where they agree best.

    Matched batch for batch, per-batch noise cancels but a run that skipped k
    steps is k updates behind; matched update for update, the lag cancels but
    the batches differ. A real drift shows in both; noise or a settling scale's
    lag in at most one, so the smaller deviation is the measured one.
    """
    floor = loss_floor(fp32)
    candidates = [
        t
        for t in (
            _tail_means(loss_by_batch(mode), loss_by_batch(fp32)),
            _tail_means(loss_by_update(mode), loss_by_update(fp32)),
        )
        if t is not None
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda t: relative_deviation(t[0], t[1], floor))


def relative_deviation(value: float, reference: float, floor: float = 0.0) -> float:
    """|value - reference| relative to the reference, or to ``floor`` when the reference is smaller."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    return abs(value - reference) / max(abs(reference), floor, 1e-12)


def loss_floor(fp32: pd.DataFrame) -> float:
    """10% of the initial FP32 loss: the smallest denominator of a relative loss deviation."""
    losses = [float(v) for v in fp32[Column.LOSS] if math.isfinite(float(v))]
    return LOSS_FLOOR_SHARE * abs(losses[0]) if losses else 0.0


def baseline_symptoms(fp32: pd.DataFrame | None) -> list[Symptom]:
    """The FP32 baseline's own failure, if any (``fp32-nonfinite``)."""
    if fp32 is None:
        return []
    exception, bad = exception_of(fp32), first_nonfinite(fp32)
    if exception is None and bad is None:
        return []
    step = min(s for s in (bad, exception.step if exception else None) if s is not None)
    what = f"raises {exception.type}" if exception is not None and step == exception.step else "turns non-finite"
    return [
        Symptom(
            SymptomCode.FP32_NONFINITE,
            f"the FP32 baseline itself {what} at step {step}",
            {"first_failing_step": step, "exception": exception.to_json() if exception else None},
            step,
        )
    ]


def probe_symptoms(
    amp: Any, fp32: Any, same_state_gap: float | None = None, bf16: bool = False, skipped_before: int = 0
) -> list[Symptom]:
    """All symptoms of an AMP probe summary against the FP32 one (``.records``/``.tables``): the baseline's own
    failure first, then :func:`measure`. What diagnose's verdict and every fix's verification are measured with."""
    fp32_records = fp32.records if fp32 is not None else None
    return baseline_symptoms(fp32_records) + measure(
        amp.records,
        fp32_records,
        amp.tables.get("updates"),
        fp32.tables.get("updates") if fp32 is not None else None,
        same_state_gap=same_state_gap,
        bf16=bf16,
        skipped_before=skipped_before,
    )


def measure(
    mode: pd.DataFrame,
    fp32: pd.DataFrame | None,
    mode_updates: pd.DataFrame | None = None,
    fp32_updates: pd.DataFrame | None = None,
    same_state_gap: float | None = None,
    bf16: bool = False,
    skipped_before: int = 0,
) -> list[Symptom]:
    """Every symptom the low-precision record ``mode`` shows against the FP32 record (see the module docstring);
    ``skipped_before``: the streak of skips a capsule's run had made before its step (:func:`skip_profile`)."""
    found: list[Symptom] = []
    fp32_failed = fp32 is not None and (exception_of(fp32) is not None or first_nonfinite(fp32) is not None)
    exception = exception_of(mode)
    if exception is not None and (fp32 is None or exception_of(fp32) is None):
        found.append(
            Symptom(
                SymptomCode.AMP_EXCEPTION,
                f"the training raises {exception.type} under AMP, not in FP32",
                {"exception": exception.to_json()},
                exception.step,
            )
        )
    bad = first_nonfinite(mode)
    if bad is not None and not fp32_failed:
        row = mode.loc[mode[Column.STEP] == bad].iloc[0]
        what = "loss" if bool(row[Column.NONFINITE_LOSS]) else "gradients"
        turn = "turns" if what == "loss" else "turn"
        count = int(unhandled_nonfinite(mode).sum())
        found.append(
            Symptom(
                SymptomCode.NONFINITE,
                f"the AMP {what} {turn} non-finite from step {bad} while FP32 stays finite",
                {
                    "first_nonfinite_step": bad,
                    "first_nonfinite": what,
                    "nonfinite_steps": count,
                    "batch": int(row[Column.BATCH_INDEX]),
                },
                bad,
            )
        )
    profile = skip_profile(mode, skipped_before)
    if excess_skips(profile):
        streak = (
            f", continuing the {skipped_before} the run skipped in a row before"
            if profile["leading"] > profile[Column.SKIPPED]
            else ""
        )
        found.append(
            Symptom(
                SymptomCode.SKIPS,
                f"the GradScaler skipped {profile[Column.SKIPPED]} of {profile['attempted']} optimizer steps "
                f"({profile['leading']} before the first step taken{streak}, {profile['after_settling']} after it)",
                {k: profile[k] for k in ("attempted", "skipped", "leading", "after_settling", "after_share")}
                | {"skipped_steps": profile["skipped_steps"][:30]},
                profile["skipped_steps"][0],
            )
        )
    lost, lost_fp32 = lost_update_share(mode_updates), lost_update_share(fp32_updates) or 0.0
    if lost is not None and lost - lost_fp32 > LOST_UPDATE_EXCESS:
        found.append(
            Symptom(
                SymptomCode.LOST_UPDATES,
                f"{lost:.0%} of parameter updates are rounded away (FP32: {lost_fp32:.0%})",
                {"lost_update_share": lost, "fp32_lost_update_share": lost_fp32},
            )
        )
    factor = BF16_FACTOR if bf16 else 1.0
    if same_state_gap is not None and same_state_gap > GAP_ERROR * factor:
        found.append(
            Symptom(
                SymptomCode.SAME_STATE_GAP,
                f"on the same weights and batch the AMP loss is {same_state_gap:.2%} off FP32's",
                {"same_state_rel_dev": same_state_gap, "tolerance": GAP_ERROR * factor},
            )
        )
    if fp32 is not None and not fp32_failed and bad is None and exception is None:
        tails = tail_losses(mode, fp32)
        if tails is not None:
            ours, theirs = tails
            drift = relative_deviation(ours, theirs, loss_floor(fp32))
            if drift > DRIFT_ERROR * factor:
                found.append(
                    Symptom(
                        SymptomCode.TRAJECTORY_DRIFT,
                        f"the AMP loss curve ends {drift:.1%} away from FP32's ({ours:.4g} against {theirs:.4g})",
                        {
                            "amp_tail_loss": ours,
                            "fp32_tail_loss": theirs,
                            "rel_dev": drift,
                            "tolerance": DRIFT_ERROR * factor,
                        },
                    )
                )
    return found
