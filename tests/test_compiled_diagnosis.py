"""`diagnose` on compiled trainings (inductor on CPU, with the image's C compiler), in fresh CLI processes: the AMP
probe runs compiled beside the eager one, and the diagnosis is of the training as it runs. An overflow only eager
makes is no fault of the compiled training (warnings say where eager would fail); a fault only the compiled program
makes is `compiled-divergence`, localised by backend and repaired, verified, by the least change to how it compiles.
And the pieces that decide which probe compiles, in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, diagnose_ci, run_cli

from fp16doctor.config import CompileConfig, build_config
from fp16doctor.userfile.compiled import CompileOptions, compiled_program, training_compiles
from fp16doctor.userfile.spec import uncompiled

FILES = ROOT / "tests" / "training_files"


def stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def test_an_overflow_only_eager_makes_is_no_fault_of_the_compiled_training():
    """A hand-written RMSNorm squares fp16 activations past 256 into inf in eager; inductor squares and averages in
    fp32 registers. The training as it runs (compiled) is healthy; eager's fault is a warning that names it."""
    proc = diagnose_ci(FILES / "compiled_hand_rmsnorm.py")
    report = proc.report()
    assert proc.returncode == 0 and report["verdict"] == "healthy", proc.stderr[-3000:]
    compiled = stage(report, "compiled")
    assert compiled["status"] == "ran" and compiled["details"]["outcome"] == "eager-only"
    assert compiled["details"]["compiled_symptoms"] == [] and compiled["details"]["eager_symptoms"]
    warnings = [f for f in report["findings"] if f["title"].startswith("eager only: ")]
    assert warnings and all(f["severity"] == "warning" for f in warnings)
    assert any("norm" in f["title"] for f in warnings)  # where eager would fail
    assert all(s["measured"]["eager_only"] for s in report["symptoms"])


def test_a_loss_gap_only_eager_has_is_no_fault_of_the_compiled_training():
    """Eager's overflow here makes no NaN, only a loss gap on the same weights (the precision-gap stage's). The
    compiled step is compared at the same state: its gap is none, so the training is healthy as compiled, and
    every finding standing on eager's gap says "eager only" (the comparison once ran before any gap was in it:
    "compiled and eager agree", then an unexplained error)."""
    proc = diagnose_ci(FILES / "compiled_eager_only_gap.py")
    report = proc.report()
    assert proc.returncode == 0 and report["verdict"] == "healthy", proc.stderr[-3000:]
    compiled = stage(report, "compiled")["details"]
    assert compiled["outcome"] == "eager-only" and compiled["compiled_symptoms"] == []
    assert compiled["eager_symptoms"] == ["same-state-gap"]
    standing = [f for f in report["findings"] if f["cause"] in ("precision-gap", "unexplained")]
    assert standing and all(f["title"].startswith("eager only: ") for f in standing)
    text = run_cli("diagnose", FILES / "compiled_eager_only_gap.py", "--ci")
    assert "is healthy as compiled, but eager AMP fails" in " ".join(text.stdout.split())


def test_a_product_the_gpu_stores_in_fp16_overflows_the_compiled_training_too():
    """The CUDA policy's emulated product rounds its output to fp16 as a GPU's kernel stores it. Inductor keeps the
    product an external kernel but would fuse a plain rounding into the softmax after it, in fp32 registers, and
    drop it: the compiled probe would call the training healthy where the GPU's compiled run makes inf."""
    proc = diagnose_ci(FILES / "compiled_unscaled_attention.py")
    report = proc.report()
    assert proc.returncode == 1 and report["verdict"] == "unhealthy", proc.stderr[-3000:]
    compiled = stage(report, "compiled")
    assert compiled["details"]["outcome"] == "agree" and "nonfinite" in compiled["details"]["compiled_symptoms"]
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and top["severity"] == "error" and "attn" in top["title"]
    assert not top["title"].startswith("eager only")


EARLIER_DOCTOR = """
import sys
from fp16doctor.precision import autocast_policy
autocast_policy.stored_as = lambda t, dtype: t.to(dtype)  # an emulation whose casts inductor fuses away
from fp16doctor.cli import run
sys.argv = ["fp16doctor", "diagnose", sys.argv[1], "--ci", "--steps", "2"]  # enough to compile the graph
run()
"""


def test_a_graph_an_earlier_emulation_compiled_into_the_caches_is_not_taken_by_a_compiled_probe(tmp_path):
    """The compile caches' keys hold dynamo's graph and the autocast state, not the autocast kernels AOT autograd
    traces through: a graph compiled by another emulation (an earlier fp16doctor, whose product casts inductor
    fused away) would come back and call this training healthy as compiled."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    training = FILES / "compiled_unscaled_attention.py"
    earlier = subprocess.run(
        [sys.executable, "-c", EARLIER_DOCTOR, str(training)],
        capture_output=True,
        text=True,
        env={**os.environ, **caches},
        timeout=300,
    )
    assert earlier.returncode == 0 and "healthy" in earlier.stdout, earlier.stderr[-2000:]  # filled the caches
    proc = diagnose_ci(training, env=caches)
    assert proc.returncode == 1 and proc.report()["verdict"] == "unhealthy", proc.stderr[-3000:]
    assert stage(proc.report(), "compiled")["details"]["outcome"] == "agree"


def test_a_fault_only_the_compiled_program_makes_is_localised_by_backend_and_repaired():
    """A custom backend's one-pass half-precision LayerNorm (injected on purpose: the pinned torch's own lowerings
    do not misbehave here) makes NaN where eager, aot_eager and inductor are healthy."""
    proc = diagnose_ci(FILES / "compiled_custom_backend.py")
    report = proc.report()
    assert proc.returncode == 1 and report["verdict"] == "unhealthy", proc.stderr[-3000:]
    top = report["findings"][0]
    assert top["cause"] == "compiled-divergence" and top["severity"] == "error"
    evidence = top["evidence"]
    assert evidence["compiled_with"]["backend"].endswith("fusing_backend")
    assert evidence["eager_symptoms"] == [] and "nonfinite" in evidence["compiled_symptoms"]
    tried = {b["backend"]: b["symptoms"] for b in evidence["backends"]}
    assert tried == {"eager": [], "aot_eager": [], "inductor": [], "input_norm run eagerly": []}
    assert "fusing_backend backend's compilation" in evidence["made_in"] and "within input_norm" in evidence["made_in"]
    # down to the node: the backend's graph, run node by node, first makes a NaN in the layer norm it swapped in
    layer_norm = {
        "step": 0,
        "node": "layer_norm",
        "operator": "compiled_custom_backend.one_pass_layer_norm",
        "source": "compiled_custom_backend.py:55",
        "module": "input_norm",
        "graph": "the backend's graph",
        "added": False,
        "outputs_only": False,
    }
    trace = evidence["graph_trace"]
    assert trace["first_nonfinite"] == {**layer_norm, "relative_difference": None}
    assert trace["first_difference"] is None  # compared with eager only for a drift (a copy of every value)
    assert (trace["opaque"], trace["failed"]) == ([], None)
    assert (
        "made by node layer_norm of the backend's graph (compiled_custom_backend.one_pass_layer_norm in input_norm"
        in (evidence["made_in"])
    )
    # the least change: the backend kept, the one region it gets wrong run eagerly (a leaf: no smaller region)
    assert top["fix"]["config_patch"] == {"compile": {"eager_modules": ["input_norm"]}}
    assert "torch.compiler.disable(region.forward)" in top["fix"]["code"]
    assert top["verification"]["repaired"] and top["verification"]["tried"].startswith("the compiled probe")
    assert "eager_modules:\n  - input_norm" in proc.fix_config


def test_a_drift_only_the_compiled_program_makes_is_named_at_the_node_that_first_differs_from_eager():
    """The same kind of pass on pH-like inputs (~7.5): no inf, no NaN, only a variance that loses its digits. The
    compiled training trails FP32 where eager does not, and the backend's graph, compared node by node with dynamo's
    run eagerly on the same values, first differs at the layer norm it swapped in. No compiled probe recompiles
    for the doctor's own hooks (a module hook traced into the graph used to, at every call)."""
    proc = diagnose_ci(FILES / "compiled_backend_drift.py")
    report = proc.report()
    assert proc.returncode == 1 and "recompile_limit" not in proc.stderr, proc.stderr[-3000:]
    top = report["findings"][0]
    assert top["cause"] == "compiled-divergence"
    evidence = top["evidence"]
    assert evidence["eager_symptoms"] == [] and set(evidence["compiled_symptoms"]) <= {
        "trajectory-drift",
        "same-state-gap",
    }
    differs = evidence["graph_trace"]["first_difference"]
    assert evidence["graph_trace"]["first_nonfinite"] is None and differs is not None
    assert (differs["node"], differs["module"], differs["step"], differs["added"]) == (
        "layer_norm",
        "input_norm",
        0,
        False,
    )
    assert differs["operator"] == "compiled_backend_drift.one_pass_layer_norm" and differs["relative_difference"] > 0.05
    assert "the first value eager would not compute is made by node layer_norm" in evidence["made_in"]
    assert top["verification"]["repaired"]


def test_a_region_run_eagerly_keeps_the_rest_compiled_and_a_name_the_model_has_not_is_a_config_error():
    """The fix's code, as the user writes it: the custom backend's compiled program, with input_norm run eagerly,
    is finite where the whole program compiled is not."""
    from fp16doctor.errors import ConfigError
    from fp16doctor.userfile.compiled import run_eagerly
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(FILES / "compiled_custom_backend.py")
    x = next(iter(spec.data()))[0]
    finite = {}
    for names in ([], ["input_norm"]):
        torch._dynamo.reset()
        program = spec.model()
        run_eagerly(program._orig_mod, names)
        with torch.autocast("cpu", dtype=torch.float16):
            finite[tuple(names)] = bool(program(x).isfinite().all())
    torch._dynamo.reset()
    assert finite == {(): False, ("input_norm",): True}
    with pytest.raises(ConfigError, match="compile.eager_modules") as raised:
        run_eagerly(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["blocks.0"])
    assert "its children: 0" in raised.value.hint


def test_a_miscompiling_inductor_lowering_is_bisected_to_its_operator_and_left_to_aten():
    """A "fast" rsqrt lowering registered in the process (injected on purpose: the pinned torch's own lowerings do
    not misbehave here) flushes a LayerNorm's 1e-12 epsilon to 0. eager and aot_eager are healthy, inductor is not,
    and emulate_precision_casts does not help: PyTorch's compiler bisector names the lowering and its node, and
    leaving aten.rsqrt to its ATen kernel, the rest of inductor as it was, repairs it, measured."""
    proc = diagnose_ci(FILES / "compiled_inductor_lowering.py")
    assert proc.returncode == 1, proc.stderr[-3000:]
    top = proc.report()["findings"][0]
    assert top["cause"] == "compiled-divergence" and top["severity"] == "error", top
    bisection = top["evidence"]["bisection"]
    assert bisection["backend"] == "inductor" and bisection["subsystem"] == "lowerings", bisection
    assert bisection["operator"] == "aten.rsqrt" and bisection["applied_to"].startswith("rsqrt")
    assert isinstance(bisection["application"], int) and bisection["runs"] > 1
    assert "compiler bisector puts it in inductor's lowerings" in top["evidence"]["made_in"]
    tried = {b["backend"]: b["symptoms"] for b in top["evidence"]["backends"]}
    assert tried["aot_eager"] == [] and tried["inductor, emulate_precision_casts"]  # rounding is not the fault
    assert tried["inductor, aten.rsqrt left to ATen"] == []
    assert top["fix"]["config_patch"] == {"compile": {"fallback_ops": ["aten.rsqrt"]}}
    assert "make_fallback(torch.ops.aten.rsqrt)" in top["fix"]["code"]
    assert top["verification"]["repaired"] is True


def test_operators_left_to_aten_replace_inductors_lowerings_only_while_the_block_runs():
    from torch._inductor.lowering import lowerings

    from fp16doctor.userfile.compiled import inductor_fallbacks

    own = lowerings[torch.ops.aten.rsqrt.default]
    with inductor_fallbacks(["aten.rsqrt"]):
        assert lowerings[torch.ops.aten.rsqrt.default] is not own
        assert lowerings[torch.ops.aten.sqrt.default] is not None
    assert lowerings[torch.ops.aten.rsqrt.default] is own
    with pytest.raises(Exception, match="compile.fallback_ops"):
        build_config({"compile": {"fallback_ops": ["rsqrt"]}})
    with pytest.raises(Exception, match="aten.rsqrtt"), inductor_fallbacks(["aten.rsqrtt"]):  # misspelt
        pass


def test_the_corrected_config_of_a_compiled_only_fault_is_healthy_again(tmp_path):
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(diagnose_ci(FILES / "compiled_custom_backend.py").fix_config)
    again = run_cli("diagnose", FILES / "compiled_custom_backend.py", "--ci", "--json", "--config", fixed)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]


def test_a_file_compiled_with_the_eager_backend_agrees_with_eager():
    report = diagnose_ci(FILES / "compiled.py").report()
    assert stage(report, "compiled")["details"]["outcome"] == "agree"
    assert any("the AMP probe runs compiled too" in note for note in report["notes"])


def test_an_eager_training_compiles_only_where_the_config_asks():
    eager, compiled = None, CompileOptions()  # how model() compiled: not at all, or with the defaults
    assert not training_compiles(CompileConfig(), eager) and training_compiles(CompileConfig(), compiled)
    assert training_compiles(CompileConfig(enabled=True), eager)
    assert not training_compiles(CompileConfig(enabled=False), compiled)
    assert build_config({"compile": {"enabled": True, "backend": "aot_eager"}}).compile.backend == "aot_eager"
    with pytest.raises(Exception, match="compile.backend"):
        build_config({"compile": {"backend": "tvm"}})


def test_the_compiled_program_is_the_users_own_unless_the_settings_change_it():
    net = torch.nn.Linear(2, 2)
    program = torch.compile(net, backend="eager")
    inner, wrapper = uncompiled(program)
    assert inner is net and wrapper is program
    assert compiled_program(inner, wrapper, CompileConfig(), CompileOptions(backend="eager")) is program
    changed = compiled_program(inner, wrapper, CompileConfig(backend="aot_eager"), CompileOptions(backend="eager"))
    assert changed is not program and changed._orig_mod is net
    in_place = torch.nn.Linear(2, 2)
    in_place.compile(backend="eager")
    assert uncompiled(in_place) == (in_place, None) and in_place._compiled_call_impl is None  # eager again


def test_blocks_compiled_one_by_one_run_eager_in_the_instrumented_probes_and_compiled_in_the_compiled_one():
    """torchtitan's way (`block.compile()` per block) and nanoGPT-like code's (a block replaced by
    `torch.compile(block)`, its parameters renamed `_orig_mod`): both are made eager again under the names they had,
    and the options name the blocks; a compiled probe compiles the same blocks in place, the model around them eager."""
    from fp16doctor.userfile.compiled import CompileRecorder, make_eager

    recorder = CompileRecorder()
    with recorder.recording():
        net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        net[1].compile(backend="eager", dynamic=False)
        net[2] = torch.compile(net[2], backend="eager", dynamic=False)
    assert "2._orig_mod.weight" in dict(net.named_parameters())
    options = recorder.parts_of(net)  # the outermost compiled blocks, with their options
    make_eager(net)
    assert options is not None and options.modules == ("1", "2") and options.backend == "eager"
    assert list(dict(net.named_parameters())) == [f"{i}.{k}" for i in range(3) for k in ("weight", "bias")]
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in net)  # eager again
    eager = net(torch.ones(1, 2))
    program = compiled_program(net, None, CompileConfig(), options)
    assert program is net and net[1]._compiled_call_impl is not None and net[0]._compiled_call_impl is None
    assert torch.equal(program(torch.ones(1, 2)), eager)  # the eager backend computes what eager does


def test_blocks_compiled_inside_a_compiled_block_or_a_compiled_model_run_eager_in_the_instrumented_probes():
    """Only the outermost compiled blocks are the parts a compiled probe compiles again; every compiled call under
    them, and blocks compiled inside a model that is compiled too, are made eager for the instruments."""
    from fp16doctor.userfile.compiled import CompileRecorder, make_eager

    recorder = CompileRecorder()
    with recorder.recording():
        inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        inner[0].compile(backend="eager")
        outer = torch.nn.Sequential(inner, torch.nn.Linear(2, 2))
        outer[0].compile(backend="eager")
    options = recorder.parts_of(outer)
    make_eager(outer)
    assert options is not None and options.modules == ("0",)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in outer.modules())
    whole = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    whole[1].compile(backend="eager")
    whole.compile(backend="eager")
    make_eager(whole)
    assert whole[1]._compiled_call_impl is None and whole._compiled_call_impl is not None  # the root is uncompiled's


def test_a_training_that_compiles_its_blocks_one_by_one_is_diagnosed_as_it_runs_them():
    """Each block's hand-written RMSNorm overflows eager fp16 on raw readings; the compiled blocks do not. The
    training as it runs is healthy, eager's fault a warning; the instrumented probes ran the blocks eager (the
    warning's fix names a norm inside a block)."""
    proc = diagnose_ci(FILES / "compiled_blocks_rmsnorm.py")
    report = proc.report()
    assert proc.returncode == 0 and report["verdict"] == "healthy", proc.stderr[-3000:]
    compiled = stage(report, "compiled")
    assert compiled["details"]["outcome"] == "eager-only"
    assert compiled["details"]["compiled_with"]["modules"] == ["blocks.0", "blocks.1"]
    warnings = [f for f in report["findings"] if f["title"].startswith("eager only: ")]
    assert warnings and any("blocks.0.norm" in f["title"] for f in warnings)
    assert any(note.startswith("model() compiles blocks.0, blocks.1 one by one") for note in report["notes"])


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return h / 1e3 if h.abs().max().item() > 1e3 else h  # a graph break: fullgraph=True refuses it


def test_a_program_compiled_again_keeps_a_custom_backend_and_fullgraph():
    """A module compiled in place is compiled again from its recorded options: its custom backend, not inductor
    (which computed another training, and called a NaN healthy); and every variant keeps fullgraph, whose refusal
    of a graph break is the training's own error (a trial without it "repaired" it)."""
    seen = []

    def team_backend(gm, example_inputs):
        seen.append(len(gm.graph.nodes))
        return gm.forward

    recorded = CompileOptions.from_call({"backend": team_backend})
    program = compiled_program(torch.nn.Linear(2, 2), None, CompileConfig(), recorded)
    torch._dynamo.reset()
    program(torch.ones(1, 2))
    assert seen, "the recorded custom backend compiled the program"
    strict = CompileOptions.from_call({"backend": "inductor", "fullgraph": True})
    for settings in (CompileConfig(), CompileConfig(backend="eager")):
        torch._dynamo.reset()
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
            compiled_program(DataDependent(), None, settings, strict)(torch.ones(2, 4))


def test_the_region_search_descends_into_the_first_child_that_repairs_within_its_budget(monkeypatch):
    """The search's walk, its compiled probes stood in for by a tree where only regions holding blocks.1.norm
    repair: each level tried in order, the first repairing child entered, the last healthy trial the smallest."""
    from types import SimpleNamespace

    from fp16doctor.diagnosis.findings import BackendTrial
    from fp16doctor.diagnosis.stages import compiled as stage_module

    tree = {"": ["embed", "blocks", "head"], "blocks": ["blocks.0", "blocks.1"], "blocks.1": ["blocks.1.norm"]}
    tree = {name: [(child, 0.1) for child in children] for name, children in tree.items()} | {"blocks.1.norm": []}

    def trial(ctx, name, patch):
        region = patch["compile"]["eager_modules"][0]
        return BackendTrial(name, [] if "blocks.1.norm".startswith(region) else ["nonfinite"], patch)

    monkeypatch.setattr(stage_module, "_trial", trial)
    monkeypatch.setattr(stage_module, "build_model_and_program", lambda spec: (None, None))
    monkeypatch.setattr(stage_module, "regions_under", lambda model, name: tree[name])
    ctx = SimpleNamespace(bench=SimpleNamespace(spec=None))
    found = stage_module.search_eager_region(ctx)
    assert [t.backend for t in found] == [
        "embed run eagerly", "blocks run eagerly", "blocks.0 run eagerly", "blocks.1 run eagerly",
        "blocks.1.norm run eagerly",
    ]  # fmt: skip
    assert [t.backend for t in found if not t.symptoms][-1] == "blocks.1.norm run eagerly"
    monkeypatch.setattr(stage_module, "REGION_TRIALS", 3)
    assert len(stage_module.search_eager_region(ctx)) == 3  # the budget ends it: blocks is the region found


def test_train_trains_the_compiled_program_and_the_corrected_config_trains_it_finite(tmp_path):
    """`train` runs the training as it runs, compiled: the custom backend's NaN at every step, the eager replay of
    the first finite (the compiled program makes it), and the diagnosis's corrected config (input_norm run eagerly)
    trains finite. The replay runs eager without leaving the compiled program eager for the steps after it."""
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(diagnose_ci(FILES / "compiled_custom_backend.py").fix_config)
    runs = {}
    for name, extra in (("as-is", []), ("corrected", ["--config", fixed])):
        proc = run_cli("train", FILES / "compiled_custom_backend.py", *extra, "--run-dir", tmp_path / name)
        assert proc.returncode in (0, 1), proc.stderr[-3000:]
        assert "train runs the model compiled" in " ".join(proc.stderr.split())
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert runs["as-is"]["nonfinite"] == runs["as-is"]["steps"] > 1  # every step, not only the one replayed
    assert "the compiled program makes the fault" in runs["as-is"]["first_nonfinite"]["explanation"]
    assert runs["corrected"]["nonfinite"] == 0 and runs["corrected"]["status"] == "completed"


def test_the_region_candidates_are_a_containers_members_and_a_large_region_comes_after_the_backends():
    """A ModuleList has no forward to disable: its members are the candidates. A region holding most of the model
    (a transformer's trunk) is no smaller a change than another backend: the backend comes first."""
    from fp16doctor.diagnosis.findings import BackendTrial
    from fp16doctor.diagnosis.rules.compiled_divergence import CompiledDivergence, comparison_case
    from fp16doctor.diagnosis.stages import compiled as stage_module

    net = torch.nn.Sequential()
    net.add_module("embed", torch.nn.Linear(4, 4))
    net.add_module("layers", torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]))
    regions = stage_module.regions_under(net, "")
    assert [name for name, _ in regions] == ["embed", "layers.0", "layers.1"]
    assert [round(share, 3) for _, share in regions] == [0.333, 0.333, 0.333]

    def fix(share):
        trials = [
            BackendTrial("eager", []),
            BackendTrial("aot_eager", []),
            BackendTrial("inductor", [], {"compile": {"backend": "inductor"}}),
            BackendTrial("trunk run eagerly", [], {"compile": {"eager_modules": ["trunk"]}}, share),
        ]
        (finding,) = CompiledDivergence().check(comparison_case(trials, compiled_with="team.backend"))
        return finding.fix.config_patch

    assert fix(0.2) == {"compile": {"eager_modules": ["trunk"]}}
    assert fix(0.95) == {"compile": {"backend": "inductor"}}


def test_train_nproc_compiles_the_ranks_wrapped_model_and_the_corrected_config_trains_it_finite(tmp_path):
    """Under torchrun each rank compiles its DDP module with inductor, as a training compiles its wrapped model: the
    miscompiling lowering the file registers makes every step non-finite on the ranks, and the diagnosis's corrected
    config (rsqrt left to ATen) trains them finite. An unhealthy run that completed is no crashed child for torchrun."""
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(diagnose_ci(FILES / "compiled_inductor_lowering.py").fix_config)
    runs = {}
    for name, extra in (("as-is", []), ("corrected", ["--config", fixed])):
        run_dir = tmp_path / name
        proc = run_cli("train", FILES / "compiled_inductor_lowering.py", *extra, "--nproc", "2", "--steps", "3",
                       "--run-dir", run_dir)  # fmt: skip
        assert proc.returncode in (0, 1), proc.stderr[-3000:]
        assert "train runs the model compiled" in " ".join(proc.stderr.split())
        assert "ChildFailedError" not in proc.stderr
        runs[name] = (proc.returncode, json.loads((run_dir / "summary.json").read_text()))
    assert runs["as-is"][0] == 1 and runs["as-is"][1]["nonfinite"] == 3
    assert "the compiled program makes the fault" in runs["as-is"][1]["first_nonfinite"]["explanation"]
    assert runs["corrected"][0] == 0 and runs["corrected"][1]["nonfinite"] == 0


def test_a_compiled_probe_with_instruments_compiles_its_graph_once():
    """The compiled probe measures lost updates (optimizer hooks); module hooks would be traced into the graph and
    guard on the dict they fill, so the graph was compiled anew at each call, up to dynamo's recompile limit."""
    from torch._dynamo.utils import counters

    from fp16doctor.diagnosis.verify import symptom_instruments
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(FILES / "compiled_backend_drift.py")
    bench = Workbench(spec, build_config({**spec.config, "steps": 4}, {"device": "cpu"}))
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    probe = bench.probe("amp", instruments=symptom_instruments(), compiled=True)
    try:
        probe.run(4)
    finally:
        probe.close()
    assert probe.runs_compiled and len(probe.records) == 4
    assert counters["stats"]["unique_graphs"] - before == 1


def test_the_compiled_note_says_every_probe_runs_eager_where_the_config_turns_compiling_off():
    from fp16doctor.userfile.spec import COMPILE_OFF_NOTE, COMPILED_NOTE, notes_under

    other = "a note of another kind"
    assert notes_under([COMPILED_NOTE, other], None) == [COMPILED_NOTE, other]
    assert notes_under([COMPILED_NOTE, other], True) == [COMPILED_NOTE, other]
    assert notes_under([COMPILED_NOTE, other], False) == [COMPILE_OFF_NOTE, other]
    assert "compiled too" not in COMPILE_OFF_NOTE and "eager" in COMPILE_OFF_NOTE


OVERFLOWING_AT_STEP_3 = """
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.lin(x)).squeeze(-1)


def model():
    torch.manual_seed(0)
    return torch.compile(Net(), backend="eager")


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def data():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(16, 8, generator=g) * (3e5 if i == 3 else 1) for i in range(8)]
    return [(x, x.sum(1)) for x in batches]
"""


def test_trains_report_of_a_compiled_steps_inf_names_the_module_the_eager_replay_saw_make_it(tmp_path):
    """The replay of the bad step runs forced eager: its module hooks see every module (compiled probes hook none)."""
    from fp16doctor.run.train import Trainer, TrainOptions
    from fp16doctor.userfile.spec import load_training_file

    path = tmp_path / "overflow.py"
    path.write_text(OVERFLOWING_AT_STEP_3)
    spec = load_training_file(path)
    config = build_config(spec.config, {"device": "cpu", "steps": 5, "scaler": {"init_scale": 1024.0}})
    Trainer(spec, config, TrainOptions(run_dir=tmp_path / "run", checkpoint_every=5)).run()
    report = json.loads((tmp_path / "run" / "nonfinite_step_3.json").read_text())
    assert report["first_nonfinite_module"]["module"] == "lin"


def test_a_comparison_where_both_fail_differently_does_not_say_they_agree():
    """Eager's loss turns NaN in the forward, the compiled training only skips (its weight gradients overflow): both
    fail, but the findings localised on eager's run may not be the compiled training's fault, and the stage says so
    (it said "compiled and eager agree")."""
    import dataclasses

    from fp16doctor.diagnosis import rule_cases as fx
    from fp16doctor.diagnosis.findings import CompiledOutcome
    from fp16doctor.diagnosis.stages.compiled import _sentence
    from fp16doctor.measure.symptoms import Symptom

    skips, nonfinite = Symptom("skips", "every step skipped"), Symptom("nonfinite", "NaN loss")
    differ = dataclasses.replace(
        fx.compiled_comparison(CompiledOutcome.AGREE), eager_symptoms=[nonfinite, skips], compiled_symptoms=[skips]
    )
    assert "both fail, not alike (eager: nonfinite, skips; compiled: skips)" in _sentence(differ)
    alike = dataclasses.replace(differ, eager_symptoms=[skips])
    assert _sentence(alike).startswith("compiled and eager agree (skips)")
