"""The ranks reduce their gradients in half precision, and the reduction, not any rank, breaks the training.

A DDP communication hook such as ``fp16_compress_hook`` casts each bucket of fp32 master gradients to fp16 before
the all-reduce. A gradient no rank's fp16 backward ever stored (a parameter kept in fp32, gradients accumulated over
micro-batches, the loss scale on top) can pass 65504 in that cast, and the GradScaler then skips every step until
its scale has fallen far enough; gradients below fp16's subnormals (training without a loss scale, as in bf16)
flush to zero. In one process nothing of this shows.

Evidence: the parallel stage's measurement under torchrun, the reduction as the training makes it against the same
reduction in fp32, parameter by parameter: the worst parameter and its module, its relative error (inf where the
reduction made an inf or NaN from finite local gradients), the largest local gradient handed to it, the hooks and
the world size, the same worst error at the other of 2 and 4 ranks (its growth), and for an fp16 reduction the
largest value it is predicted to hold (the largest local gradient, summed over the ranks after FSDP2's pre-divide
factor) against 65504. An error where the parallel training shows a symptom that the same training with its reduction in
fp32 does not (the fix, tried under torchrun on the same weights and batches), or where the reduction made an inf or
NaN of gradients every rank held finite while the ranks show a symptom (the fp32-reduced training failing too: a
second cause on top); a warning where the reduction is measurably worse than fp32's rounding but the probe's steps
show no symptom yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pandas as pd
import torch

from ...config import sharding_patch
from ...engine.emulated_ranks import divide_factors
from ...measure.symptoms import Symptom
from ...tensors import FP16_MAX
from .. import rule_cases as fx
from ..findings import (
    Evidence,
    EvidenceRecord,
    Finding,
    Fix,
    ParallelComparison,
    ReductionAtWorld,
    Severity,
    omitted_when_none,
)
from . import Rule

DDP_FIX = Fix(
    "Reduce the gradients in fp32: remove the compression hook (DDP's default all-reduce averages the fp32 master "
    "gradients in fp32).",
    code="ddp = DistributedDataParallel(model)  # without ddp.register_comm_hook(None, fp16_compress_hook)",
)


def _fsdp_fix(policy: dict[str, Any], wrapper: str = "fully_shard") -> Fix:
    """FSDP's policy with its reduction in fp32, its parameters' dtype kept as the training has it: FSDP2's
    ``MixedPrecisionPolicy``, or FSDP1's ``MixedPrecision`` (``wrapper="fsdp1"``)."""
    # the user's own settings, which the fix keeps: each wrapper's own fields
    kept_fields = ("param_dtype", "buffer_dtype") if wrapper == "fsdp1" else ("param_dtype", "output_dtype")
    keep = "".join(f"{k}=torch.{policy[k]}, " for k in kept_fields if policy.get(k) not in (None, "None"))
    if wrapper != "fsdp1" and policy.get("cast_forward_inputs") is False:
        keep += "cast_forward_inputs=False, "
    if wrapper == "fsdp1":
        where, code = "FSDP's MixedPrecision", "FullyShardedDataParallel(model, mixed_precision=MixedPrecision("
    else:
        where, code = "the MixedPrecisionPolicy", "fully_shard(module, mp_policy=MixedPrecisionPolicy("
    return Fix(
        f"Reduce the gradients in fp32: set reduce_dtype=torch.float32 in {where} (the parameters may stay in "
        "param_dtype).",
        code=f"{code}{keep}reduce_dtype=torch.float32))",
    )


def _fix(parallel: ParallelComparison) -> Fix:
    if parallel.policy is None:
        return DDP_FIX
    fsdp1 = parallel.topology.startswith("FullyShardedDataParallel")  # FSDP2's class is FSDP<the model's>
    return _fsdp_fix(parallel.policy, "fsdp1" if fsdp1 else "fully_shard")


FSDP2_FP16_REDUCE = {
    "param_dtype": "bfloat16",
    "reduce_dtype": "float16",
    "output_dtype": "float32",
    "cast_forward_inputs": True,
}
"""The cases' FSDP2 policy: bf16 parameters, the gradients reduce-scattered in fp16."""


@dataclass(frozen=True)
class HalfPrecisionReduceEvidence(EvidenceRecord):
    """The parallel stage's measurement of the gradient reduction against the same reduction in fp32."""

    world: int
    """The ranks the parallel stage ran."""
    topology: str
    """What ``parallelize()`` returned (``DistributedDataParallel`` by default)."""
    hooks: list[str]
    """The communication hooks the training registers."""
    parameter: str
    """The parameter whose reduced gradient strays furthest from the fp32 reduction."""
    module: str
    relative_error: float | str
    """Its worst step's relative error against the fp32 reduction ("inf": the reduction made an inf or NaN; "not
    measured": a topology whose reduction the stage does not measure)."""
    nonfinite_steps: int
    """Steps where its reduced gradient was not finite while every rank's local gradient was."""
    local_max: float
    """The largest |local gradient| a rank handed to its reduction (scaled by the loss scale, as reduced)."""
    parallel_symptoms: list[str]
    """What the parallel training measured against the parallel FP32 baseline."""
    repaired_symptoms: list[str]
    """What it measured with the reduction made in fp32."""
    parallel_only: bool
    """The single-process triage is healthy: the fault needs the ranks."""
    growth: dict[str, float | str]
    """World size -> the worst parameter's relative error there ("inf": an inf or NaN; "not measured: ..." where the
    machine or that run did not allow it): the world size's own and the other of 2 and 4 (half-precision
    reductions only)."""
    reduction_peak: float | None = omitted_when_none()
    """fp16 reductions: the largest magnitude the reduction is predicted to hold, from the largest local gradient,
    the world size and the divide factors (FSDP2 casts each rank's gradient to fp16, divides it by a pre-divide
    factor and sums over the ranks: local_max x world / predivide; DDP's fp16_compress_hook casts it and divides by
    the world size before the sum: local_max)."""
    headroom: float | None = omitted_when_none()
    """fp16 reductions: 65504 / reduction_peak, the factor the gradients may still grow by before the reduction
    overflows (below 1: it overflows)."""


def reduction_peak(parallel: ParallelComparison, local_max: float) -> float | None:
    """The largest magnitude an fp16 reduction holds, predicted from the largest local gradient (None: not fp16)."""
    if parallel.reduce_dtype != "float16":
        return None
    if parallel.policy is not None and not parallel.hooks:  # FSDP: cast, pre-divide, sum over the ranks
        pre, _ = divide_factors(parallel.world, torch.float16)  # FSDP2's, as the emulated ranks divide
        return local_max * max(1.0, parallel.world / pre)
    return local_max  # a compression hook: cast, divided by the world size, summed


def _growth(parallel: ParallelComparison) -> dict[str, float | str]:
    return {str(world): _at(parallel.growth[world]) for world in sorted(parallel.growth)}


def _at(at: ReductionAtWorld) -> float | str:
    return f"not measured: {at.not_measured}" if at.not_measured is not None else _error(at.relative_error)


@dataclass(frozen=True)
class EmulatedReduceEvidence(EvidenceRecord):
    """The reduction of a sharded run's ranks, emulated in one process (``config.sharding``: a sharded capsule's
    replay), as it ran: where it made an inf or NaN from every rank's finite local gradients."""

    world: int
    """The ranks emulated."""
    param_dtype: str | None
    """The policy's param_dtype (null: the parameters' own dtype)."""
    reduce_dtype: str | None
    """The policy's reduce_dtype (null: param_dtype's)."""
    parameter: str
    """The parameter whose reduced gradient the reduction made non-finite most often."""
    module: str
    nonfinite_steps: list[int]
    """The AMP probe's steps where the reduction made its gradient non-finite from finite local ones."""
    local_max: float
    """The largest finite |local gradient| a rank handed the reduction (scaled by the loss scale, as reduced)."""


def emulated_case(nonfinite_steps: list[int], symptoms: list[str]) -> Evidence:
    """A sharded capsule's replay: two emulated ranks reducing in fp16, the head's bias broken by the reduction."""
    from ...engine.emulated_ranks import ReductionReading

    reading = ReductionReading(
        local_max={"head.bias": 7.8e4, "trunk.weight": 12.0},
        nonfinite_steps={"head.bias": nonfinite_steps} if nonfinite_steps else {},
    )
    ev = fx.evidence(amp=fx.probe(emulated_reduction=reading))
    ev.config.sharding.world = 2
    ev.config.sharding.param_dtype, ev.config.sharding.reduce_dtype = "bfloat16", "float16"
    ev.symptoms = [Symptom(code, code) for code in symptoms]
    return ev


def reduction_case(
    error: float,
    nonfinite: int,
    symptoms: list[str],
    repaired: list[str],
    single: list[str] | None = None,
    hooks: list[str] | None = None,
    policy: dict[str, Any] | None = None,
    local_max: float = 8.0e5,
    growth: dict[int, float] | None = None,
) -> Evidence:
    """A parallel stage's comparison: two ranks, fp16_compress_hook, the head's weight as the worst parameter;
    ``growth``: the worst relative error measured at other world sizes."""
    ev = fx.evidence()
    table = pd.DataFrame(
        [
            ("head.weight", "head", 64, error, nonfinite, local_max, 0 if nonfinite else None),
            ("trunk.0.weight", "trunk.0", 1536, 3e-4, 0, 12.0, None),
        ],
        columns=["name", "module", "numel", "relative_error", "nonfinite_steps", "local_max", "first_nonfinite_step"],
    )
    ev.parallel = ParallelComparison(
        world=2,
        topology="DistributedDataParallel",
        parallelized_by="parallelize()",
        hooks=(["fp16_compress_hook"] if policy is None else []) if hooks is None else hooks,
        policy=policy,
        symptoms=[Symptom(code, f"{code} with 2 ranks") for code in symptoms],
        repaired_symptoms=[Symptom(code, f"{code} with 2 ranks") for code in repaired],
        single_process_symptoms=single or [],
        reduction=table,
        ranks_agree=True,
        growth={
            world: ReductionAtWorld(world, "head.weight", "head", error, 0, local_max)
            for world, error in (growth or {}).items()
        },
    )
    ev.symptoms = list(ev.parallel.symptoms)
    return ev


class HalfPrecisionReduce(Rule):
    code = "half-precision-reduce"
    order = 86
    evidence_type: ClassVar[type[EvidenceRecord]] = HalfPrecisionReduceEvidence
    explains = ("nonfinite", "skips", "trajectory-drift", "lost-updates")
    suppresses = ("scale-overflow", "scale-growth", "grad-underflow")
    """Gradients the reduction overflows or flushes, every rank's own being finite: a loss scale low enough
    repairs that too (it shrinks what the reduction holds), but the reduction's dtype is the cause."""
    verifiable = False
    """The fix is a change to parallelize() (no config patch); it is verified by the parallel stage's fp32-reduction pass."""
    training_files = ("bf16_prices_fp16_hook.py",)
    nothing_to_try = "the parallel stage did not run the training with its reduction in fp32"
    fires_on = (
        lambda: reduction_case(float("inf"), 6, ["skips", "trajectory-drift"], []),
        # the reduction overflows, and an overflow in the backward skips the fp32-reduced steps too: both faults
        lambda: reduction_case(float("inf"), 20, ["skips"], ["skips"]),
        lambda: reduction_case(0.4, 0, ["trajectory-drift"], []),
        lambda: reduction_case(0.05, 0, [], []),  # measurably worse than rounding, no symptom yet: a warning
        lambda: reduction_case(4e-4, 0, [], []),  # an fp16 hook within rounding: the fact and its headroom, a warning
        # within rounding at 2 ranks, an overflow at 4: the warning leads with it
        lambda: reduction_case(4e-4, 0, [], [], growth={4: float("inf")}),
        lambda: emulated_case([0, 1], ["skips"]),  # a sharded capsule's emulated ranks
        # FSDP2 reducing in fp16 within rounding: its headroom, after the pre-divide factor, a warning
        lambda: reduction_case(4e-4, 0, [], [], policy=FSDP2_FP16_REDUCE, local_max=0.5),
        # FSDP2 with reduce_dtype unset reduces in param_dtype: bf16 here, a warning
        lambda: reduction_case(2e-3, 0, [], [], policy={**FSDP2_FP16_REDUCE, "reduce_dtype": None}),
    )
    quiet_on = (
        lambda: reduction_case(1e-7, 0, [], [], hooks=[]),  # DDP's default reduction in fp32
        lambda: reduction_case(1e-7, 0, ["nonfinite"], ["nonfinite"], ["nonfinite"], hooks=[]),  # every process fails
        lambda: emulated_case([], ["nonfinite"]),  # emulated ranks whose own gradients were already non-finite
        # FSDP2 whose policy reduces in fp32: nothing in half precision
        lambda: reduction_case(1e-7, 0, [], [], policy={**FSDP2_FP16_REDUCE, "reduce_dtype": "float32"}),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        parallel = ev.parallel
        if parallel is None:
            return self._emulated(ev)
        if not (parallel.reduction_faulty or parallel.half_precision_reduction):
            return []
        if not parallel.measured_reduction:
            return [self._unmeasured(parallel)]
        worst = parallel.worst()
        assert worst is not None
        repairs = bool(parallel.symptoms) and not parallel.repaired_symptoms
        evidence = HalfPrecisionReduceEvidence(
            world=parallel.world,
            topology=parallel.topology,
            hooks=list(parallel.hooks),
            parameter=str(worst["name"]),
            module=str(worst["module"]),
            relative_error=_error(worst["relative_error"]),
            nonfinite_steps=int(worst["nonfinite_steps"]),
            local_max=float(worst["local_max"]),
            parallel_symptoms=[s.code for s in parallel.symptoms],
            repaired_symptoms=[s.code for s in parallel.repaired_symptoms],
            parallel_only=parallel.parallel_only,
            growth=_growth(parallel),
            **_peak(parallel, float(worst["local_max"])),
        )
        fix = _fix(parallel)
        if repairs:
            return [self.finding(_title(parallel, evidence), evidence, fix)]
        if evidence.nonfinite_steps and parallel.symptoms:
            # measured: the reduction made inf or NaN of gradients every rank held finite; the same training reduced
            # in fp32 still fails, so another cause sits on top of it, and both need their fix
            still = ", ".join(s.code for s in parallel.repaired_symptoms)
            title = _title(parallel, evidence) + (
                f"; reduced in fp32 the ranks still show {still}: another cause on top of it" if still else ""
            )
            return [self.finding(title, evidence, fix)]
        if parallel.reduction_faulty:
            title = _title(parallel, evidence) + "; the probe's steps show no symptom of it yet"
        else:
            title = _headroom(parallel, evidence)
        return [self.finding(title, evidence, fix, severity=Severity.WARNING)]

    def _emulated(self, ev: Evidence) -> list[Finding]:
        """The emulated ranks of a sharded capsule: the reduction broke gradients every rank held finite."""
        reading = ev.amp.emulated_reduction if ev.amp is not None else None
        worst = reading.worst() if reading is not None else None
        if reading is None or worst is None:
            return []
        sharding = ev.config.sharding
        evidence = EmulatedReduceEvidence(
            world=sharding.world,
            param_dtype=sharding.param_dtype,
            reduce_dtype=sharding.reduce_dtype,
            parameter=worst,
            module=worst.rpartition(".")[0],
            nonfinite_steps=list(reading.nonfinite_steps[worst]),
            local_max=reading.local_max.get(worst, 0.0),
        )
        policy = {"param_dtype": sharding.param_dtype, "reduce_dtype": sharding.reduce_dtype}
        dtype = sharding.reduce_dtype or sharding.param_dtype
        ddp = sharding.wrapper == "ddp"
        by = f"DDP's compression hook ({dtype})" if ddp else f"reduce_dtype=torch.{dtype}"
        title = (
            f"{by} turns {worst}'s finite gradients (up to {evidence.local_max:.3g} as reduced) into inf or NaN on "
            f"{len(evidence.nonfinite_steps)} step(s) of the {sharding.world} ranks' reduction, emulated in one process"
        )
        fix = replace(
            DDP_FIX if ddp else _fsdp_fix(policy, sharding.wrapper), config_patch=sharding_patch(reduce_dtype="float32")
        )
        measured = {s.code for s in ev.symptoms} & set(self.explains)
        severity = None if measured else Severity.WARNING
        return [self.finding(title if measured else title + "; no symptom measured", evidence, fix, severity=severity)]

    def _unmeasured(self, parallel: ParallelComparison) -> Finding:
        """A half-precision reduction the stage could not measure (FSDP1's flat parameters): the fact, a warning."""
        evidence = HalfPrecisionReduceEvidence(
            world=parallel.world,
            topology=parallel.topology,
            hooks=list(parallel.hooks),
            parameter="",
            module="",
            relative_error="not measured",
            nonfinite_steps=0,
            local_max=0.0,
            parallel_symptoms=[s.code for s in parallel.symptoms],
            repaired_symptoms=[s.code for s in parallel.repaired_symptoms],
            parallel_only=parallel.parallel_only,
            growth={},
        )
        title = f"The gradients are reduced in half precision ({parallel.half_precision_reduction}); the reduction "
        title += f"of {parallel.topology} is not measured"
        return self.finding(title, evidence, _fix(parallel), severity=Severity.WARNING)

    def intervention(self, finding: Finding, ev: Evidence) -> Any:
        """The parallel stage's third pass: the same training, its reduction made in fp32, already measured; for
        emulated ranks, the config patch that makes their reduction fp32."""
        from ..verify import Intervention, Outcome

        if finding.fix.config_patch:
            return super().intervention(finding, ev)
        parallel = ev.parallel
        if parallel is None or "fp32_reduce" not in parallel.records:
            return None
        outcome = Outcome(
            amp=parallel.records["fp32_reduce"],
            fp32=parallel.records["fp32"],
            symptoms=list(parallel.repaired_symptoms),
        )
        return Intervention(
            f"the {parallel.world}-rank training with its gradient reduction in fp32 (under torchrun)",
            measured=outcome,
        )


def _error(value: Any) -> float | str:
    number = float(value)
    return number if number != float("inf") else "inf"


def _peak(parallel: ParallelComparison, local_max: float) -> dict[str, float | None]:
    peak = reduction_peak(parallel, local_max)
    headroom = FP16_MAX / peak if peak else None
    return {"reduction_peak": peak, "headroom": headroom}


def _headroom(parallel: ParallelComparison, evidence: HalfPrecisionReduceEvidence) -> str:
    """A half-precision reduction measured within rounding of fp32: the fact, its growth, fp16's headroom left."""
    broken = [world for world, error in evidence.growth.items() if error == "inf" and int(world) != parallel.world]
    what = f"The gradients are reduced in half precision ({parallel.half_precision_reduction}), measured within "
    what += f"{float(evidence.relative_error):.1g} of fp32 over {parallel.world} ranks"
    if broken:  # a sum that overflows at more ranks: said first, where it cannot be missed
        what = (
            f"The gradients are reduced in half precision ({parallel.half_precision_reduction}): over "
            f"{' and '.join(broken)} ranks the reduction makes an inf or NaN of finite gradients; over "
            f"{parallel.world} it is within {float(evidence.relative_error):.1g} of fp32"
        )
    others = [
        f"{float(error):.1g} over {world}"
        for world, error in evidence.growth.items()
        if int(world) != parallel.world and not isinstance(error, str)
    ]
    if others:
        what += " (" + ", ".join(others) + ")"
    if evidence.reduction_peak is not None and evidence.headroom is not None:
        summed = evidence.reduction_peak != evidence.local_max
        what += f"; the largest local gradient, {evidence.local_max:.3g} as reduced"
        what += f", summed over the ranks after FSDP's pre-divide to {evidence.reduction_peak:.3g}," if summed else ","
        what += f" leaves {evidence.headroom:.3g}x of fp16's range"
    return what


def _title(parallel: ParallelComparison, evidence: HalfPrecisionReduceEvidence) -> str:
    by = parallel.half_precision_reduction or f"{parallel.topology}'s reduction"
    if evidence.nonfinite_steps:
        what = (
            f"{by} turns {evidence.parameter}'s finite gradients (up to {evidence.local_max:.3g} as reduced) into "
            f"inf or NaN on {evidence.nonfinite_steps} step(s): fp16 cannot hold them"
        )
    else:
        what = (
            f"{by} reduces {evidence.parameter}'s gradient {float(evidence.relative_error):.1%} away from the same "
            "reduction in fp32"
        )
    return f"{what} ({parallel.world} ranks)"
