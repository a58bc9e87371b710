"""`fp16doctor watch` on compiled scripts (inductor on CPU, with the image's C compiler), in fresh processes: the run
is the script's own, bit for bit, with the graphs and graph breaks dynamo counts unchanged; a capsule records how the
model was compiled; a step compiled as one function, whose model calls the watch cannot see, says why it has no
capsule. And the pieces that see `torch.compile`, in this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli

from fp16doctor.live.capsule import replay_backend, replay_note
from fp16doctor.live.observe import COMPILED_STEP
from fp16doctor.userfile.compiled import CompileOptions, CompileRecorder, EagerAround, compiled_in_place
from fp16doctor.userfile.modules import compiled_call

SCRIPT = ROOT / "tests" / "scripts" / "compiled_loop.py"


def run_python(*args, cwd):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [[], ["--in-place"], ["--compile-blocks"], ["--compile-blocks-in-place"]],
    ids=["torch.compile(model)", "model.compile()", "each block", "block.compile()"],
)
def test_a_compiled_script_runs_as_without_the_watch_with_no_extra_graph_or_graph_break(tmp_path, how):
    plain = run_python(SCRIPT, *how, cwd=tmp_path)
    watched = run_cli("watch", SCRIPT, *how, cwd=tmp_path)
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr[-3000:]
    assert plain.stdout.splitlines()[-1] == "graphs 1 breaks 0"  # what dynamo counted, without the watch
    assert watched.stdout == plain.stdout  # the same losses bit for bit, and the same counts
    assert "fp16doctor" not in watched.stderr and "global hooks" not in watched.stderr, watched.stderr[-3000:]


@pytest.mark.slow
def test_a_compiled_models_capsule_records_how_it_was_compiled_and_is_replayed_both_ways(tmp_path):
    args = ("--in-place", "--mode", "default", "--poison-step", "2")
    watched = run_cli("watch", "--capsule-dir", "caps", SCRIPT, *args, cwd=tmp_path)
    assert watched.returncode == 1 and "nonfinite at optimizer step 2" in watched.stderr, watched.stderr[-3000:]
    capsule = tmp_path / "caps" / "step_00000002"
    manifest = json.loads((capsule / "manifest.json").read_text())
    assert manifest["compiled"] == {
        "backend": "inductor",
        "mode": "default",
        "dynamic": False,
        "fullgraph": False,
        "options": {},
        "modules": [],
    }
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", capsule)
    report = json.loads(diagnosis.stdout)
    assert report["findings"][0]["cause"] == "nonfinite-data", diagnosis.stderr[-3000:]
    assert any("ran compiled (torch.compile: backend inductor, mode default" in n for n in report["notes"])
    compiled = next(s for s in report["stages"] if s["name"] == "compiled")
    assert compiled["status"] == "ran" and compiled["details"]["outcome"] == "agree"  # the replay, compiled and eager


@pytest.mark.slow
def test_a_step_compiled_as_one_function_says_why_it_has_no_capsule(tmp_path):
    watched = run_cli("watch", "--capsule-dir", "caps", SCRIPT, "--compile-step", "--poison-step", "2", cwd=tmp_path)
    assert watched.returncode == 1 and "step 2" not in watched.stdout, watched.stderr[-3000:]
    assert f"No capsule: {COMPILED_STEP}." in watched.stderr and not (tmp_path / "caps").exists()


def test_compile_options_are_recorded_as_given_and_a_custom_backend_by_its_name():
    def my_backend(gm, example_inputs):
        return gm.forward

    options = CompileOptions.from_call({"backend": my_backend, "dynamic": True, "options": {"trace.enabled": object}})
    assert options.backend.endswith("my_backend") and options.dynamic is True and options.mode is None
    assert options.options == {"trace.enabled": repr(object)}  # JSON-able: what is not a plain value, as text
    assert CompileOptions.from_call({}).to_json()["backend"] == "inductor"


class Calls:
    def __init__(self):
        self.seen = []

    def call_starts(self, module, args):
        self.seen.append(("starts", module))

    def call_ends(self, module, args, kwargs, output):
        self.seen.append(("ends", output.shape))

    def call_raised(self, module):
        self.seen.append(("raised", module))


def test_each_form_of_torch_compile_is_recorded_by_what_the_model_call_runs(monkeypatch):
    calls = Calls()
    recorder = CompileRecorder(calls)
    observed = recorder.observed(torch.compile)
    monkeypatch.setattr(torch, "compile", observed)  # as the watch does: the decorator form calls it again
    wrapped = observed(torch.nn.Linear(2, 2), mode="reduce-overhead")
    assert recorder.options_of(wrapped).mode == "reduce-overhead" and compiled_call(wrapped) is wrapped
    assert recorder.options_of(torch.nn.Linear(2, 2)) is None  # eager
    in_place = torch.nn.Linear(2, 3)
    in_place._compiled_call_impl = observed(in_place._call_impl, backend="eager")  # what Module.compile() does
    assert isinstance(in_place._compiled_call_impl, EagerAround) and compiled_in_place(in_place)
    assert recorder.options_of(in_place).backend == "eager" and not recorder.functions_compiled
    in_place(torch.ones(1, 2))  # compiled with the eager backend: runs at once, observed around the program
    assert calls.seen == [("starts", in_place), ("ends", torch.Size([1, 3]))]
    with pytest.raises(RuntimeError):
        in_place(torch.ones(1, 5))  # a wrong shape: the call raises inside the program, and is told so
    assert calls.seen[-2:] == [("starts", in_place), ("raised", in_place)]
    torch.compile(mode="default")(lambda x: x + 1)  # the decorator form, applied to a step function
    assert recorder.functions_compiled


def test_a_capsule_replays_a_custom_backend_it_could_not_store_with_inductor_and_says_so():
    assert replay_backend("aot_eager") == "aot_eager" and replay_backend("train.fusing_backend") == "inductor"
    note = replay_note({"step": 3, "replay": "output-grads", "compiled": {"backend": "train.fusing_backend"}})
    assert "replayed both ways" in note and "it is not stored: replayed with inductor" in note
    assert "a fault only that backend makes is not reproduced" in note
    stored = {"step": 3, "replay": "output-grads", "compiled": {"backend": "train.fusing_backend"}}
    assert "inductor" not in replay_note({**stored, "files": ["model.pt", "backend.pt"]})
    assert "compiled" not in replay_note({"step": 3, "replay": "output-grads", "compiled": None})


@pytest.mark.slow
def test_a_capsule_of_a_custom_backend_replays_with_that_backend_and_blames_it_not_the_loss(tmp_path):
    """The script's own backend (defined in it) makes the step NaN; its cross-entropy is sound. The capsule pickles
    the backend, the replay compiles with it: compiled-divergence, down to the node, and no loss finding (inductor
    in its place replayed finite, and the recorded NaN was put on the loss)."""
    script = ROOT / "tests" / "scripts" / "custom_backend_loop.py"
    watched = run_cli("watch", "--capsule-dir", "caps", script, cwd=tmp_path)
    assert watched.returncode == 1 and "nonfinite at optimizer step 0" in watched.stderr, watched.stderr[-3000:]
    capsule = tmp_path / "caps" / "step_00000000"
    assert "backend.pt" in json.loads((capsule / "manifest.json").read_text())["files"]
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", capsule)
    report = json.loads(diagnosis.stdout)
    causes = [f["cause"] for f in report["findings"] if f["severity"] == "error"]
    assert causes == ["compiled-divergence"], diagnosis.stderr[-3000:]
    first = report["findings"][0]["evidence"]["graph_trace"]["first_nonfinite"]
    assert (first["node"], first["module"], first["operator"]) == ("layer_norm", "input_norm", "one_pass_layer_norm")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--compile-blocks", "--compile-blocks-in-place"])
def test_a_capsule_of_a_model_compiled_per_block_is_replayed_with_its_blocks_compiled(tmp_path, how):
    """Blocks replaced by their torch.compile wrappers (nanoGPT-like code) or compiled in place (torchtitan's
    `block.compile()`), the model around them eager: the capsule records the blocks and their options, and its replay
    compiles the same blocks (the compiled stage ran)."""
    watched = run_cli("watch", "--capsule-dir", "caps", SCRIPT, how, "--poison-step", "2", cwd=tmp_path)
    assert watched.returncode == 1, watched.stderr[-3000:]
    capsule = tmp_path / "caps" / "step_00000002"
    manifest = json.loads((capsule / "manifest.json").read_text())
    assert manifest["compiled"]["modules"] == ["blocks.0", "blocks.1"] and manifest["compiled"]["dynamic"] is False
    assert "its blocks blocks.0, blocks.1 ran compiled one by one" in replay_note(manifest)
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", capsule)
    report = json.loads(diagnosis.stdout)
    assert report["findings"][0]["cause"] == "nonfinite-data", diagnosis.stderr[-3000:]
    compiled = next(s for s in report["stages"] if s["name"] == "compiled")
    assert compiled["status"] == "ran" and compiled["details"]["compiled_with"]["modules"] == ["blocks.0", "blocks.1"]
