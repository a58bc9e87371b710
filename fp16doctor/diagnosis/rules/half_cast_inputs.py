"""FSDP casts the model's inputs to fp16 (``cast_forward_inputs``) and they hold values fp16 cannot: inf before
the first layer.

With ``param_dtype=torch.float16`` and ``cast_forward_inputs=True`` (FSDP2's default) every floating tensor the
model's forward is called with is cast to fp16 first. A raw feature past 65504 (a price in dollars, a count, a
timestamp) is then inf before any op of the model runs, and whatever the forward does with it first, a
normalisation of its own included, runs on inf. Under autocast the same forward would normalise in fp32 and cast
only a matmul's operands.

Evidence: the parallel stage's FSDP policy (``param_dtype`` float16, ``cast_forward_inputs``) and the largest
magnitude among the floating inputs the model's forward was called with in the FP32 run. A static fact, a
warning: what the inf does is measured by the other rules (extreme-data, nonfinite symptoms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pandas as pd

from ...engine.records import Reading, Table
from ...tensors import FP16_MAX
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity
from . import Rule
from ._helpers import model_input_peak


@dataclass(frozen=True)
class HalfCastInputsEvidence(EvidenceRecord):
    """FSDP's fp16 cast of the model's inputs, and the largest input it casts."""

    world: int
    topology: str
    param_dtype: str
    cast_forward_inputs: bool
    input_abs_max: float
    """The largest |value| among the floating inputs of the model's forward (the FP32 run's)."""


def _inputs(peak: float) -> Evidence:
    forward = pd.DataFrame([{Reading.MODULE: "<root>", Reading.ABS_MAX: 3.0, Reading.INPUT_ABS_MAX: peak}])
    return fx.evidence(
        fp32=fx.probe("fp32", tables={Table.FORWARD: forward}),
        parallel=fx.parallel({"param_dtype": "float16"}),
    )


def _policy(ev: Evidence, **policy: object) -> Evidence:
    assert ev.parallel is not None and ev.parallel.policy is not None
    ev.parallel.policy.update(policy)
    return ev


class HalfCastInputs(Rule):
    code = "half-cast-inputs"
    severity = Severity.WARNING
    """A static fact beside a measured input: what the inf then does is measured by the other rules."""
    order = 21
    evidence_type: ClassVar[type[EvidenceRecord]] = HalfCastInputsEvidence
    verifiable = False
    """The fix is a change to the policy or the data; the doctor has no config patch for it."""
    fires_on = (lambda: _inputs(3.5e5),)
    quiet_on = (
        lambda: _inputs(40.0),  # standardised inputs: the cast only rounds
        lambda: _policy(_inputs(3.5e5), cast_forward_inputs=False),  # not cast
        lambda: _policy(_inputs(3.5e5), param_dtype="bfloat16"),  # bf16 holds them
    )

    def check(self, ev: Evidence) -> list[Finding]:
        parallel = ev.parallel
        policy = parallel.policy if parallel is not None else None
        if parallel is None or policy is None or policy.get("param_dtype") != "float16":
            return []
        if not policy.get("cast_forward_inputs"):
            return []
        peak = model_input_peak(ev.fp32)
        if peak is None or peak <= FP16_MAX:
            return []
        evidence = HalfCastInputsEvidence(parallel.world, parallel.topology, "float16", True, peak)
        title = (
            f"{parallel.topology} casts the model's inputs to fp16 (cast_forward_inputs with "
            f"param_dtype=torch.float16) and they reach {peak:.3g}: inf before the first layer"
        )
        fix = Fix(
            "Standardise the inputs before the model (fp16 holds up to 65504), or keep them in fp32: "
            "cast_forward_inputs=False on the root's policy, the first layer kept in fp32.",
            code="fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, "
            "cast_forward_inputs=False))",
        )
        return [self.finding(title, evidence, fix)]
