"""FSDP's policy hands the loss half-precision outputs: ``param_dtype`` half and ``output_dtype`` unset.

FSDP2 casts a sharded module's floating outputs to ``output_dtype`` only where it is set; with ``param_dtype`` fp16
or bf16 and ``output_dtype=None`` the root's outputs (the logits, the predictions) leave the model in that dtype,
and the loss is computed in it unless the loss function casts them: a softmax or a squared error of fp16 values
overflows at 65504, a bf16 loss keeps about 2.4 significant digits. Under autocast the losses PyTorch lists run in
fp32 by themselves; under FSDP's cast parameters nothing does. ``output_dtype=torch.float32`` on the root's policy
gives the loss fp32 outputs.

Evidence: the parallel stage's FSDP policy of the root module (``param_dtype``, ``output_dtype``), and the dtype
its AMP pass's loss came out in: a loss in fp32 was computed from outputs the loss cast up (``logits.float()``), and
is left alone. A static fact, a warning: a loss made in half precision that overflows or stalls is measured by the
other rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import rule_cases as fx
from ..findings import HALF_DTYPES, Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule


@dataclass(frozen=True)
class HalfOutputsEvidence(EvidenceRecord):
    """The root module's FSDP policy, whose outputs leave the model in half precision."""

    world: int
    topology: str
    param_dtype: str
    output_dtype: str | None
    """The policy's ``output_dtype`` (None: unset, the outputs stay in ``param_dtype``)."""


class HalfOutputs(Rule):
    code = "half-outputs"
    severity = Severity.WARNING
    """A static fact: a loss that overflows in half precision is measured by the other rules."""
    order = 51
    evidence_type: ClassVar[type[EvidenceRecord]] = HalfOutputsEvidence
    verifiable = False
    """The fix is a change to the policy in parallelize(); the doctor has no config patch for it."""
    fires_on = (
        lambda: fx.evidence(parallel=fx.parallel({"output_dtype": None})),
        lambda: fx.evidence(parallel=fx.parallel({"param_dtype": "float16", "output_dtype": "float16"})),
    )
    quiet_on = (
        lambda: fx.evidence(parallel=fx.parallel()),  # output_dtype=torch.float32
        lambda: fx.evidence(parallel=fx.parallel({"param_dtype": None, "output_dtype": None})),  # fp32 parameters
        lambda: fx.evidence(parallel=None),  # no parallel stage
        lambda: fx.evidence(parallel=fx.parallel({"output_dtype": None}, loss_dtypes=["float32"])),  # loss casts up
    )

    def check(self, ev: Evidence) -> list[Finding]:
        parallel = ev.parallel
        policy = parallel.policy if parallel is not None else None
        if parallel is None or policy is None or "output_dtype" not in policy:
            return []  # FSDP1's MixedPrecision has no output_dtype
        param_dtype, output_dtype = policy.get("param_dtype"), policy.get("output_dtype")
        if param_dtype not in HALF_DTYPES or (output_dtype is not None and output_dtype not in HALF_DTYPES):
            return []
        if parallel.loss_dtypes and not any(d in HALF_DTYPES for d in parallel.loss_dtypes):
            return []  # the loss cast the outputs up: it ran in fp32
        half = output_dtype or param_dtype
        evidence = HalfOutputsEvidence(parallel.world, parallel.topology, param_dtype, output_dtype)
        unset = "output_dtype unset" if output_dtype is None else f"output_dtype=torch.{output_dtype}"
        title = (
            f"{parallel.topology}'s policy (param_dtype=torch.{param_dtype}, {unset}) hands the loss {half} outputs: "
            "the loss runs in half precision unless it casts them"
        )
        fix = Fix(
            "Give the loss fp32 outputs: output_dtype=torch.float32 in the root module's MixedPrecisionPolicy (or "
            "cast the outputs with .float() in the loss).",
            code=f"fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.{param_dtype}, "
            "reduce_dtype=torch.float32, output_dtype=torch.float32))",
        )
        return [self.finding(title, evidence, fix)]
