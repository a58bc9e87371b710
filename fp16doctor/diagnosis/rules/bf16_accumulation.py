"""FSDP accumulates gradients over micro-batches in bf16: ``param_dtype=torch.bfloat16`` with ``reduce_dtype``
bf16 or unset, and several backward passes per optimizer step.

bf16 keeps 8 significant bits. FSDP reduces the gradients in ``reduce_dtype`` (``param_dtype`` where unset), and
where gradient sync is off between micro-batches (``set_requires_gradient_sync(False)``, the usual accumulation
under FSDP2) it accumulates the unsharded gradients in that dtype too: every micro-batch's gradient of every rank
is then a bf16-rounded term of one sum, micro-batches x ranks of them, and a small gradient added to a large
running sum is lost. A sum of n such terms is off by up to (n - 1) x 2^-8 of its magnitude; from 4 terms on that
passes the 1% a reduction should stay within. ``reduce_dtype=torch.float32`` makes FSDP accumulate and reduce in
fp32 while the parameters stay bf16.

Evidence: the parallel stage's FSDP policy, the micro-batches per optimizer step of the parallel AMP pass, the
world size, and the bound. The reduction of one micro-batch is measured (half-precision-reduce); the accumulation
is a static fact and a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...measure.thresholds import BF16_SUMMED_TERMS
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule

BF16_UNIT_ROUNDOFF = 2.0**-8
"""Half bf16's spacing above 1.0 (2^-7, notes "Formats")."""


@dataclass(frozen=True)
class Bf16AccumulationEvidence(EvidenceRecord):
    """A bf16 accumulation and reduction of the gradients over micro-batches and ranks."""

    world: int
    topology: str
    reduce_dtype: str | None
    """The policy's ``reduce_dtype`` (None: unset, FSDP reduces and accumulates in ``param_dtype``)."""
    param_dtype: str | None
    micro_batches: int
    """Backward passes per optimizer step, measured in the parallel AMP pass."""
    summed_terms: int
    """micro_batches x world: the bf16-rounded gradients that make one optimizer step's gradient."""
    error_bound: float
    """(summed_terms - 1) x 2^-8: the relative error such a sum may reach."""


class Bf16Accumulation(Rule):
    code = "bf16-accumulation"
    severity = Severity.WARNING
    """A static fact: the reduction of one micro-batch is measured by half-precision-reduce."""
    order = 87
    evidence_type: ClassVar[type[EvidenceRecord]] = Bf16AccumulationEvidence
    verifiable = False
    """The fix is a change to the policy in parallelize(); the doctor has no config patch for it."""
    fires_on = (
        lambda: fx.evidence(parallel=fx.parallel({"reduce_dtype": None}, micro_steps=4)),
        lambda: fx.evidence(parallel=fx.parallel({"reduce_dtype": "bfloat16"}, micro_steps=2)),
    )
    quiet_on = (
        lambda: fx.evidence(parallel=fx.parallel({"reduce_dtype": None}, micro_steps=1)),  # no accumulation
        lambda: fx.evidence(parallel=fx.parallel({"reduce_dtype": "float32"}, micro_steps=4)),  # fp32 accumulation
        lambda: fx.evidence(parallel=fx.parallel({"param_dtype": "float16", "reduce_dtype": None}, micro_steps=4)),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        parallel = ev.parallel
        if parallel is None or parallel.policy is None or parallel.reduce_dtype != "bfloat16":
            return []
        micro = parallel.micro_batches
        terms = micro * parallel.world
        if micro < 2 or terms < BF16_SUMMED_TERMS:
            return []  # one micro-batch's reduction alone is half-precision-reduce's, measured
        policy = parallel.policy
        bound = (terms - 1) * BF16_UNIT_ROUNDOFF
        evidence = Bf16AccumulationEvidence(
            parallel.world,
            parallel.topology,
            policy.get("reduce_dtype"),
            policy.get("param_dtype"),
            micro,
            terms,
            bound,
        )
        by = "reduce_dtype=torch.bfloat16" if policy.get("reduce_dtype") else "param_dtype bf16, reduce_dtype unset"
        title = (
            f"{parallel.topology} accumulates and reduces the gradients in bf16 ({by}) over {micro} micro-batches "
            f"x {parallel.world} ranks: {terms} bf16-rounded terms, up to {bound:.1%} off"
        )
        fix = Fix(
            "Accumulate and reduce the gradients in fp32: reduce_dtype=torch.float32 in the MixedPrecisionPolicy "
            "(the parameters stay bf16).",
            code="fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32))",
        )
        return [self.finding(title, evidence, fix)]
