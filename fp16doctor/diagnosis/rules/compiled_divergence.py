"""Only the compiled training fails or drifts: the compiler computes something eager does not.

The compiled AMP probe (the model as ``model()`` compiles it) fails or drifts from FP32 where the eager AMP probe,
from the same weights and batches, is healthy. The fault is made by the compilation: a backend's lowering or
pass, a fusion that computes in another precision, or dynamo's capture. It is localised by backend, from the
least compiled up: ``eager`` (dynamo's graph, run eagerly), ``aot_eager`` (and AOT autograd's decompositions),
then the training's own backend (and inductor, where the training's is a custom one). Where only inductor fails,
PyTorch's compiler bisector names the subsystem and the application in it (a lowering's graph node, so its ATen
operator). Where the training's custom backend returns an FX graph, that graph is run node by node: the first node
that makes an inf or NaN out of finite values is named, and, for a drift, the first node whose value differs from
dynamo's graph run eagerly on the same values. Inductor's program is not compared operator by operator.

Evidence: how the model is compiled, the compiled and eager symptoms, each backend tried and what it measured,
and the layer the fault is made in. The fix is the least change that repaired the compiled probe, measured:
the bisected lowering's operator left to its ATen kernel (``compile.fallback_ops``), inductor with
``emulate_precision_casts`` (its rounding made to follow eager's), the smallest submodule run eagerly inside the
compiled program (``compile.eager_modules``: ``torch.compiler.disable`` on its forward), inductor in place of a
custom backend, ``aot_eager``, or the model kept eager; the verification runs the compiled probe with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ...measure.graph_nodes import TracedNode
from .. import rule_cases as fx
from ..findings import (
    BackendTrial,
    CompiledOutcome,
    CompilerBisection,
    Evidence,
    EvidenceRecord,
    Finding,
    Fix,
    GraphTraceReport,
)
from . import Rule

EAGER_PATCH: dict[str, Any] = {"compile": {"enabled": False}}
"""Keep the model eager: what repairs where every compiled variant fails (eager is healthy, measured)."""


@dataclass(frozen=True)
class CompiledDivergenceEvidence(EvidenceRecord):
    """The compiled training's failure beside the healthy eager one, and where the compilation makes it."""

    compiled_with: dict[str, Any]
    """How model() compiles the model (torch.compile's backend, mode, dynamic, fullgraph, options)."""
    compiled_symptoms: list[str]
    """What the compiled AMP probe measured against FP32."""
    eager_symptoms: list[str]
    """What the eager AMP probe measured (empty: healthy)."""
    backends: list[BackendTrial]
    """The compiled probe with each backend or setting tried instead of the training's, and its symptoms."""
    made_in: str
    """Where the fault is made: dynamo's graph capture, AOT autograd, or the training's backend."""
    bisection: CompilerBisection | None = None
    """Only inductor fails: the subsystem and application PyTorch's compiler bisector found."""
    graph_trace: GraphTraceReport | None = None
    """A custom backend fails: the first node of its graph that made an inf or NaN out of finite values, or that
    computes something eager does not."""


def comparison_case(
    backends: list[BackendTrial],
    outcome: CompiledOutcome = CompiledOutcome.COMPILED_ONLY,
    bisection: CompilerBisection | None = None,
    compiled_with: str = "inductor",
    graph_trace: GraphTraceReport | None = None,
) -> Evidence:
    """Evidence with :func:`~fp16doctor.diagnosis.rule_cases.compiled_comparison`'s comparison."""
    return fx.evidence(compiled=fx.compiled_comparison(outcome, backends, bisection, compiled_with, graph_trace))


HEALTHY_LOWER = [BackendTrial("eager", []), BackendTrial("aot_eager", [])]


class CompiledDivergence(Rule):
    code = "compiled-divergence"
    order = 88
    evidence_type: ClassVar[type[EvidenceRecord]] = CompiledDivergenceEvidence
    explains = ("nonfinite", "skips", "trajectory-drift", "same-state-gap", "amp-exception", "lost-updates")
    training_files = ("compiled_custom_backend.py", "compiled_backend_drift.py", "compiled_inductor_lowering.py")
    fires_on = (
        lambda: comparison_case(
            [
                *HEALTHY_LOWER,
                BackendTrial("inductor, emulate_precision_casts", [], {"compile": {"emulate_precision_casts": True}}),
            ]
        ),
        lambda: comparison_case([BackendTrial("eager", ["nonfinite"]), BackendTrial("aot_eager", ["nonfinite"])]),
        lambda: comparison_case(  # a custom backend: the region run eagerly keeps it, preferred to a backend swap
            [
                *HEALTHY_LOWER,
                BackendTrial("inductor", [], {"compile": {"backend": "inductor"}}),
                BackendTrial("embed run eagerly", ["nonfinite"], {"compile": {"eager_modules": ["embed"]}}, 0.1),
                BackendTrial("blocks.0 run eagerly", ["nonfinite"], {"compile": {"eager_modules": ["blocks.0"]}}, 0.4),
                BackendTrial("blocks.1 run eagerly", [], {"compile": {"eager_modules": ["blocks.1"]}}, 0.4),
                BackendTrial("blocks.1.norm run eagerly", [], {"compile": {"eager_modules": ["blocks.1.norm"]}}, 0.01),
            ],
            compiled_with="team.fusing_backend",
            graph_trace=GraphTraceReport(
                TracedNode(0, "layer_norm", "team.one_pass_layer_norm", "model.py:42", "blocks.1.norm")
            ),
        ),
        lambda: comparison_case(  # a lowering the bisector found, its operator left to ATen: healthy
            [
                *HEALTHY_LOWER,
                BackendTrial(
                    "inductor, emulate_precision_casts", ["nonfinite"], {"compile": {"emulate_precision_casts": True}}
                ),
                BackendTrial("inductor, aten.rsqrt left to ATen", [], {"compile": {"fallback_ops": ["aten.rsqrt"]}}),
            ],
            bisection=CompilerBisection("inductor", "lowerings", 3, "rsqrt", "aten.rsqrt", runs=22),
        ),
    )
    quiet_on = (
        lambda: comparison_case([], CompiledOutcome.EAGER_ONLY),
        lambda: comparison_case([], CompiledOutcome.AGREE),
    )

    def check(self, ev: Evidence) -> list[Finding]:
        comparison = ev.compiled
        if comparison is None or comparison.outcome != CompiledOutcome.COMPILED_ONLY:
            return []
        own = str(comparison.compiled_with.get("backend", "inductor"))
        made_in = (
            _made_in(comparison.backends, own)
            + _bisected(comparison.bisection)
            + _region(comparison.backends)
            + _traced(comparison.graph_trace)
        )
        fix = _least_repairing(comparison.backends, own)
        symptoms = ", ".join(s.code for s in comparison.compiled_symptoms)
        return [
            self.finding(
                f"Only the compiled training fails ({symptoms}); eager AMP on the same weights and batches is "
                f"healthy: the fault is made in {made_in}",
                CompiledDivergenceEvidence(
                    compiled_with=comparison.compiled_with,
                    compiled_symptoms=[s.code for s in comparison.compiled_symptoms],
                    eager_symptoms=[s.code for s in comparison.eager_symptoms],
                    backends=list(comparison.backends),
                    made_in=made_in,
                    bisection=comparison.bisection,
                    graph_trace=comparison.graph_trace,
                ),
                fix,
            )
        ]

    def intervention(self, finding: Finding, ev: Evidence) -> Any:
        """The fix tried on the compiled probe (the eager one is healthy already)."""
        from ..verify import Intervention

        patch = finding.fix.config_patch
        return Intervention("the compiled probe with " + _patch_words(patch), config_patch=patch, compiled=True)


def _made_in(backends: list[BackendTrial], own: str) -> str:
    failing = {b.backend: bool(b.symptoms) for b in backends}
    if failing.get("eager"):
        return "dynamo's graph capture (backend eager, dynamo's graph run eagerly, fails too)"
    if failing.get("aot_eager"):
        return "AOT autograd's graph (backend aot_eager fails; eager does not)"
    return f"the {own} backend's compilation (backends eager and aot_eager are healthy)"


EMULATION = "inductor, emulate_precision_casts"
FIXES = {
    EMULATION: (
        "Keep inductor with emulate_precision_casts: its fused kernels then round "
        "every intermediate to the dtype eager stores it in.",
        "torch.compile(model, options={'emulate_precision_casts': True})",
    ),
    "inductor": (
        "Compile with inductor instead of the custom backend: inductor computes this training as eager "
        "does, within rounding (measured).",
        "torch.compile(model)  # backend='inductor', the default",
    ),
    "aot_eager": (
        "Compile with backend='aot_eager' (dynamo's and AOT autograd's graphs, run eagerly) until the "
        "backend's fault is fixed.",
        "torch.compile(model, backend='aot_eager')",
    ),
    "eager": (
        "Compile with backend='eager' (dynamo's graph only, run eagerly) until the backend's fault is fixed.",
        "torch.compile(model, backend='eager')",
    ),
}
"""Per trial: (fix, code). The backend swaps are preferred in this order: the least change from the training's
own compilation first."""


def _bisected(bisection: CompilerBisection | None) -> str:
    """``: its lowerings, the 5th (graph node rsqrt_1, aten.rsqrt), by PyTorch's compiler bisector``."""
    if bisection is None or bisection.backend is None or bisection.subsystem is None:
        return ""
    where = f"; PyTorch's compiler bisector puts it in {bisection.backend}'s {bisection.subsystem}"
    if bisection.application is not None:
        where += f", application {bisection.application}"
    if bisection.applied_to:
        where += f" (graph node {bisection.applied_to}" + (f", {bisection.operator})" if bisection.operator else ")")
    return where


def _region(backends: list[BackendTrial]) -> str:
    """``; within input_norm (run eagerly, the rest compiled, the training is healthy)``: the smallest region found."""
    regions = [b for b in backends if not b.symptoms and _setting(b, "eager_modules")]
    if not regions:
        return ""
    return f"; within {_setting(regions[-1], 'eager_modules')[0]} (run eagerly, the rest compiled, it is healthy)"


def _traced(trace: GraphTraceReport | None) -> str:
    """``; the first inf or NaN is made by its graph's node layer_norm (...)``, or why no node is named."""
    if trace is None:
        return ""
    if trace.first_nonfinite is not None:
        return f"; the first inf or NaN is made by {trace.first_nonfinite.sentence()}"
    if trace.first_difference is not None:
        return f"; the first value eager would not compute is made by {trace.first_difference.sentence()}"
    if trace.opaque:
        return f"; its program ({', '.join(trace.opaque)}) is not an FX graph, so no node of it is named"
    if trace.failed:
        return f"; its graph could not be run node by node ({trace.failed})"
    return ""


def _fallback_fix(trial: BackendTrial) -> Fix:
    operator = _setting(trial, "fallback_ops")[0]
    return Fix(
        f"Keep {operator} out of inductor's lowerings: inductor then runs it as its ATen kernel, and compiles the "
        "rest as before (measured healthy).",
        code=f"from torch._inductor.lowering import make_fallback\nmake_fallback(torch.ops.{operator})  # before "
        "the first compiled call",
        config_patch=dict(trial.config_patch),
    )


def _region_fix(trial: BackendTrial, own: str) -> Fix:
    region = _setting(trial, "eager_modules")[0]
    return Fix(
        f"Run {region} eagerly inside the compiled program (torch.compiler.disable on its forward): the compiler "
        f"gets that region wrong, and the rest of the model stays compiled with {own} (measured healthy).",
        code=f"region = model.get_submodule({region!r})  # model: the module you torch.compile\n"
        "region.forward = torch.compiler.disable(region.forward)  # before the first compiled call",
        config_patch=dict(trial.config_patch),
    )


def _named_fix(trial: BackendTrial) -> Fix:
    summary, code = FIXES[trial.backend]
    return Fix(summary, code=code, config_patch=dict(trial.config_patch))


def _setting(trial: BackendTrial, key: str) -> Any:
    return trial.config_patch.get("compile", {}).get(key)


SMALL_REGION = 0.5
"""A region run eagerly that holds at most this share of the model's parameters is a smaller change than another
backend for the whole model; a larger one (a transformer's trunk) is not, and comes after the backends."""


def _least_repairing(backends: list[BackendTrial], own: str) -> Fix:
    """The healthy trial that changes the training's compilation least: an operator left to ATen, inductor's
    precision emulation, the smallest region run eagerly (the last one the search found) where it is small, another
    backend, a large region, and last no compilation at all."""
    healthy = [b for b in backends if not b.symptoms]
    by_name = {b.backend: b for b in healthy}
    fallbacks = [b for b in healthy if _setting(b, "fallback_ops")]
    if fallbacks:
        return _fallback_fix(fallbacks[0])
    if EMULATION in by_name:
        return _named_fix(by_name[EMULATION])
    regions = [b for b in healthy if _setting(b, "eager_modules")]
    small = regions[-1] if regions and (regions[-1].parameter_share or 0.0) <= SMALL_REGION else None
    if small is not None:
        return _region_fix(small, own)
    for name in FIXES:
        if name in by_name and name != own:
            return _named_fix(by_name[name])
    if regions:  # most of the model run eagerly: still less than all of it
        return _region_fix(regions[-1], own)
    return Fix(
        "Keep the model eager (no torch.compile, or torch.compiler.disable on it): every compiled variant tried "
        "fails, and eager AMP is healthy.",
        code="model = build_model()  # not torch.compile(build_model())",
        config_patch=EAGER_PATCH,
    )


def _patch_words(patch: dict[str, Any]) -> str:
    settings = patch.get("compile", {})
    return ", ".join(f"compile.{k}={v}" for k, v in settings.items()) or "no change"
