"""FSDP casts the parameters themselves to fp16 (``param_dtype=torch.float16``) and no GradScaler scales the loss.

With an fp16 ``param_dtype`` every op of the forward and backward runs in fp16, not only those autocast would cast,
and the gradients FSDP hands its reduction are fp16 tensors: a gradient below fp16's smallest subnormal (2^-24,
about 6e-8) is 0 before any reduction sees it, and one above 65504 is inf. A loss scale is what keeps the small
ones; bf16 (``param_dtype=torch.bfloat16``) has fp32's range and needs none. Under FSDP2 a plain
``torch.amp.GradScaler`` decides for every rank (its inf check reads DTensor gradients, combined across the ranks);
FSDP1 needs ``ShardedGradScaler``.

Evidence: the parallel stage's FSDP policy (``param_dtype`` float16) and the parallel AMP pass's loss scaling, which
is the doctor's own GradScaler: off where the config's ``dtype`` is bfloat16 (the bf16 probe runs no scaler) or
``scaler.enabled`` is false. A static fact, a warning: the underflow or overflow it leads to is measured by the
other rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule


@dataclass(frozen=True)
class Fp16ParamsUnscaledEvidence(EvidenceRecord):
    """FSDP's fp16 ``param_dtype`` beside a training whose loss no GradScaler scales."""

    world: int
    topology: str
    param_dtype: str
    """The policy's ``param_dtype`` (float16)."""
    scaler_enabled: bool
    """Whether the parallel AMP pass scaled its loss (false here)."""
    why_unscaled: str
    """Why the loss was not scaled: the config's dtype is bfloat16, or its scaler.enabled is false."""


class Fp16ParamsUnscaled(Rule):
    code = "fp16-params-unscaled"
    severity = Severity.WARNING
    """A static fact: a warning until a symptom (underflow, an overflow) is measured, which other rules report."""
    order = 67
    evidence_type: ClassVar[type[EvidenceRecord]] = Fp16ParamsUnscaledEvidence
    verifiable = False
    """The fix changes the training's policy or loop; the doctor cannot apply it to FSDP's parameters."""
    fires_on = (
        lambda: fx.evidence(parallel=fx.parallel({"param_dtype": "float16"}, scaler_enabled=False)),
        lambda: fx.evidence(
            parallel=fx.parallel({"param_dtype": "float16"}, scaler_enabled=False), config={"dtype": "bfloat16"}
        ),
    )
    quiet_on = (
        lambda: fx.evidence(parallel=fx.parallel({"param_dtype": "float16"}, scaler_enabled=True)),  # scaled
        lambda: fx.evidence(parallel=fx.parallel({"param_dtype": "bfloat16"}, scaler_enabled=False)),  # bf16's range
        lambda: fx.evidence(parallel=None),  # no parallel stage
    )

    def check(self, ev: Evidence) -> list[Finding]:
        parallel = ev.parallel
        if parallel is None or parallel.policy is None or parallel.scaler_enabled is not False:
            return []
        if parallel.policy.get("param_dtype") != "float16":
            return []
        bf16 = ev.config.dtype == "bfloat16"
        why = "the config's dtype is bfloat16, which runs no GradScaler" if bf16 else "scaler.enabled is false"
        evidence = Fp16ParamsUnscaledEvidence(parallel.world, parallel.topology, "float16", False, why)
        title = (
            f"{parallel.topology} casts the parameters to fp16 (param_dtype=torch.float16) and no GradScaler scales "
            f"the loss ({why}): gradients below 6e-8 are 0 in the fp16 backward"
        )
        if bf16:
            fix = Fix(
                "The training means bf16: cast the parameters to bf16, whose range needs no loss scale.",
                code="fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32))",
            )
        else:
            fix = Fix(
                "Scale the loss: a GradScaler around the fp16 backward (under FSDP2 torch.amp.GradScaler, whose "
                "inf check reads the DTensor gradients of every rank; under FSDP1 ShardedGradScaler), or bf16 "
                "parameters.",
                code="scaler = torch.amp.GradScaler()  # config: scaler: {enabled: true}\n"
                "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()",
            )
        return [self.finding(title, evidence, fix)]
