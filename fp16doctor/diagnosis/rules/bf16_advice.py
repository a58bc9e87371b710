"""Range problems that bf16 would avoid (fp32's exponent range), on a device that supports it.

Evidence: fp16 AMP overflowed or kept skipping steps, and a bf16 probe of the
same training stayed finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import config_patch, scaler_patch
from ...engine.records import Column
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule


@dataclass(frozen=True)
class Bf16AdviceEvidence(EvidenceRecord):
    """fp16 AMP's trouble next to a bf16 probe of the same training that stayed finite."""

    fp16_first_nonfinite: int | None
    """The fp16 AMP probe's first step with a non-finite loss; None when it had none (or did not run)."""
    fp16_skipped: int
    """How many optimizer steps the fp16 AMP probe's scaler skipped."""
    bf16_final_loss: float
    """The bf16 probe's last loss."""


class Bf16Advice(Rule):
    code = "bf16-advice"
    order = 100
    severity = Severity.INFO
    evidence_type: ClassVar[type[EvidenceRecord]] = Bf16AdviceEvidence
    verifiable = False
    fires_on = (lambda: fx.evidence(bf16=fx.probe("bf16")),)
    quiet_on = (lambda: fx.evidence(), lambda: fx.evidence(bf16=fx.probe("bf16", fx.records(nonfinite_loss=[3]))))

    def check(self, ev: Evidence) -> list[Finding]:
        if ev.bf16 is None or not ev.bf16.finite or not ev.bf16_supported:
            return []
        amp = ev.amp
        return [
            self.finding(
                "bf16 has fp32's range: a bf16 probe of this training stays finite",
                Bf16AdviceEvidence(
                    fp16_first_nonfinite=amp.first_nonfinite_loss if amp else None,
                    fp16_skipped=len(amp.skip_steps) if amp else 0,
                    bf16_final_loss=float(ev.bf16.records[Column.LOSS].iloc[-1]),
                ),
                Fix(
                    "Train in bfloat16 (no loss scaling needed), at the cost of precision (about 2-3 significant digits).",
                    code="with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = loss_fn(model(x), y)\nloss.backward()",
                    config_patch=config_patch(scaler_patch(enabled=False), dtype="bfloat16"),
                ),
            )
        ]
