"""Stage 10, the parallel training: with ``--nproc N``, the training runs as its ranks run it, under torchrun.

A single process does not show what the ranks compute together: a gradient reduction in half precision (DDP's
compression hooks), what one rank's batch does to all of them, ranks that drift apart. So the AMP probe runs under
torchrun (gloo on CPU, nccl on CUDA) with the model wrapped as the training file's ``parallelize(model)`` wraps it
(DDP by default), every rank taking its own batches, from the same weights (:mod:`fp16doctor.engine.parallel`):

* the FP32 baseline in the same topology, its reduction in fp32;
* the training as it runs, its reduction measured against the same reduction in fp32, parameter by parameter;
* the same with its reduction made in fp32: the fix, tried on the same weights and batches.

The ranks are compared after every pass. The reduction is measured for DDP (its communication hook, whichever it
is) and FSDP2 (each parameter group's reduce-scatter, in its policy's ``reduce_dtype``); FSDP1's flat-parameter
reduce-scatter is not measured yet, and the finding says so.

Where the reduction is in half precision, its growth with the ranks is measured too: the training as it runs, alone
(no FP32 baseline, no repair), at the other of 2 and 4 ranks, its reduction against fp32 as above. A half-precision
sum's error grows with its terms, but FSDP2 divides the gradients before an fp16 reduce-scatter, so how it grows is
measured, not assumed. On CUDA a world larger than the GPUs is not run (:func:`~fp16doctor.engine.parallel.growth_worlds`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from ...config import apply_patch, build_config
from ...engine.parallel import (
    ParallelRequest,
    ParallelResult,
    fingerprints_agree,
    growth_worlds,
    request_for,
    run_parallel,
)
from ...errors import DoctorError, first_line
from ...measure.compare import wrapping_words
from ...measure.symptoms import Symptom, baseline_symptoms, measure
from ..findings import ParallelComparison, ReductionAtWorld, StageName, StageReport, StageStatus
from .context import StageContext, measured_symptoms


def stage_parallel(ctx: StageContext) -> StageReport:
    if ctx.nproc <= 1:
        return StageReport(StageName.PARALLEL, StageStatus.SKIPPED, "one process (--nproc N runs the ranks)")
    ev = ctx.evidence
    shared = shared_cores(ctx.nproc, ctx.bench.device.type, os.cpu_count() or 1)
    if shared:
        ctx.bench.spec.note(shared)
    request = request_for(ctx.bench.spec.path, ctx.config, ev.steps)
    with tempfile.TemporaryDirectory(prefix="fp16doctor-parallel-") as folder:
        result = run_parallel(request, ctx.nproc, Path(folder), ctx.rank_timeout)
        single = measured_symptoms(ctx, ctx.config, ev.amp, ev.fp32, None)
        ev.parallel = comparison_of(result, [s.code for s in single], bf16=ctx.config.dtype == "bfloat16")
        if ev.parallel.half_precision_reduction and ev.parallel.measured_reduction:
            growth, seconds = _growth(request, ctx.nproc, Path(folder), ctx.rank_timeout)
            ev.parallel.growth.update(growth)
            ev.parallel.seconds += seconds
    return StageReport(StageName.PARALLEL, StageStatus.RAN, _sentence(ev.parallel), details=ev.parallel.to_json())


def shared_cores(nproc: int, device: str, cores: int) -> str | None:
    """Where gloo's ranks outnumber the CPU cores, what that changes: the time, not the numbers."""
    if device != "cpu" or nproc <= cores:
        return None
    return (
        f"{nproc} ranks share this machine's {cores} CPU cores: the parallel stage runs slower, not differently "
        "(each rank computes what it would alone)"
    )


def corrected_on_ranks(
    ctx: StageContext, patch: dict[str, Any], reduce_in_fp32: bool
) -> dict[str, list[Symptom]] | str:
    """The training as its ranks run it with the corrected config, against the parallel stage's FP32 baseline: the
    symptoms left on the ranks (``as_run``), and with ``reduce_in_fp32`` also with its reduction in fp32
    (``fp32_reduce``: the change to ``parallelize()`` a half-precision reduction calls for), both in one launch;
    where the run failed, why, in words."""
    assert ctx.evidence.parallel is not None, "the ranks ran before"
    from ..verify import Intervention

    config = build_config(apply_patch(ctx.config.to_dict(), patch))
    request = request_for(ctx.bench.spec.path, config, ctx.evidence.steps)
    names: tuple[str, ...] = ("as_run", "fp32_reduce") if reduce_in_fp32 else ("as_run",)
    # a patch that changes FP32 too (a lower rate, the loss in float64) is measured against FP32 run with it
    anew = Intervention("the corrected config", config_patch=patch).touches_fp32
    with tempfile.TemporaryDirectory(prefix="fp16doctor-corrected-") as folder:
        try:
            passes = ("fp32", *names) if anew else names
            result = run_parallel(
                dataclasses.replace(request, passes=passes), ctx.nproc, Path(folder), ctx.rank_timeout
            )
        except DoctorError as exc:
            return first_line(exc)
    fp32 = result.passes["fp32"].records if anew else ctx.evidence.parallel.records["fp32"]
    bf16 = config.dtype == "bfloat16"
    return {name: _symptoms(result.passes[name].records, fp32, bf16, ctx.nproc) for name in names}


def _growth(
    request: ParallelRequest, world: int, folder: Path, rank_timeout: float
) -> tuple[dict[int, ReductionAtWorld], float]:
    """The as-run reduction at the other world sizes of 2 and 4: that pass alone, its reduction measured. A run
    that fails there (a batch count the data lacks, a shape FSDP cannot shard so) is said, not raised: the
    diagnosis at ``world`` ranks stands."""
    runs, skipped = growth_worlds(world)
    found = {w: ReductionAtWorld(w, not_measured=why) for w, why in skipped.items()}
    alone = dataclasses.replace(request, passes=("as_run",))
    seconds = 0.0
    for other in runs:
        try:
            result = run_parallel(alone, other, folder / f"growth{other}", rank_timeout)
        except DoctorError as exc:
            found[other] = ReductionAtWorld(other, not_measured=first_line(exc))
            continue
        seconds += result.seconds
        table = _with_modules(result.passes["as_run"].reduction)
        worst = _worst(table)
        found[other] = (
            ReductionAtWorld.of(other, worst)
            if worst is not None
            else ReductionAtWorld(other, not_measured="no gradient was reduced")
        )
    return found, seconds


def _worst(table: pd.DataFrame) -> pd.Series | None:
    if not len(table):
        return None
    return table.sort_values(["nonfinite_steps", "relative_error"], ascending=False, kind="stable").iloc[0]


def comparison_of(result: ParallelResult, single: list[str], bf16: bool) -> ParallelComparison:
    fp32 = result.passes["fp32"].records
    passes = result.passes
    return ParallelComparison(
        world=result.world,
        topology=result.topology,
        parallelized_by=result.parallelized_by,
        hooks=result.hooks,
        policy=result.policy,
        symptoms=_symptoms(passes["as_run"].records, fp32, bf16, result.world),
        repaired_symptoms=_symptoms(passes["fp32_reduce"].records, fp32, bf16, result.world),
        single_process_symptoms=single,
        reduction=_with_modules(passes["as_run"].reduction),
        ranks_agree=all(fingerprints_agree(p.fingerprints) for p in passes.values()),
        records={name: p.records for name, p in passes.items()},
        seconds=result.seconds,
        scaler_enabled=result.scaler_enabled,
        growth=_own_growth(result),
        loss_dtypes=passes["as_run"].loss_dtypes,
    )


def _own_growth(result: ParallelResult) -> dict[int, ReductionAtWorld]:
    worst = _worst(_with_modules(result.passes["as_run"].reduction))
    return {} if worst is None else {result.world: ReductionAtWorld.of(result.world, worst)}


def _symptoms(records: pd.DataFrame, fp32: pd.DataFrame, bf16: bool, world: int) -> list[Symptom]:
    """The symptoms of a parallel pass against the parallel FP32 baseline, each saying it was measured on the ranks."""
    found = baseline_symptoms(fp32) + measure(records, fp32, bf16=bf16)
    return [
        Symptom(s.code, f"with {world} ranks: {s.description}", {**s.measured, "ranks": world}, s.step) for s in found
    ]


def _with_modules(table: pd.DataFrame) -> pd.DataFrame:
    """The reduction table with each parameter's module (its name without the last part)."""
    table = table.copy()
    table.insert(1, "module", [name.rpartition(".")[0] or name for name in table["name"]])
    return table


def _policy_reduction(policy: dict[str, Any] | None) -> str:
    """How the gradients are reduced where no hook is registered: FSDP's ``reduce_dtype``, or DDP's default."""
    if policy is None:
        return "DDP's default all-reduce"
    reduce_dtype = policy.get("reduce_dtype")
    return f"reduce_dtype=torch.{reduce_dtype}" if reduce_dtype else "reduced in the parameters' dtype"


def _sentence(comparison: ParallelComparison) -> str:
    hooks = ", ".join(comparison.hooks) or _policy_reduction(comparison.policy)
    where = f"{comparison.world} ranks, {wrapping_words(comparison.topology, comparison.parallelized_by)}, {hooks}"
    if comparison.symptoms:
        verdict = "the parallel training fails (" + ", ".join(s.code for s in comparison.symptoms) + ")"
        verdict += "; only when parallelised" if comparison.parallel_only else "; in one process too"
        if not comparison.repaired_symptoms:
            verdict += "; healthy with the reduction in fp32"
    else:
        verdict = "the parallel training is healthy"
    worst = comparison.worst()
    if worst is None:
        reduction = f"the reduction is not measured for {comparison.topology}"
    else:
        error = worst["relative_error"]
        reduction = (
            f"the reduction's worst error against fp32 is {error:.2g} ({worst['name']})"
            if error != float("inf")
            else f"the reduction made an inf or NaN in {worst['name']} at step {int(worst['first_nonfinite_step'])} "
            f"from finite local gradients (up to {worst['local_max']:.3g})"
        )
    ranks = "the ranks agree" if comparison.ranks_agree else "the ranks disagree"
    return f"{verdict}; {reduction}{_growth_words(comparison)}; {ranks} ({where}; {comparison.seconds:.1f} s)"


def _growth_words(comparison: ParallelComparison) -> str:
    """The reduction's worst error at the other world sizes measured: ", 3.1e-04 at 4 ranks (fc)"."""
    parts = []
    for world, at in sorted(comparison.growth.items()):
        if world == comparison.world:
            continue
        if at.not_measured is not None:
            parts.append(f"not measured at {world} ranks ({at.not_measured})")
        elif math.isinf(at.relative_error):
            parts.append(f"an inf or NaN at {world} ranks ({at.parameter})")
        else:
            parts.append(f"{at.relative_error:.2g} at {world} ranks ({at.parameter})")
    return ", " + ", ".join(parts) if parts else ""
