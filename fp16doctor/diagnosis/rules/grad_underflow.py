"""Gradients flush to zero in fp16: loss scaling off or too small.

Evidence: the gradients non-zero in fp32 but zero in AMP (same weights and
batch), per parameter and per activation gradient, as a share of the elements
and of the gradient's L1 mass. Over 5% calls for a higher scale; the alarm is on the mass: elements many orders
below the rest of their tensor (a sharp softmax's tails, gradients that are
zero in exact arithmetic and rounding noise in fp32) carry nothing when they
flush, and a tensor whose whole gradient is under 1e-4 of the typical one is
such noise. Flushing gradients are a warning of what they can lead to (layers
that stop learning); they are an error once a symptom they explain is measured.
Where the scale the step ran at (the scaler's recorded scale: 1 when the step never
calls the scaler) already lies at or above the window's low end (the
scale that keeps 99.9% of the FP32 gradients' mass), zeros in AMP's gradients
were not made by too small a scale (a linear attention whose normaliser
overflowed to inf zeroes its values' gradients): the rule stays quiet rather than
tell the user to enable the scaler they run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ...config import scaler_patch
from ...engine.records import Column
from ...measure.records import GradientColumn
from ...measure.thresholds import UNDERFLOW_ALARM
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind, Severity
from . import Rule
from ._helpers import fp32_finite, scale_patch


@dataclass(frozen=True)
class WorstFlush(EvidenceRecord):
    """The gradient that flushes most of its mass to zero in fp16."""

    kind: str
    """``param`` (a parameter's gradient) or ``act`` (the gradient w.r.t. a module's output)."""
    name: str
    """The parameter's or the module's name."""
    observed_underflow: float
    """The share of its elements non-zero in fp32 and zero in AMP."""
    observed_underflow_mass: float
    """The share of its fp32 L1 mass in those elements."""


@dataclass(frozen=True)
class GradUnderflowEvidence(EvidenceRecord):
    """Gradients non-zero in fp32 that AMP flushed to zero, and the loss scale the step ran at against the window."""

    worst: WorstFlush
    tensors_over_5pct: int
    """How many gradients flush more than the alarm's share of their mass."""
    scaler_enabled: bool
    configured_scale: float | None
    """The configured initial loss scale; None with the scaler off."""
    scale_used: float | None
    """The loss scale AMP's step ran at (1 where the step never calls the scaler); None with the scaler off."""
    scale_window: list[float] | None
    """[low, high]: the loss scales that keep FP32's gradients representable in fp16; None when not measured."""
    window_feasible: bool | None
    """Whether any scale fits the window; None when not measured."""
    recommended: dict[str, Any]
    """The scaler settings the fix recommends (its config patch's ``scaler``)."""


class GradUnderflow(Rule):
    code = "grad-underflow"
    severity = Severity.WARNING
    """Measured on gradients, not on the training: the triage makes it an error when a symptom it explains is measured."""
    order = 71
    evidence_type: ClassVar[type[EvidenceRecord]] = GradUnderflowEvidence
    explains = ("trajectory-drift", "lost-updates", "same-state-gap")
    repairs = (RepairKind.SCALER_SCALE,)
    names_cases = (
        lambda: (
            fx.repair("scaler-scale", config_patch=scaler_patch(init_scale=2.0**20), symptoms=("lost-updates",)),
            fx.evidence(),
        ),
        lambda: (
            fx.repair(
                "scaler-scale",
                config_patch=scaler_patch(enabled=True, init_scale=65536.0),
                symptoms=("trajectory-drift",),
            ),
            fx.evidence(config=scaler_patch(enabled=False)),
        ),
    )

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """Loss scaling switched on, or a higher initial scale, repaired it: gradients were flushing to zero."""
        new = repair.config_patch.get("scaler", {}).get("init_scale")
        return repair.kind == RepairKind.SCALER_SCALE and (
            not ev.config.scaler.enabled or (new is not None and new > ev.config.scaler.init_scale)
        )

    triggers = ("no_loss_scaling.py",)
    fires_on = (
        lambda: fx.evidence(
            config=scaler_patch(enabled=False),
            window=fx.window(512.0, 1e6),
            observed_underflow=fx.underflow(("0.weight", 0.6, 0.4, False)),
        ),
        # 65536 configured, but the step never calls the scaler: it ran at a scale of 1
        lambda: fx.evidence(
            amp=fx.probe(scaler_called=False, record=fx.records(scales=[1.0] * 10)),
            window=fx.window(56.4, 1e6),
            observed_underflow=fx.underflow(("attn.v", 1.0, 1.0, False)),
        ),
        # the scaler ran, but settled at 8 after overflows: below the 56 the gradients need
        lambda: fx.evidence(
            amp=fx.probe(record=fx.records(scales=[8.0] * 10)),
            window=fx.window(56.4, 1e6),
            observed_underflow=fx.underflow(("attn.v", 1.0, 1.0, False)),
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            window=fx.window(512.0, 1e6), observed_underflow=fx.underflow(("0.weight", 0.6, 0.01, False))
        ),
        lambda: fx.evidence(
            window=fx.window(512.0, 1e6), observed_underflow=fx.underflow(("attn.key.bias", 0.6, 0.6, True))
        ),
        # the configured 65536 already keeps the gradients (the window starts at 56): the zeros are not scaling's
        lambda: fx.evidence(window=fx.window(56.4, 1e6), observed_underflow=fx.underflow(("attn.v", 1.0, 1.0, False))),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        if (
            ev.config.dtype != "float16"
            or not fp32_finite(ev)
            or ev.observed_underflow is None
            or ev.observed_underflow.empty
        ):
            return []
        if ev.amp is None or ev.amp.first_nonfinite_loss is not None:
            return []  # a forward that overflows zeroes gradients for other reasons
        observed = ev.observed_underflow
        if GradientColumn.NEGLIGIBLE in observed:  # rounding noise of an exact-zero gradient
            observed = observed[~observed[GradientColumn.NEGLIGIBLE].astype(bool)]
        if observed.empty:
            return []
        observed = observed.sort_values(GradientColumn.OBSERVED_UNDERFLOW_MASS, ascending=False)
        worst = observed.iloc[0]
        if worst[GradientColumn.OBSERVED_UNDERFLOW_MASS] <= UNDERFLOW_ALARM:
            return []
        flagged = observed[observed[GradientColumn.OBSERVED_UNDERFLOW_MASS] > UNDERFLOW_ALARM]
        patch = scale_patch(ev)
        configured = ev.config.scaler.init_scale if ev.config.scaler.enabled else None
        window = ev.window
        used = _scale_used(ev)
        if configured is not None and window is not None and window.feasible and used >= window.low:
            # The scale the step ran at already keeps 99.9% of the FP32 gradients' mass: zeros in AMP's gradients
            # are not scaling's to cure (a forward that made them, e.g. a division by an overflowed sum), and
            # telling the user to enable the scaler they run would be wrong.
            return []
        if configured is not None:  # curing underflow never means a smaller scale
            patch["scaler"]["init_scale"] = max(patch["scaler"]["init_scale"], configured)
        if window is not None and not window.feasible:
            summary = (
                f"No single loss scale fits: keeping 99.9% of the gradient mass needs {window.low:.3g}, while the "
                f"largest gradients overflow above {window.high:.3g}. Use init_scale "
                f"{patch['scaler']['init_scale']:.0f} (the sweep's best measured setting), or train in bf16."
            )
        elif window is not None:
            summary = (
                f"Enable GradScaler with init_scale {patch['scaler']['init_scale']:.0f} (the smallest scale keeping "
                f"99.9% of the gradient mass is {window.low:.3g})."
            )
        else:
            summary = "Enable GradScaler."
        uncalled = configured is not None and ev.amp is not None and not ev.amp.scaler_called
        if uncalled:  # a GradScaler is configured, but the step never scales its loss
            summary = (
                "Your step never calls scaler.scale(loss), so it runs at a loss scale of 1 whatever the config "
                "says: scale the loss, then unscale and step through the scaler. " + summary.replace("Enable", "Use", 1)
            )
        if not uncalled and configured is not None and window is not None and window.feasible and used < configured:
            summary = (
                f"The step ran at a loss scale of {used:g}: GradScaler backed off from {configured:g} after "
                f"overflows, below the {window.low:.3g} that keeps 99.9% of the gradient mass. Remove what "
                f"overflows at the higher scale (the other findings), then keep init_scale "
                f"{patch['scaler']['init_scale']:.0f}."
            )
        return [
            self.finding(
                f"{worst['observed_underflow']:.0%} of {worst['kind']} gradients of '{worst['name']}' "
                f"({worst['observed_underflow_mass']:.0%} of their mass) flush to zero in fp16"
                + (
                    " (loss scaling is off)"
                    if configured is None
                    else " (the step never calls the scaler: loss scale 1)"
                    if uncalled
                    else f" at loss scale {used:.0f}"
                )
                + ": the layers they feed can stop learning",
                GradUnderflowEvidence(
                    worst=WorstFlush(
                        kind=worst[GradientColumn.KIND],
                        name=worst[GradientColumn.NAME],
                        observed_underflow=float(worst[GradientColumn.OBSERVED_UNDERFLOW]),
                        observed_underflow_mass=float(worst[GradientColumn.OBSERVED_UNDERFLOW_MASS]),
                    ),
                    tensors_over_5pct=len(flagged),
                    scaler_enabled=ev.config.scaler.enabled,
                    configured_scale=configured,
                    scale_used=used if configured is not None else None,
                    scale_window=[window.low, window.high] if window is not None else None,
                    window_feasible=window.feasible if window is not None else None,
                    recommended=patch["scaler"],
                ),
                Fix(
                    summary,
                    code=(
                        f"scaler = torch.amp.GradScaler('cuda', init_scale={patch['scaler']['init_scale']:.0f})\n"
                        "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()"
                    ),
                    config_patch=patch,
                ),
            )
        ]


def _scale_used(ev: Evidence) -> float:
    """The loss scale AMP's step ran at (the median of its recorded scales): 1 where the step never calls the
    scaler, whatever the config says."""
    amp = ev.amp
    if amp is None or not amp.scaler_called or amp.records.empty:
        return 1.0
    scales = amp.records[Column.LOSS_SCALE].astype(float)
    scales = scales[scales.map(math.isfinite)]
    return float(scales.median()) if len(scales) else ev.config.scaler.init_scale
