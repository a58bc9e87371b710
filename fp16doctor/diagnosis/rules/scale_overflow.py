"""The loss scale is too high: gradients overflow in backward step after step.

Evidence: AMP steps skipped (or with non-finite gradients when the training
scales by hand: then the overflowed gradients reach the weights and the loss
turns NaN one step later) while the fp32 loss and gradients stay finite: a scale that
never settles, a settling that costs more than ten skipped steps (from
init_scale down to the largest safe scale derived from fp32 gradients, at the
configured backoff), or a quarter of the steps after settling still
overflowing. A few skips while a default scale settles are normal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ...config import scaler_patch
from ...engine.records import Column
from ...measure.symptoms import attempts, skip_runs
from ...measure.thresholds import CALIBRATION_SKIPS, PERSISTENT_OVERFLOW_SHARE
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, ProbeSummary, Repair, RepairKind, Severity
from . import Rule
from ._helpers import fp32_finite, scale_patch


@dataclass(frozen=True)
class ScaleOverflowEvidence(EvidenceRecord):
    """AMP steps whose gradients overflowed at the GradScaler's scale, against how long its settling should take."""

    overflow_steps: list[int]
    """The steps skipped or with non-finite gradients (the first 30)."""
    leading_skips: int
    """How many steps overflowed in a row from the start (all of them: the scale never settled)."""
    persistent_share: float
    """The share of the steps after the leading run that still overflowed."""
    expected_settling_skips: int
    """The skips the configured scaler needs to back off from init_scale to ``max_safe_scale``."""
    scale_first: float
    scale_last: float
    scaler_enabled: bool
    max_safe_scale: float | None
    """The largest scale that keeps FP32's gradients within fp16's range; None when not measured."""
    recommended: dict[str, Any]
    """The scaler settings the fix recommends (its config patch's ``scaler``)."""


@dataclass(frozen=True)
class HandRolledScaleEvidence(EvidenceRecord):
    """AMP steps whose gradients overflowed under a static loss scale the step applies by hand."""

    overflow_steps: list[int]
    """The steps with non-finite gradients (the first 30)."""
    scaler_called: bool
    """Whether the step called scaler.scale() (never, for this shape)."""


def predicted_settling() -> Evidence:
    """Ten leading skips, the scale settling at 64, where the FP32 gradients allow 2: the window predicts a longer
    settling than calibration, the measured skips are calibration's."""
    scales = [2.0 ** (16 - min(i, 10)) for i in range(30)]
    return fx.evidence(window=fx.window(1e-3, 2.0), amp=fx.probe(record=fx.records(30, range(10), scales=scales)))


class ScaleOverflow(Rule):
    code = "scale-overflow"
    order = 70
    evidence_type: ClassVar[type[EvidenceRecord]] = ScaleOverflowEvidence
    explains = ("skips", "nonfinite", "trajectory-drift")
    repairs = (RepairKind.SCALER_SCALE,)
    names_cases = (
        lambda: (
            fx.repair("scaler-scale", config_patch=scaler_patch(init_scale=256.0), symptoms=("skips",)),
            fx.evidence(),
        ),
    )

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """A lower initial scale repaired it: the scale was too high."""
        new = repair.config_patch.get("scaler", {}).get("init_scale")
        return (
            repair.kind == RepairKind.SCALER_SCALE
            and ev.config.scaler.enabled
            and new is not None
            and new < ev.config.scaler.init_scale
        )

    triggers = ("scale_too_high.py",)
    fires_on = (
        lambda: fx.evidence(amp=fx.probe(record=fx.records(skipped=range(10)))),
        # mse_loss(reduction='sum') over 256x3x32x32: FP32's gradients overflow fp16 above a scale of 14.6
        lambda: fx.evidence(window=fx.window(2.6e-4, 14.6), amp=fx.probe(record=fx.records(skipped=range(10)))),
        lambda: fx.evidence(
            amp=fx.probe(
                record=fx.records(nonfinite_grads=range(10), nonfinite_loss=range(1, 10)),
                scaler_called=False,
                scaler_enabled=False,
            )
        ),
        # ten leading skips (calibration, no symptom) where the window predicts eleven: a prediction, a warning
        predicted_settling,
    )
    quiet_on = (
        lambda: fx.evidence(amp=fx.probe(record=fx.records(skipped=[0, 1]))),
        # every step skipped while the scale halved down to 2^-4: gradients that are NaN at any scale (0/0)
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(steps=20, skipped=range(20), scales=[2.0 ** (16 - i) for i in range(20)]))
        ),
        lambda: fx.evidence(amp=fx.probe(record=fx.records(nonfinite_loss=[0]))),
        # every step skipped though the scale fell to 64, below the 512 the FP32 gradients allow
        lambda: fx.evidence(
            window=fx.window(1.0, 512.0),
            amp=fx.probe(record=fx.records(steps=10, skipped=range(10), scales=[2.0 ** (16 - i) for i in range(10)])),
        ),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if amp is None or amp.exception is not None or not fp32_finite(ev):
            return []
        if amp.first_nonfinite_loss is not None and not self._weights_poisoned_by_hand(amp):
            return []  # the forward itself overflows: no loss scale causes that
        rec = attempts(amp.records)
        overflowing = (rec[Column.SKIPPED].astype(bool) | rec[Column.NONFINITE_GRADS].astype(bool)).tolist()
        if not any(overflowing):
            return []
        leading = next((i for i, bad in enumerate(overflowing) if not bad), len(overflowing))
        after = overflowing[leading:]
        persistent = sum(after) / len(after) if after else 1.0
        settling = self._expected_settling(ev)
        measured = (  # the skips themselves pass calibration: a symptom
            leading == len(overflowing)
            or leading > CALIBRATION_SKIPS
            or (persistent >= PERSISTENT_OVERFLOW_SHARE and sum(after) >= 3)
        )
        if not (measured or settling > CALIBRATION_SKIPS):
            return []
        lowest = float(rec[Column.LOSS_SCALE].min())
        safe = ev.window.high if ev.window is not None and math.isfinite(ev.window.high) else 0.0
        if amp.scaler_called and leading == len(overflowing) and (lowest <= 1.0 or lowest <= safe):
            # the scale backed off to 1, or to what the FP32 gradients allow, and every step still overflows:
            # not a scale too high
            return []
        steps = [int(s) for s, bad in zip(rec[Column.STEP], overflowing) if bad]
        runs = skip_runs(steps)
        if not amp.scaler_called:  # the step scales by hand: the measured window carries its static factor
            return [self._hand_rolled(steps, len(rec))]
        patch = scale_patch(ev)
        why = (
            f"the scale never settled in {len(rec)} steps"
            if leading == len(overflowing)
            else f"settling from init_scale {ev.config.scaler.init_scale:.3g} takes ~{settling} skipped steps"
            if settling > CALIBRATION_SKIPS
            else f"{persistent:.0%} of the steps after settling still overflow"
        )
        return [
            self.finding(
                f"Gradients overflow in {len(steps)} of {len(rec)} AMP steps (longest run {max(map(len, runs))}): {why}; the loss scale is too high",
                ScaleOverflowEvidence(
                    overflow_steps=steps[:30],
                    leading_skips=leading,
                    persistent_share=persistent,
                    expected_settling_skips=settling,
                    scale_first=float(rec[Column.LOSS_SCALE].iloc[0]),
                    scale_last=float(rec[Column.LOSS_SCALE].iloc[-1]),
                    scaler_enabled=amp.scaler_enabled,
                    max_safe_scale=ev.window.high if ev.window is not None else None,
                    recommended=patch["scaler"],
                ),
                Fix(
                    f"Use dynamic loss scaling from init_scale {patch['scaler']['init_scale']:.0f} with backoff 0.5."
                    + _summed_loss_hint(ev),
                    code=f"scaler = torch.amp.GradScaler('cuda', init_scale={patch['scaler']['init_scale']:.0f}, backoff_factor=0.5)",
                    config_patch=patch,
                ),
                severity=None if measured else Severity.WARNING,  # only the window's predicted settling
            )
        ]

    def _hand_rolled(self, steps: list[int], total: int) -> Finding:
        # No config patch: the file's train_step scales by hand, so the scaler settings of the
        # config never reach it; the fix is the code change below (nothing for the doctor to try).
        return self.finding(
            f"Gradients overflow in {len(steps)} of {total} AMP steps, and the step never calls scaler.scale(): a static, hand-rolled loss scale is too high",
            HandRolledScaleEvidence(overflow_steps=steps[:30], scaler_called=False),
            Fix(
                "Replace the hand-rolled static scaling by the GradScaler passed to train_step (dynamic: it backs off on overflow).",
                code=(
                    "scaler.scale(loss).backward()      # instead of (loss * STATIC_SCALE).backward()\n"
                    "scaler.unscale_(optimizer)\nscaler.step(optimizer)\nscaler.update()"
                ),
            ),
        )

    @staticmethod
    def _weights_poisoned_by_hand(amp: ProbeSummary) -> bool:
        """A hand-scaled step without a GradScaler applies overflowed gradients: the loss turns NaN only after them."""
        grads, loss = amp.first_nonfinite_grads, amp.first_nonfinite_loss
        return not amp.scaler_called and grads is not None and loss is not None and grads < loss

    @staticmethod
    def _expected_settling(ev: Evidence) -> int:
        """Skips the configured scaler needs to come down from init_scale to the largest safe scale."""
        scaler = ev.config.scaler
        if ev.window is None or not scaler.enabled or scaler.init_scale <= ev.window.high:
            return 0
        return math.ceil(math.log(scaler.init_scale / ev.window.high) / math.log(1 / scaler.backoff_factor))


SUMMED_LOSS_SCALE = 256.0
"""A largest safe scale below this (FP32's gradients within a factor of 256 of fp16's 65504 at scale 1) is far
from the 2^16 GradScaler starts at: gradients that large usually come from a loss summed over the batch."""


def _summed_loss_hint(ev: Evidence) -> str:
    """Where the sweep measured that even small scales overflow, what usually makes gradients that large: a loss
    summed (``reduction='sum'``) over batch x elements grows with both, and a scale fitted to it holds only at
    this batch size."""
    window = ev.window
    if window is None or not math.isfinite(window.high) or window.high >= SUMMED_LOSS_SCALE:
        return ""
    return (
        f" The gradients overflow above a scale of {window.high:.3g} (measured on FP32's). Where the loss is summed "
        "over the batch and its elements (reduction='sum'), that is what makes them so large: divide it by the "
        "batch size or use reduction='mean', and the default scale fits again at any batch size; where it is a mean, "
        "the gradients are that large themselves (an initialisation, unnormalised inputs or targets)."
    )
