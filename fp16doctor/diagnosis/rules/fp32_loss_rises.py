"""The loss rises in full precision: the FP32 baseline's loss ends well above where it started, every step finite.

Evidence: the FP32 probe's per-step losses, the median of the first third against the median of the last
(at least three steps each: one easy first batch or one late spike makes no trend), the rise larger than the
first third's own spread from batch to batch (a loss near zero that only wobbles, a contrastive loss of
0.005 with batches at 5e-9 and 0.015, doubles its median by chance). A training that more
than doubles its loss in a few dozen steps diverges in FP32 already (a learning rate too high for the model
or the schedule, a wrong sign, an unnormalised input); AMP on top of it skips steps and drifts because the
gradients grow, not because of fp16, and comparing the two says little. Measured, not guessed: the FP32
baseline shows it. A warning (no precision setting fixes an FP32 divergence), beside whatever AMP's own
measured faults are (a loss in the thousands overflows a 65536 loss scale): the diagnosis of precision is
only as good as the FP32 twin it compares with. A loss that only gets noisier,
one that jumps and comes back down, or a negative loss (no scale to compare) stays quiet; a non-finite
FP32 loss is ``fp32-divergence``'s, and data at fault (``extreme-data``, ``nonfinite-data``) hides this
warning: batches of another scale make another loss.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

from ...engine.records import Column
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule
from ._helpers import fp32_finite, fp32_losses

MIN_STEPS = 9
"""At least this many finite FP32 steps (three in the last third): fewer say nothing about a trend."""
RISE = 2.0
"""The last third's median loss at least this many times the first third's."""


@dataclass(frozen=True)
class Fp32RiseEvidence(EvidenceRecord):
    """The FP32 probe's finite losses, the medians of their first and last thirds, and the rise between them."""

    probe: str
    """The probe whose losses rise (always ``fp32``)."""
    steps: int
    """The finite FP32 steps compared."""
    first_third_median: float
    last_third_median: float
    first_third_spread: float
    """The first third's largest loss minus its smallest: the rise must exceed this batch-to-batch noise."""
    losses: list[float]
    """The FP32 losses (the first 20)."""
    lr_range: list[float] | None
    """The FP32 probe's smallest and largest learning rate; None when its record has no LR."""


class Fp32LossRises(Rule):
    code = "fp32-loss-rises"
    severity = Severity.WARNING
    """Measured, but no mixed-precision fault: the FP32 twin itself trains away from its start."""
    order = 5
    evidence_type: ClassVar[type[EvidenceRecord]] = Fp32RiseEvidence
    verifiable = False
    fires_on = (
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(losses=[1.0 + 1.5 * i for i in range(10)]))),
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(losses=[1.0, 3.5, 2.2, 0.2, 0.9, 6.3, 0.7, 3.1, 5.4, 14.4]))
        ),
    )  # erratic, upwards
    quiet_on = (
        lambda: fx.evidence(),  # a falling loss
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(steps=9, losses=[2.0, 1.2, 3.0, 1.5, 2.8, 1.9, 2.2, 1.7, 2.5]))
        ),  # noisy, no trend
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(steps=9, losses=[3.0, 380.0, 1500.0, 1.5, 0.9, 0.8, 0.7, 0.7, 0.6]))
        ),  # a jump that came back
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(steps=6, losses=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0]))
        ),  # too short
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(losses=[0.3, 1.0, 0.9, 1.1, 0.8, 1.0, 0.9, 1.2, 0.7, 0.8]))
        ),  # one easy first batch
        lambda: fx.evidence(
            fp32=fx.probe(
                "fp32",
                fx.records(
                    steps=12,
                    losses=[
                        0.0074,
                        0.0034,
                        0.0065,
                        5e-9,
                        0.0145,
                        0.0026,
                        0.0028,
                        0.0071,
                        0.0092,
                        0.0005,
                        0.0114,
                        0.0291,
                    ],
                ),
            )
        ),  # wobbling near 0
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(losses=[1.0 + 1.5 * i for i in range(10)], nonfinite_grads=[9]))
        ),  # fp32-divergence's
        lambda: fx.evidence(
            fp32=fx.probe("fp32", fx.records(losses=[-3.0 + 0.5 * i for i in range(10)]))
        ),  # negative losses: no scale to compare
        lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(nonfinite_loss=[5]))),
    )  # non-finite: fp32-divergence's

    nothing_to_try = "the FP32 baseline rises too: the learning rate, the schedule or the loss is at fault, and no precision setting changes that"

    def check(self, ev: Evidence) -> list[Finding]:
        losses = fp32_losses(ev, MIN_STEPS) if fp32_finite(ev) else None  # non-finite gradients: fp32-divergence's
        if losses is None:
            return []
        fp32 = ev.fp32
        assert fp32 is not None
        third = len(losses) // 3
        first, last = statistics.median(losses[:third]), statistics.median(losses[-third:])
        spread = max(losses[:third]) - min(losses[:third])
        if first <= 0 or last < RISE * first or last - first <= spread:
            return []
        lrs = [float(v) for v in fp32.records[Column.LR]] if "lr" in fp32.records else []
        evidence = Fp32RiseEvidence(
            probe="fp32",
            steps=len(losses),
            first_third_median=first,
            last_third_median=last,
            first_third_spread=spread,
            losses=losses[:20],
            lr_range=[min(lrs), max(lrs)] if lrs else None,
        )
        return [
            self.finding(
                f"The loss rises in FP32 too: from {first:.4g} to {last:.4g} (the medians of the first and the last {third} "
                f"steps), every step finite: the FP32 twin AMP is compared with does not converge",
                evidence,
                Fix(
                    "Make the FP32 training converge first (a lower learning rate or a warm-up, the loss's sign and "
                    "normalisation, the inputs' scale), then diagnose again: AMP's skips and drift on a diverging "
                    "training come from its growing gradients, not from fp16."
                ),
            )
        ]
