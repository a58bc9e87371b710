"""Stage 9, the compiled training: where the training compiles, its AMP probe runs compiled too, as the user runs it.

The instrumented probes run the eager module (a compiled graph hides the modules and the aten operators), but the
compiled program's numerics are not eager's: inductor computes fp16/bf16 element-wise chains and reductions in fp32
registers and rounds only what it stores, and a compiler can miscompile. So the compiled AMP probe, from the same
weights and batches, is compared with the eager one against the same FP32 baseline:

* both healthy or both failing: the diagnosis stands for both;
* only eager fails: the training as it runs is healthy (the triage then says where eager would fail, as warnings);
* only the compiled training fails: ``compiled-divergence``, localised by backend, from the least compiled up:
  ``eager`` (dynamo's graph capture), ``aot_eager`` (and AOT autograd's decompositions), then the training's own
  backend, and inductor where the training's is a custom one. Where only inductor fails, PyTorch's compiler
  bisector then runs the compiled probe again and again to find the subsystem (a group of passes, a setting, the
  lowerings) and the application in it that makes the fault: a lowering's graph node names its ATen operator, and
  that operator left to its ATen kernel (``compile.fallback_ops``) is tried as the fix that keeps inductor.
  Where nothing that keeps the training's backend whole repairs, the smallest submodule whose running eagerly
  repairs (``compile.eager_modules``, ``torch.compiler.disable`` on its forward) is searched for: the region the
  compiler gets wrong, the rest of the model compiled as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...engine.probe import Probe
from ...errors import first_line, one_line
from ...measure.graph_nodes import GraphTrace
from ...measure.symptoms import Symptom, SymptomCode
from ...userfile.compiled import aten_operator, graph_caches_off, training_compiles
from ...userfile.spec import build_model_and_program
from ..findings import (
    BackendTrial,
    CompiledComparison,
    CompiledOutcome,
    CompilerBisection,
    GraphTraceReport,
    ProbeSummary,
    StageName,
    StageReport,
    StageStatus,
)
from ..verify import symptom_instruments
from .context import StageContext, measured_symptoms, probe_details, probe_sentence, run_mode, same_state_gap

LOCALISING_BACKENDS = ("eager", "aot_eager")
"""The backends tried first where only the compiled training fails: the least compiled first."""


def stage_compiled(ctx: StageContext) -> StageReport:
    spec, ev = ctx.bench.spec, ctx.evidence
    if not training_compiles(ctx.config.compile, spec.compiled):
        why = "compile.enabled is false: every probe runs eager" if spec.compiled else "the training is not compiled"
        return StageReport(StageName.COMPILED, StageStatus.SKIPPED, why)
    assert ev.amp is not None, "the compiled stage runs after the eager AMP probe"
    compiled, probe_seconds, compile_seconds = _timed_compiled_probe(ctx, {})
    eager_gap, compiled_gap = _same_state_gaps(ctx, compiled)
    eager_symptoms = measured_symptoms(ctx, ctx.config, ev.amp, ev.fp32, eager_gap)
    compiled_symptoms = measured_symptoms(ctx, ctx.config, compiled, ev.fp32, compiled_gap, compiled=True)
    outcome = _outcome(eager_symptoms, compiled_symptoms)
    comparison = CompiledComparison(
        compiled_with=(spec.compiled.to_json() if spec.compiled is not None else {"backend": "inductor"}),
        outcome=outcome,
        eager_symptoms=eager_symptoms,
        compiled_symptoms=compiled_symptoms,
        compiled=compiled,
        probe_seconds=probe_seconds,
        compile_seconds=compile_seconds,
    )
    if outcome == CompiledOutcome.COMPILED_ONLY:
        comparison.backends = localise_by_backend(ctx, comparison)
        if _only_inductor_fails(comparison):
            comparison.bisection = bisect_compiler(ctx, known=comparison.backends)
            comparison.backends += _fallback_trial(ctx, comparison.bisection)
        if not any(_keeps_the_compilation(b) for b in comparison.backends):
            comparison.backends += search_eager_region(ctx)
        comparison.graph_trace = trace_graph(ctx, comparison.backends, [s.code for s in compiled_symptoms])
    ev.compiled = comparison
    details = {**probe_details(compiled), **comparison.to_json()}
    return StageReport(StageName.COMPILED, StageStatus.RAN, _sentence(comparison), details=details)


def _same_state_gaps(ctx: StageContext, compiled: ProbeSummary) -> tuple[float | None, float | None]:
    """Eager's and the compiled program's AMP loss against FP32's on the same weights and batch, at the step where
    eager's deviates most (the precision-gap stage's): a gap eager has and the compiled program has not (inductor
    keeps an element-wise chain in fp32 registers) is no fault of the training as it runs. None where the
    precision-gap stage compared no state, and the compiled one where the compiled probe is not finite (a range
    problem, not a precision gap, as the precision-gap stage says of eager)."""
    gap = ctx.evidence.gap
    if gap is None:
        return None, None
    if compiled.first_nonfinite_loss is not None:
        return gap.gap, None
    return gap.gap, same_state_gap(ctx, ctx.config, gap.worst_step, compiled=True)


def _outcome(eager: list[Symptom], compiled: list[Symptom]) -> CompiledOutcome:
    if bool(eager) == bool(compiled):
        return CompiledOutcome.AGREE
    return CompiledOutcome.EAGER_ONLY if eager else CompiledOutcome.COMPILED_ONLY


def _timed_compiled_probe(ctx: StageContext, patch: dict[str, Any]) -> tuple[ProbeSummary, float, float]:
    """The compiled AMP probe (with ``patch`` on the config), its wall time and its compilation's (the first
    step's time beyond the median of the others: dynamo and the backend compile the forward and backward there)."""
    starts: list[float] = []
    began = time.perf_counter()
    config = ctx.with_config(patch) if patch else None
    summary = run_mode(  # the updates the steps make are measured (lost updates): no module hook, no graph break
        ctx,
        "amp",
        config,
        instruments=symptom_instruments(),
        compiled=True,
        before_step=lambda _: starts.append(time.perf_counter()),
    )
    ended = time.perf_counter()
    steps = [b - a for a, b in zip(starts, [*starts[1:], ended])]
    compile_seconds = max(steps[0] - statistics.median(steps[1:]), 0.0) if len(steps) > 1 else 0.0
    return summary, ended - began, compile_seconds


def localise_by_backend(ctx: StageContext, comparison: CompiledComparison) -> list[BackendTrial]:
    """The compiled probe with each less compiled backend, then inductor where the training's own backend is
    another (a custom one): the first healthy one above a failing one names where the fault is made."""
    own = str(comparison.compiled_with.get("backend", "inductor"))
    backends = [b for b in LOCALISING_BACKENDS if b != own] + (
        ["inductor"] if own not in ("inductor", "unknown") else []
    )
    patches: list[tuple[str, dict[str, Any]]] = [(b, {"compile": {"backend": b}}) for b in backends]
    if own == "inductor":  # inductor's rounding made to follow eager's: the fix that keeps inductor
        patches.append(("inductor, emulate_precision_casts", {"compile": {"emulate_precision_casts": True}}))
    return [_trial(ctx, name, patch) for name, patch in patches]


def _trial(ctx: StageContext, name: str, patch: dict[str, Any]) -> BackendTrial:
    """The compiled AMP probe with ``patch`` on the config, and the symptoms it measured against FP32."""
    summary, _, _ = _timed_compiled_probe(ctx, patch)
    config = ctx.with_config(patch)
    symptoms = [s.code for s in measured_symptoms(ctx, config, summary, ctx.evidence.fp32, None, compiled=True)]
    return BackendTrial(name, symptoms, patch)


def _only_inductor_fails(comparison: CompiledComparison) -> bool:
    """The training compiles with inductor, and AOT autograd's graph run eagerly is healthy: inside inductor."""
    if comparison.compiled_with.get("backend", "inductor") != "inductor":
        return False
    return any(b.backend == "aot_eager" and not b.symptoms for b in comparison.backends)


def bisect_compiler(ctx: StageContext, known: Sequence[BackendTrial] = ()) -> CompilerBisection:
    """PyTorch's compiler bisector over the compiled AMP probe: healthy or not, as the stage measures it. Each run
    compiles anew (dynamo reset, inductor's caches off: the bisector changes what their keys do not hold). The
    bisector first runs the whole training with each backend in turn: for those ``known`` measured already (eager,
    aot_eager) their measurement answers, without compiling again."""
    try:
        from torch._inductor.compiler_bisector import CompilerBisector
    except ImportError:
        return CompilerBisection(None, not_run="this torch has no compiler bisector")
    runs = 0
    measured = {trial.backend: not trial.symptoms for trial in known}

    def healthy() -> bool:
        nonlocal runs
        backend = CompilerBisector.get_backend()
        if CompilerBisector.get_subsystem() is None and backend in measured:
            return measured[backend]
        runs += 1
        torch._dynamo.reset()
        summary, _, _ = _timed_compiled_probe(ctx, {})
        return not measured_symptoms(ctx, ctx.config, summary, ctx.evidence.fp32, None, compiled=True)

    began = time.perf_counter()
    # the bisector says where it is on stdout, which is the diagnosis's own (its JSON)
    with graph_caches_off(), contextlib.redirect_stdout(io.StringIO()):
        try:
            result = CompilerBisector.do_bisect(healthy)
        except Exception as exc:  # noqa: BLE001 - the bisector's own failure: said, the localisation stands
            return CompilerBisection(
                None, runs=runs, not_run=f"the bisector raised {type(exc).__name__}: {first_line(exc)}"
            )
        finally:
            torch._dynamo.reset()
    seconds = time.perf_counter() - began
    if result is None:
        return CompilerBisection(None, runs=runs, seconds=seconds)
    applied_to = result.debug_info if result.subsystem == "lowerings" else None
    return CompilerBisection(
        result.backend,
        result.subsystem,
        result.bisect_number if result.subsystem != result.debug_info else None,
        applied_to,
        _operator_of(applied_to),
        runs,
        seconds,
    )


def trace_graph(
    ctx: StageContext, backends: Sequence[BackendTrial], symptoms: Sequence[str]
) -> GraphTraceReport | None:
    """The compiled AMP probe again, up to the first non-finite loss (one step where the compiled ``symptoms`` are
    drift only), with the graph the fault is made in run node by node: AOT autograd's forward graph where
    ``aot_eager`` fails and ``eager`` does not, else the training's custom backend's own graph where ``aot_eager``
    is healthy. The first node that makes an inf or NaN out of finite values is named, and, in a custom backend's
    graph, the first whose value differs from eager's. None where neither holds (inductor's program is looked into
    by the bisector)."""
    failing = {trial.backend: bool(trial.symptoms) for trial in backends}
    recorded = ctx.bench.spec.compiled
    # a drift's difference shows on each graph's first call; an inf or NaN may come steps later
    drifts_only = set(symptoms) <= DRIFT_SYMPTOMS
    trace = GraphTrace(compare_with_eager=drifts_only)
    if failing.get("eager") is False and failing.get("aot_eager"):
        backend = trace.aot_backend
    elif failing.get("aot_eager") is False and recorded is not None and recorded.compiler is not None:
        backend = trace.backend(recorded.compiler)
    else:
        return None

    def follow(probe: Probe) -> None:
        trace.step = probe.iteration

    steps = 1 if drifts_only else ctx.evidence.steps
    failed = None
    try:
        probe = ctx.bench.probe("amp", ctx.config, instruments=None, compiled=True, backend=backend)
        try:
            with ctx.progress.planned(steps):
                probe.run(steps, stop_on_nonfinite_loss=True, before_step=follow)
        finally:
            probe.close()
        if probe.failed is not None:  # raised inside a step: the trace's graph, or the training as it traces
            failed = f"{probe.failed.exception_type}: {first_line(probe.failed.exception)}"
    except Exception as exc:  # noqa: BLE001 - the trace's own failure: said, the localisation by backend stands
        failed = one_line(exc)
    return GraphTraceReport(trace.first, sorted(set(trace.opaque)), failed, trace.first_difference)


def _operator_of(node: str | None) -> str | None:
    """The ATen operator of a lowered graph node, from its name (``rsqrt_1`` is a call of ``aten.rsqrt``)."""
    if not node:
        return None
    name = "aten." + re.sub(r"_\d+$", "", node.strip())
    return name if aten_operator(name) is not None else None


def _fallback_trial(ctx: StageContext, bisection: CompilerBisection) -> list[BackendTrial]:
    """The bisected lowering's operator left to its ATen kernel, the rest of inductor as it was: measured."""
    if bisection.operator is None:
        return []
    patch = {"compile": {"fallback_ops": [bisection.operator]}}  # the probe compiles anew with it (its own reset)
    return [_trial(ctx, f"inductor, {bisection.operator} left to ATen", patch)]


DRIFT_SYMPTOMS = {SymptomCode.TRAJECTORY_DRIFT.value, SymptomCode.SAME_STATE_GAP.value}
"""The compiled probe's symptoms that need no inf or NaN: where they are all, the graph trace runs one step."""

REGION_TRIALS = 8
"""At most this many compiled probes search for the region to run eagerly: each compiles the program anew."""


def _keeps_the_compilation(trial: BackendTrial) -> bool:
    """A healthy trial that changes only a setting of the training's own backend (an operator left to ATen,
    inductor's precision emulation): a smaller change than any region run eagerly, so no region is searched."""
    settings = trial.config_patch.get("compile", {})
    return not trial.symptoms and bool(settings) and "backend" not in settings and "enabled" not in settings


def search_eager_region(ctx: StageContext) -> list[BackendTrial]:
    """The smallest submodule whose running eagerly (``compile.eager_modules``) repairs the compiled probe, the
    rest compiled as before: each child of the model tried in turn, then the children of the first that repairs,
    down to a module none of whose children repairs alone. Every trial is kept as evidence; the last healthy one
    is the region."""
    trials: list[BackendTrial] = []
    model, _ = build_model_and_program(ctx.bench.spec)  # its module tree, read at every level of the walk
    candidates = regions_under(model, "")
    while candidates and len(trials) < REGION_TRIALS:
        repaired = None
        for name, share in candidates[: REGION_TRIALS - len(trials)]:
            trial = _trial(ctx, f"{name} run eagerly", {"compile": {"eager_modules": [name]}})
            trials.append(dataclasses.replace(trial, parameter_share=share))
            if not trial.symptoms:
                repaired = name
                break
        if repaired is None:
            break
        candidates = regions_under(model, repaired)
    return trials


def regions_under(model: torch.nn.Module, name: str) -> list[tuple[str, float]]:
    """The submodules of ``model``'s ``name`` that can run eagerly, with the share of the model's parameters each
    holds: its children, a container's (``ModuleList``, ``ModuleDict``: no forward of its own to disable) replaced
    by theirs."""
    total = sum(p.numel() for p in model.parameters()) or 1
    found: list[tuple[str, float]] = []
    pending = [(f"{name}." if name else "", model.get_submodule(name))]
    while pending:
        prefix, parent = pending.pop(0)
        for child, module in parent.named_children():
            if type(module).forward is torch.nn.Module.forward:  # a container: its members are the regions
                pending.append((f"{prefix}{child}.", module))
            else:
                found.append((prefix + child, sum(p.numel() for p in module.parameters()) / total))
    return found


def _sentence(comparison: CompiledComparison) -> str:
    compiled = probe_sentence(comparison.compiled)
    timing = (
        f"compiled probe {comparison.probe_seconds:.1f} s, of which compilation ~{comparison.compile_seconds:.1f} s"
    )
    eager_codes = [s.code for s in comparison.eager_symptoms]
    compiled_codes = [s.code for s in comparison.compiled_symptoms]
    if comparison.outcome == CompiledOutcome.AGREE and compiled_codes and set(eager_codes) != set(compiled_codes):
        # both fail, but not alike: the findings are localised on eager's run, whose fault may not be compiled's
        verdict = (
            f"compiled and eager both fail, not alike (eager: {', '.join(eager_codes)}; compiled: "
            f"{', '.join(compiled_codes)}): the findings below are eager's, localised where its instruments see; "
            "the compiled training's own fault may lie elsewhere"
        )
    elif comparison.outcome == CompiledOutcome.AGREE:
        verdict = "compiled and eager agree" + (f" ({', '.join(compiled_codes)})" if compiled_codes else "")
    elif comparison.outcome == CompiledOutcome.EAGER_ONLY:
        verdict = (
            "only eager fails ("
            + ", ".join(s.code for s in comparison.eager_symptoms)
            + "): the training as it runs, compiled, is healthy"
        )
    else:
        verdict = "only the compiled training fails (" + ", ".join(s.code for s in comparison.compiled_symptoms) + ")"
    return f"{verdict}; {compiled} ({timing})"
