"""Normalisation layers stored in half precision (running statistics and affine weights in fp16).

Evidence: the precision map: norm modules with fp16/bf16 parameters or buffers
while the rest of the model keeps fp32. Running variances accumulate in fp16's
3 digits and its small range; under autocast PyTorch keeps them fp32. A frozen
normalisation layer (its parameters not trained, as in an fp16 teacher) is not
counted. A static fact: a warning of what it can lead to, an error once a
symptom it explains is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import overrides_patch
from ...engine.records import Inventory
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule
from ._helpers import LOW_DTYPES, is_norm


@dataclass(frozen=True)
class HalfNormEvidence(EvidenceRecord):
    """The trained normalisation layers stored in half precision, as the precision map lists them."""

    modules: list[str]
    types: list[str]
    """Each module's class name."""
    param_dtypes: list[str | None]
    """Each module's parameter dtypes, as the precision map lists them."""
    buffer_dtypes: list[str | None]
    """Each module's buffer dtypes (running statistics), as the precision map lists them."""
    compute_dtypes: list[str | None]
    """The dtype each module's forward computed in under autocast."""


class HalfBatchnorm(Rule):
    code = "half-batchnorm"
    severity = Severity.WARNING
    """A static fact: the triage makes it an error when a symptom it explains is measured."""
    order = 41
    evidence_type: ClassVar[type[EvidenceRecord]] = HalfNormEvidence
    explains = ("nonfinite", "amp-exception", "skips", "same-state-gap", "trajectory-drift")
    triggers = ("half_batchnorm.py",)
    fires_on = (
        lambda: fx.evidence(
            amp=fx.probe(precision=fx.precision(("1", "BatchNorm2d", "float16", "float16", "float32")))
        ),
    )
    quiet_on = (
        lambda: fx.evidence(
            amp=fx.probe(precision=fx.precision(("1", "BatchNorm2d", "float32", "float32", "float32")))
        ),
        lambda: fx.evidence(
            amp=fx.probe(precision=fx.precision(("teacher.1", "BatchNorm2d", "float16", "float16", None, True)))
        ),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        if ev.amp is None:
            return []
        table = ev.amp.precision
        norms = table[table[Inventory.TYPE].map(is_norm) & ~table[Inventory.FROZEN].astype(bool)]
        stored_half = norms[
            norms[Inventory.PARAM_DTYPES].fillna("").str.contains("|".join(LOW_DTYPES))
            | norms[Inventory.BUFFER_DTYPES].fillna("").str.contains("|".join(LOW_DTYPES))
        ]
        if stored_half.empty:
            return []
        names = stored_half[Inventory.MODULE].tolist()
        return [
            self.finding(
                f"{len(names)} normalisation layer(s) stored in half precision: {', '.join(names[:5])}; their running "
                "statistics and weights keep fp16's 3 digits and range, which can make the loss drift or overflow",
                HalfNormEvidence(
                    modules=names,
                    types=stored_half[Inventory.TYPE].tolist(),
                    param_dtypes=stored_half[Inventory.PARAM_DTYPES].tolist(),
                    buffer_dtypes=stored_half[Inventory.BUFFER_DTYPES].tolist(),
                    compute_dtypes=stored_half[Inventory.COMPUTE_DTYPE].tolist(),
                ),
                Fix(
                    "Keep normalisation layers (weights and running statistics) in fp32; autocast feeds them correctly.",
                    code="for m in model.modules():\n    if isinstance(m, torch.nn.modules.batchnorm._NormBase):\n        m.float()   # and drop the .half() on them",
                    config_patch=overrides_patch(fp32_modules=names),
                ),
            )
        ]
