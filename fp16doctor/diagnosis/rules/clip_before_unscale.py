"""Gradients clipped while still scaled: the clip threshold is off by the loss scale.

Evidence: the training step's clip_grad_norm_/clip_grad_value_ calls, observed
while the GradScaler had scaled the loss but not yet unscaled the gradients.
A threshold of 1.0 then clips to 1/65536 of the intended norm. The call order
is a fact about the code: a warning of what it can lead to (a crawling or
drifting training), an error once a symptom it explains is measured (Adam,
nearly invariant to the gradient's size, often shows none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from ...engine.records import Column
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, RepairKind, Severity
from . import Rule


@dataclass(frozen=True)
class ClipBeforeUnscaleEvidence(EvidenceRecord):
    """The clipping calls made on gradients the GradScaler had scaled and not yet unscaled."""

    calls: int
    """How many such calls (in as many steps)."""
    first_step: int
    function: str
    """The first call's function: ``clip_grad_norm_`` or ``clip_grad_value_``."""
    scale: float
    """The loss scale the first call's gradients carried."""


class ClipBeforeUnscale(Rule):
    code = "clip-before-unscale"
    severity = Severity.WARNING
    """A fact about the code: the triage makes it an error when a symptom it explains is measured."""
    order = 65
    evidence_type: ClassVar[type[EvidenceRecord]] = ClipBeforeUnscaleEvidence
    explains = ("trajectory-drift", "lost-updates", "same-state-gap")
    repairs = (RepairKind.UNSCALE_BEFORE_CLIP,)
    names_cases = (lambda: (fx.repair("unscale-before-clip", symptoms=("trajectory-drift",)), fx.evidence()),)
    triggers = ("clip_before_unscale.py",)
    fires_on = (
        lambda: fx.evidence(
            amp=fx.probe(clip_calls=[{"function": "clip_grad_norm_", "scaled": True, "scale": 65536.0, "step": 0}])
        ),
        lambda: fx.evidence(
            amp=fx.probe(clip_calls=[{"function": "clip_grad_value_", "scaled": True, "scale": 65536.0, "step": 0}])
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            amp=fx.probe(clip_calls=[{"function": "clip_grad_norm_", "scaled": False, "scale": 65536.0, "step": 0}])
        ),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        if ev.amp is None:
            return []
        scaled = [c for c in ev.amp.clip_calls if c["scaled"] and c["scale"] > 1.0]
        if not scaled:
            return []
        first = scaled[0]
        return [
            self.finding(
                f"{first['function']} runs on scaled gradients (scale {first['scale']:.0f}) in {len(scaled)} step(s): "
                "the threshold is off by the scale, which can make the training crawl",
                ClipBeforeUnscaleEvidence(
                    calls=len(scaled),
                    first_step=first[Column.STEP],
                    function=first["function"],
                    scale=first["scale"],
                ),
                Fix(
                    "Call scaler.unscale_(optimizer) before clipping, so the threshold applies to the true gradients.",
                    code=(
                        "scaler.scale(loss).backward()\n"
                        "scaler.unscale_(optimizer)          # first unscale...\n"
                        + _clip_line(first["function"])
                        + "scaler.step(optimizer)\n"
                        "scaler.update()"
                    ),
                    config_patch=overrides_patch(unscale_before_clip=True),
                ),
            )
        ]


def _clip_line(function: str) -> str:
    """The user's own clipping call, after the unscale (clip_grad_value_ keeps its clip value, not a norm)."""
    if function == "clip_grad_value_":
        return "torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)   # ...then clip\n"
    return "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # ...then clip\n"
