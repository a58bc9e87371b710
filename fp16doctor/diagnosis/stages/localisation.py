"""Stage 4, localisation: the first module and operator of the step the training did not survive."""

from __future__ import annotations

import math

from ...engine.records import Column
from ...measure.localise import Localisation, localise, localise_steps
from ..findings import ProbeSummary, StageName, StageReport, StageStatus
from .context import StageContext, bad_step


def stage_localise(ctx: StageContext) -> StageReport:
    ev = ctx.evidence
    with ctx.progress.planned(
        sum(
            localise_steps(bad_step(summary))
            for summary in (ev.fp32, ev.amp)
            if summary is not None and not summary.finite and summary.exception is None
        )
    ):
        return _localise(ctx)


def _localise(ctx: StageContext) -> StageReport:
    ev = ctx.evidence
    notes = []
    if ev.fp32 is not None and not ev.fp32.finite and ev.fp32.exception is None:
        step = bad_step(ev.fp32)
        ev.fp32_localisation = localise(ctx.bench, "fp32", step, ctx.config)
        if ev.fp32_localisation:
            notes.append("fp32: " + ev.fp32_localisation.describe())
    amp = ev.amp
    if amp is None or amp.finite or amp.exception is not None:
        if not notes:
            return StageReport(StageName.LOCALISATION, StageStatus.SKIPPED, "no non-finite step to localise")
        return StageReport(StageName.LOCALISATION, StageStatus.RAN, "; ".join(notes))
    step = bad_step(amp)
    first = localise(ctx.bench, "amp", step, ctx.config, keep=ctx.fault_snapshots)
    ev.localisation = first
    ev.localisation_deterministic = first is not None and reproduces(first, amp)
    if first is None:
        notes.append(f"amp step {step}: the replay stayed finite (non-deterministic fault?)")
    else:
        notes.append(
            "amp: "
            + first.describe()
            + ("" if ev.localisation_deterministic else " (the replay differed: non-deterministic)")
        )
    return StageReport(
        StageName.LOCALISATION,
        StageStatus.RAN,
        "; ".join(notes),
        details={
            "amp": first.to_json() if first else None,
            "deterministic": ev.localisation_deterministic,
            "fp32": ev.fp32_localisation.to_json() if ev.fp32_localisation else None,
        },
    )


def reproduces(found: Localisation, original: ProbeSummary) -> bool:
    """Whether the replay walked the original run's path: the same loss and loss scale at every step before
    the traced one (bit for bit), and the fault at the same step. One replay checked against the original
    run is as strict as two replays checked against each other, at half the cost."""
    rows = original.records[original.records[Column.STEP] < found.step]
    expected = list(zip(rows[Column.LOSS].astype(float), rows[Column.LOSS_SCALE].astype(float)))
    return len(expected) == len(found.replayed) and all(
        _same(a, b) and _same(c, d) for (a, c), (b, d) in zip(expected, found.replayed)
    )


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
