"""The LR scheduler steps on steps the GradScaler skipped, drifting ahead of the optimizer.

Evidence: skipped AMP steps on which the scheduler still stepped, measured
against the schedule: a warm-up whose first steps are skipped is partly lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from ...measure.thresholds import SKIP_DRIFT_RUN_SHARE, SKIP_DRIFT_WARMUP_SHARE
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, RepairKind, Severity
from . import Rule


@dataclass(frozen=True)
class SkipDriftEvidence(EvidenceRecord):
    """The skipped AMP steps the scheduler still stepped on, against the schedule's warm-up."""

    skipped_steps: list[int]
    """The skipped steps (the first 30)."""
    drift_steps: int
    """How many steps the scheduler ran ahead of the optimizer: every skipped step."""
    warmup_steps: int
    """The schedule's peak step (0 without a dry run of the schedule)."""
    warmup_share_lost: float
    """The share of the warm-up's steps that were skipped."""
    run_share: float
    """The share of the run's steps that were skipped."""


class SchedulerSkipDrift(Rule):
    code = "scheduler-skip-drift"
    order = 85
    evidence_type: ClassVar[type[EvidenceRecord]] = SkipDriftEvidence
    explains = ("trajectory-drift",)
    repairs = (RepairKind.HOLD_SCHEDULER,)
    names_cases = (
        lambda: (fx.repair("hold-scheduler", symptoms=("trajectory-drift",)), fx.evidence(has_scheduler=True)),
    )
    severity = Severity.WARNING
    triggers = ("warmup_skips.py",)
    fires_on = (
        lambda: fx.evidence(
            has_scheduler=True,
            amp=fx.probe(record=fx.records(skipped=[0, 1, 2])),
            lr_peak=fx.lr_peak([1e-3] * 10, peak_step=8),
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            has_scheduler=True,
            amp=fx.probe(record=fx.records(skipped=[0, 1, 2])),
            lr_peak=fx.lr_peak([1e-3] * 10, peak_step=8),
            config=overrides_patch(hold_scheduler_on_skip=True),
        ),
        # the AMP step raised at step 0: it ended the probe, nothing was skipped and the scheduler never stepped
        lambda: fx.evidence(
            has_scheduler=True,
            amp=fx.probe(
                record=fx.records(
                    exception={"step": 0, "type": "RuntimeError", "message": "mat1 and mat2 must have the same dtype"}
                )
            ),
            lr_peak=fx.lr_peak([1e-3] * 10, peak_step=8),
        ),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if not ev.has_scheduler or amp is None or ev.config.overrides.hold_scheduler_on_skip:
            return []
        skipped = amp.skip_steps
        if not skipped:
            return []
        peak = ev.lr_peak.schedule.peak_step if ev.lr_peak is not None else 0
        in_warmup = [s for s in skipped if s < peak]
        run_share = len(skipped) / max(len(amp.records), 1)
        warmup_share = len(in_warmup) / peak if peak else 0.0
        severity = (
            Severity.ERROR
            if run_share >= SKIP_DRIFT_RUN_SHARE and warmup_share >= SKIP_DRIFT_WARMUP_SHARE
            else Severity.WARNING
        )
        return [
            self.finding(
                f"The scheduler stepped on {len(skipped)} skipped step(s)"
                + (f", {len(in_warmup)} of the {peak} warm-up steps" if peak else "")
                + ": the LR runs ahead of the optimizer",
                SkipDriftEvidence(
                    skipped_steps=skipped[:30],
                    drift_steps=len(skipped),
                    warmup_steps=peak,
                    warmup_share_lost=warmup_share,
                    run_share=run_share,
                ),
                Fix(
                    "Step the scheduler only when the optimizer stepped.",
                    code=(
                        "scale_before = scaler.get_scale()\n"
                        "scaler.step(optimizer); scaler.update()\n"
                        "if scaler.get_scale() >= scale_before:   # not skipped\n"
                        "    scheduler.step()"
                    ),
                    config_patch=overrides_patch(hold_scheduler_on_skip=True),
                ),
                severity=severity,
            )
        ]
