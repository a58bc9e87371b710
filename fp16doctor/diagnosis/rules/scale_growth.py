"""The loss scale grows too fast: skips recur every few steps after the scale settled.

Evidence: skipped steps separated by short clean runs, each after the scale
grew, with a small growth_interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import scaler_patch
from ...engine.records import Column
from ...measure.symptoms import skip_runs
from ...measure.thresholds import SCALE_GROWTH_RECURRENCES
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, RepairKind
from . import Rule
from ._helpers import fp32_finite

"""A skip right after a growth, twice: at PyTorch's default interval (2000) a probe never even grows."""


@dataclass(frozen=True)
class ScaleGrowthEvidence(EvidenceRecord):
    """Skips that recur after the scale settled, each run of them after a growth of the scale."""

    recurrent_skip_steps: list[int]
    """The steps skipped after the first step taken (the first thirty)."""
    recurrences: int
    """How many separate runs of skips."""
    mean_gap: float
    """The mean number of steps between one run of skips and the next."""
    growth_interval: int
    """The configured GradScaler growth_interval."""
    skips_after_growth: int
    """How many of the skips came right after the scale grew."""


class ScaleGrowth(Rule):
    code = "scale-growth"
    order = 72
    evidence_type: ClassVar[type[EvidenceRecord]] = ScaleGrowthEvidence
    explains = ("skips", "nonfinite", "trajectory-drift")
    repairs = (RepairKind.SCALER_GROWTH,)
    names_cases = (lambda: (fx.repair("scaler-growth", symptoms=("skips",)), fx.evidence()),)
    triggers = ("scale_grows_fast.py",)
    fires_on = (
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(skipped=[0, 3, 6, 9], scales=[64, 32, 64, 128, 64, 128, 256, 128, 256, 512]))
        ),
    )
    quiet_on = (lambda: fx.evidence(amp=fx.probe(record=fx.records(skipped=[0, 1]))),)

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if amp is None or not amp.scaler_enabled or amp.first_nonfinite_loss is not None or not fp32_finite(ev):
            return []
        rec = amp.records
        skipped = rec[Column.SKIPPED].astype(bool).tolist()
        first_taken = next((i for i, s in enumerate(skipped) if not s), None)
        if first_taken is None:
            return []
        scales = rec[Column.LOSS_SCALE].tolist()
        later_rows = [i for i in range(first_taken, len(rec)) if skipped[i]]
        later = [int(rec[Column.STEP].iloc[i]) for i in later_rows]
        grew = [i for i in later_rows if i > 0 and scales[i] > scales[i - 1]]  # the skip came right after a growth
        runs = skip_runs(later)
        if len(runs) < SCALE_GROWTH_RECURRENCES or len(grew) < SCALE_GROWTH_RECURRENCES:
            return []
        gaps = [b[0] - a[-1] for a, b in zip(runs, runs[1:])]
        interval = ev.config.scaler.growth_interval
        # At least PyTorch's default: the sweep's variants only show which of the slower growths skip least.
        rec_interval = max(int((ev.recommended_scaler or {}).get("growth_interval") or 0), interval * 10, 2000)
        return [
            self.finding(
                f"Skips recur {len(runs)} times after the scale settled (every ~{sum(gaps) / max(len(gaps), 1):.0f} steps): growth_interval {interval} grows the scale too fast",
                ScaleGrowthEvidence(
                    recurrent_skip_steps=later[:30],
                    recurrences=len(runs),
                    mean_gap=sum(gaps) / max(len(gaps), 1),
                    growth_interval=interval,
                    skips_after_growth=len(grew),
                ),
                Fix(
                    f"Raise growth_interval to {rec_interval} so the scale grows only after a long clean run.",
                    code=f"scaler = torch.amp.GradScaler('cuda', growth_interval={rec_interval})",
                    config_patch=scaler_patch(growth_interval=rec_interval),
                ),
            )
        ]
