"""Trained parameters stored in half precision: no fp32 master weights, small updates are lost.

Evidence: the precision map (the dtypes of the parameters the training trains:
they require grad and an optimizer holds them), the share of updates lost below
the parameters' resolution, and GradScaler's "Attempting to unscale FP16
gradients" when the training uses one. Frozen half-precision modules (a
distillation teacher, a frozen encoder, an embedding table kept in fp16 on
purpose) are not the training's weights. Half weights are a static fact: a
warning of what they can lead to, an error only once a symptom they explain
(lost updates, skips, a non-finite step, GradScaler's refusal) is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from ...engine.records import Inventory, Reading, Table
from ...measure.records import ExceptionInfo
from ...measure.thresholds import HALF_WEIGHTS_LOST_SHARE
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Repair, RepairKind, Severity, omitted_when_none
from . import Rule
from ._helpers import half_param_modules, is_norm

UNSCALE_REFUSAL = "unscale FP16 gradients"
"""Part of GradScaler's message when its gradients are fp16 themselves (parameters stored in half precision): the
exception text is the only signal, and tests/test_pytorch_messages.py checks that PyTorch still raises it."""


@dataclass(frozen=True)
class HalfWeightsEvidence(EvidenceRecord):
    """The modules whose trained parameters are stored in half precision, and the share of updates lost."""

    modules: list[str]
    """The first twelve such modules (normalisation layers aside: half-batchnorm's)."""
    module_count: int
    param_dtypes: list[str]
    max_lost_update_share: float
    """The largest share of updates lost below a half parameter's resolution (NaN: not measured)."""
    exception: ExceptionInfo | None = omitted_when_none()
    """GradScaler's "Attempting to unscale FP16 gradients", when it raised."""


class HalfWeights(Rule):
    code = "half-weights"
    severity = Severity.WARNING
    """A static fact: the triage makes it an error when a symptom it explains is measured."""
    order = 40
    evidence_type: ClassVar[type[EvidenceRecord]] = HalfWeightsEvidence
    explains = ("nonfinite", "skips", "amp-exception", "lost-updates", "trajectory-drift", "same-state-gap")
    repairs = (RepairKind.FP32_WEIGHTS,)
    names_cases = (
        lambda: (
            fx.repair("fp32-weights"),
            fx.evidence(amp=fx.probe(precision=fx.precision(("0", "Linear", "float16", None, "float16")))),
        ),
    )

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """fp32 master weights repaired it, and the training's parameters were stored in half precision."""
        return repair.kind == RepairKind.FP32_WEIGHTS and not half_param_modules(ev.amp).empty

    triggers = ("model_half.py",)
    fires_on = (lambda: fx.evidence(amp=fx.probe(precision=fx.precision(("0", "Linear", "float16", None, "float16")))),)
    quiet_on = (
        lambda: fx.evidence(amp=fx.probe(precision=fx.precision(("1", "LayerNorm", "float16", None, "float32")))),
        lambda: fx.evidence(
            amp=fx.probe(
                precision=fx.precision(
                    ("student.0", "Linear", "float32", None, "float32"),
                    ("teacher.0", "Linear", "float16", None, None, True),
                )
            )
        ),
    )
    suppresses = ("half-batchnorm", "half-optimizer-state", "grad-underflow", "precision-gap", "loss-in-half")

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        all_half = half_param_modules(amp)
        half = all_half[~all_half["type"].map(is_norm)] if len(all_half) else all_half
        unscale_error = (
            amp is not None and amp.exception is not None and UNSCALE_REFUSAL in (amp.exception.message or "")
        )
        if half.empty and (not unscale_error or len(all_half)):
            return []  # nothing half, or only normalisation layers (half-batchnorm's case)
        lost = 0.0
        updates = amp.tables.get(Table.UPDATES) if amp else None
        if updates is not None and not updates.empty:
            lost = float(
                updates.loc[updates[Reading.DTYPE].isin(["float16", "bfloat16"]), Reading.LOST_UPDATE_SHARE].max()
                or 0.0
            )
        dtypes = sorted(set(",".join(half[Inventory.TRAINED_PARAM_DTYPES]).split(","))) if len(half) else ["float16"]
        evidence = HalfWeightsEvidence(
            modules=half[Inventory.MODULE].tolist()[:12],
            module_count=int(len(half)),
            param_dtypes=dtypes,
            max_lost_update_share=lost,
            exception=amp.exception if unscale_error and amp is not None else None,
        )
        patch = overrides_patch(fp32_weights=True)
        if ev.config.dtype == "float16" and (amp is None or amp.scaler_called):
            patch["scaler"] = {"enabled": True}  # a step that never calls the scaler would not read the setting
        consequence = (
            "the share of updates lost could not be measured"
            if math.isnan(lost)
            else f"{lost:.0%} of updates lost"
            if lost > HALF_WEIGHTS_LOST_SHARE
            else "this can lose small updates below their resolution, overflow in the optimizer step, "
            "or make GradScaler refuse the gradients"
        )
        return [
            self.finding(
                f"Trained parameters are stored in {'/'.join(d for d in dtypes if d)} ({len(half)} modules): "
                f"no fp32 master weights; {consequence}",
                evidence,
                Fix(
                    "Keep the model in fp32 and let autocast run the low-precision ops (master weights stay fp32, GradScaler works).",
                    code=(
                        "model = build_model()            # no model.half() / .to(torch.float16)\n"
                        "with torch.autocast('cuda', dtype=torch.float16):\n"
                        "    loss = loss_fn(model(x), y)\n"
                        "scaler.scale(loss).backward()"
                    ),
                    config_patch=patch,
                ),
            )
        ]
