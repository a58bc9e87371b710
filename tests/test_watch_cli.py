"""`fp16doctor watch SCRIPT ARGS` on unmodified training scripts, in fresh processes: a healthy run is the script's
own run (same losses bit for bit, no file, its exit code); a NaN batch stops the run with a capsule that a second
process diagnoses; a script's own errors and exit codes come through unchanged; broken capsules are bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch
from conftest import ROOT, run_cli
from rank_launches import launch_ranks

SCRIPTS = ROOT / "tests" / "scripts"
HAND_LOOP = SCRIPTS / "hand_loop.py"


def run_python(*args, cwd):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_a_healthy_script_runs_exactly_as_without_the_watch(tmp_path):
    plain = run_python(HAND_LOOP, "--steps", "10", cwd=tmp_path)
    watched = run_cli("watch", HAND_LOOP, "--steps", "10", cwd=tmp_path)
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr[-2000:]
    assert watched.stdout == plain.stdout and watched.stdout.count("loss") == 10  # the same losses, bit for bit
    assert "fp16doctor" not in watched.stderr and not any(tmp_path.iterdir())  # nothing said, nothing written


def test_a_loop_without_a_scaler_is_watched_through_the_optimizer_hooks(tmp_path):
    script = SCRIPTS / "plain_loop.py"
    assert run_cli("watch", script, cwd=tmp_path).stdout == run_python(script, cwd=tmp_path).stdout
    poisoned = run_cli("watch", "--capsule-dir", "caps", script, "8", "--poison", cwd=tmp_path)
    assert poisoned.returncode == 1 and "step 5" not in poisoned.stdout, poisoned.stderr[-2000:]
    assert "nonfinite at optimizer step 5" in poisoned.stderr and (tmp_path / "caps" / "step_00000005").is_dir()


def test_a_loss_that_blows_up_in_the_first_steps_is_a_spike(tmp_path):
    """Step 5's batch is 10,000 times too large: its loss, finite, is far above the first five steps' median. The
    running median needs 10 steps of history; before them, the spike is measured against the steps so far."""
    proc = run_cli("watch", "--capsule-dir", "caps", HAND_LOOP, "--raw-at", "5", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "step 4 loss" in proc.stdout and "step 5" not in proc.stdout
    pointer = next(line for line in proc.stderr.splitlines() if line.startswith("fp16doctor:"))
    assert pointer.startswith("fp16doctor: loss-spike at optimizer step 5: the loss ")
    assert "x the median of the first 5 steps" in pointer and (tmp_path / "caps" / "step_00000005").is_dir()


def test_a_capsule_of_a_run_its_first_update_broke_names_the_jump_not_the_overflows_that_followed(tmp_path):
    """An argparse LM at lr 0.3 without warm-up: its first update sends the loss from ~5 to the hundreds, in FP32
    too; the scaler then skips five steps on the broken model's gradients, and the capsule holds step 5's state.
    Its replay from there measures an fp16 gap in the head that keeping it in fp32 'repairs' on that state; the
    diagnosis names the jump its history shows, and no precision fix."""
    script = SCRIPTS / "lm_high_lr.py"
    fp32 = run_python(script, "--lr", "0.3", "--steps", "3", "--no-amp", cwd=tmp_path)
    losses = [float(line.split()[-1]) for line in fp32.stdout.splitlines()]
    assert losses[1] > 10 * losses[0], fp32.stdout  # the shape: FP32 jumps too
    watched = run_cli("watch", "--capsule-dir", "caps", script, "--lr", "0.3", cwd=tmp_path)
    assert watched.returncode == 1 and "skip-streak at optimizer step 5" in watched.stderr, watched.stderr[-2000:]
    proc = run_cli("diagnose", "--ci", "--json", "--capsule", tmp_path / "caps" / "step_00000005")
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    (top,) = [f for f in report["findings"] if f["severity"] == "error"]
    assert top["cause"] == "loss-jump", [f["cause"] for f in report["findings"]]
    evidence = top["evidence"]
    assert evidence["update_step"] == 0 and evidence["jump_step"] == 1 and evidence["first_update"]
    assert evidence["lr"] == 0.3 and evidence["skipped_after"] == 5 and evidence["loss_at_jump"] > 50
    assert not {"precision-gap", "scale-overflow"} & {f["cause"] for f in report["findings"]}


def test_a_nan_batch_stops_the_run_and_its_capsule_names_the_data_in_another_process(tmp_path):
    proc = run_cli("watch", "--capsule-dir", tmp_path / "caps", HAND_LOOP, "--nan-at", "6", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "step 5 loss" in proc.stdout and "step 6" not in proc.stdout  # stopped before step 6's weights moved
    pointer = [line for line in proc.stderr.splitlines() if line.startswith("fp16doctor:")]
    capsule = tmp_path / "caps" / "step_00000006"
    assert pointer == [
        f"fp16doctor: nonfinite at optimizer step 6: the loss is nan. Capsule: {capsule}. "
        f"Diagnose it: fp16doctor diagnose --capsule {capsule}"
    ]
    state = torch.load(capsule / "capsule.pt", weights_only=True)
    assert torch.isnan(state["batches"][0]["args"][0]).sum() == 1 and state["output_grads"][0][0] is not None
    history = json.loads((capsule / "manifest.json").read_text())["history"]  # plain JSON beside the state
    assert state["scaler"]["scale"] == 65536.0 and history[-1]["skipped"] and "history" not in state

    shutil.move(
        str(capsule), tmp_path / "moved"
    )  # another folder, another process: the script's class rebuilds by value
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", tmp_path / "moved", cwd=ROOT)
    assert diagnosis.returncode == 1, diagnosis.stderr[-3000:]
    top = json.loads(diagnosis.stdout)["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["evidence"]["nan"] == 1
    notes = json.loads(diagnosis.stdout)["notes"]
    assert (
        any(
            n.startswith("single-step replay of optimizer step 6") and "loss computation itself is not replayed" in n
            for n in notes
        )
        and "single-step replay" in diagnosis.stderr
    )


REBUILD = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("capsule", sys.argv[1])
capsule = importlib.util.module_from_spec(spec)
spec.loader.exec_module(capsule)
model = capsule.model()
opt = capsule.optimizer(model.parameters())
names = {id(p): n for n, p in model.named_parameters()}
print(json.dumps({
    "class": type(opt).__name__,
    "groups": [{"lr": g["lr"], "weight_decay": g["weight_decay"], "params": [names[id(p)] for p in g["params"]]}
               for g in opt.param_groups],
    "moments": {names[id(p)]: float(s["momentum_buffer"].abs().sum()) for p, s in opt.state.items()},
}))
"""


def test_a_capsule_rebuilds_the_scripts_own_optimizer_class_and_its_parameter_groups(tmp_path):
    """An optimizer class the script defines (in __main__, which the replay's process does not have), over two
    parameter groups listed head first: the capsule's optimizer is that class, with each group's parameters, rate and
    weight decay, and the moments each parameter had (they were loaded into one group of defaults, silently)."""
    proc = run_cli(
        "watch", "--capsule-dir", "caps", HAND_LOOP, "--nan-at", "6", "--groups", "--own-optimizer", cwd=tmp_path
    )
    assert proc.returncode == 1 and "nonfinite at optimizer step 6" in proc.stderr, proc.stderr[-2000:]
    capsule = tmp_path / "caps" / "step_00000006"
    rebuilt = run_python("-c", REBUILD, capsule / "train_capsule.py", cwd=tmp_path)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    built = json.loads(rebuilt.stdout)
    assert built["class"] == "MomentumSGD" and "note:" not in rebuilt.stderr
    assert built["groups"] == [
        {"lr": 1e-2, "weight_decay": 0.0, "params": ["body.3.weight", "body.3.bias"]},
        {"lr": 1e-3, "weight_decay": 0.01, "params": ["body.0.weight", "body.0.bias"]},
    ]
    assert set(built["moments"]) == {"body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias"}
    assert all(v > 0 for v in built["moments"].values())
    diagnosed = run_cli("diagnose", "--ci", "--json", "--capsule", capsule)
    assert diagnosed.returncode == 1, diagnosed.stderr[-2000:]
    assert json.loads(diagnosed.stdout)["findings"][0]["cause"] == "nonfinite-data"


def test_keep_going_finishes_the_run_and_still_exits_1(tmp_path):
    proc = run_cli(
        "watch", "--keep-going", "--capsule-dir", "caps", HAND_LOOP, "--steps", "8", "--nan-at", "3", cwd=tmp_path
    )
    assert proc.returncode == 1 and "step 7 loss" in proc.stdout
    assert [p.name for p in (tmp_path / "caps").iterdir()] == ["step_00000003"]


def test_the_scripts_own_errors_and_exit_codes_come_through(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\nprint('bye')\nsys.exit(3)\n")
    (tmp_path / "raises.py").write_text("def go():\n    raise ValueError('broken config')\n\ngo()\n")
    exits = run_cli("watch", "exits.py", cwd=tmp_path)
    assert exits.returncode == 3 and exits.stdout == "bye\n"
    raises = run_cli("watch", "raises.py", cwd=tmp_path)
    assert raises.returncode == 1 and raises.stderr.startswith("Traceback (most recent call last):")
    assert 'raises.py", line 2, in go' in raises.stderr and "ValueError: broken config" in raises.stderr
    assert "fp16doctor/cli.py" not in raises.stderr and "runpy" not in raises.stderr
    (tmp_path / "interrupted.py").write_text("raise KeyboardInterrupt\n")
    interrupted = run_cli("watch", "interrupted.py", cwd=tmp_path)
    assert interrupted.returncode == 130 and interrupted.stderr.rstrip().endswith("KeyboardInterrupt")
    needs_args = run_cli("watch", HAND_LOOP, "--steps", cwd=tmp_path)  # argparse's own message and code
    assert needs_args.returncode == 2 and "expected one argument" in needs_args.stderr


def test_a_missing_script_or_module_is_pythons_own_complaint(tmp_path):
    missing = run_cli("watch", "nope.py", cwd=tmp_path)
    assert missing.returncode == 2 and "can't open file" in missing.stderr and "nope.py" in missing.stderr
    module = run_cli("watch", "-m", "no_such_module_here", "--flag", cwd=tmp_path)
    assert module.returncode == 1 and "No module named no_such_module_here" in module.stderr
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    ran = run_cli("watch", "-m", "pkg.train", "--lr", "3", cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout == "__main__ ['--lr', '3']\n"
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "helpers.py").write_text("WIDTH = 7\n")
    (tmp_path / "project" / "run.py").write_text("import sys\nfrom helpers import WIDTH\nprint(WIDTH, sys.argv)\n")
    sibling = run_cli("watch", "project/run.py", "-x", cwd=tmp_path)  # its folder first on sys.path, as python puts it
    assert sibling.returncode == 0 and sibling.stdout == "7 ['project/run.py', '-x']\n"


def test_an_incomplete_or_foreign_capsule_is_bad_input_naming_what_is_missing(tmp_path):
    proc = run_cli("watch", "--capsule-dir", "caps", HAND_LOOP, "--steps", "4", "--nan-at", "1", cwd=tmp_path)
    capsule = tmp_path / "caps" / "step_00000001"
    assert proc.returncode == 1 and capsule.is_dir()
    (capsule / "model.pt").unlink()
    incomplete = run_cli("diagnose", "--capsule", capsule)
    assert incomplete.returncode == 2 and "model.pt missing" in incomplete.stderr
    manifest = json.loads((capsule / "manifest.json").read_text())
    (capsule / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    foreign = run_cli("diagnose", "--capsule", capsule)
    assert foreign.returncode == 2 and "format 1" in foreign.stderr


def test_diagnose_given_a_plain_script_points_at_watch(tmp_path):
    proc = run_cli("diagnose", HAND_LOOP, cwd=tmp_path)
    assert proc.returncode == 2 and "does not define model() and data()" in proc.stderr
    assert f"fp16doctor watch {HAND_LOOP} ARGS" in " ".join(proc.stderr.split())


def torchrun_watch(tmp_path, *args):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fp16doctor",
        "watch",
        "--capsule-dir",
        "caps",
        SCRIPTS / "ddp_loop.py",
        *args,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = launch_ranks(list(map(str, command)), tmp_path, env)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("fp16doctor:")]
    return proc, lines, sorted(p.name for p in (tmp_path / "caps").iterdir()) if (tmp_path / "caps").exists() else []


def test_torchrun_watches_every_rank_and_only_the_poisoned_rank_writes(tmp_path):
    proc, lines, capsules = torchrun_watch(tmp_path, "--poison-rank", "1", "--poison-step", "3")
    assert proc.returncode != 0 and capsules == ["rank1_step_00000003"], proc.stderr[-3000:]
    assert any("nonfinite at optimizer step 3 on rank 1" in line and "rank1_step_00000003" in line for line in lines)
    assert "fp16doctor: stopped at optimizer step 3 on rank 0: rank 1 raised an alarm." in lines  # rank 0 stops with it
    assert "step 4" not in proc.stdout
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", tmp_path / "caps" / capsules[0])
    assert json.loads(diagnosis.stdout)["findings"][0]["cause"] == "nonfinite-data", diagnosis.stderr[-3000:]


def test_torchrun_ranks_that_disagree_on_the_scale_are_an_alarm(tmp_path):
    proc, lines, capsules = torchrun_watch(tmp_path, "--skew-scale-rank", "1", "--fp16-compress")
    assert proc.returncode != 0 and capsules == ["rank0_step_00000000"], proc.stderr[-3000:]
    # Two ranks write to one stderr: their lines can interleave mid-line, so each message is counted in the text.
    assert (
        proc.stderr.count(
            "fp16doctor: warning: DDP gradients are all-reduced in half precision (fp16_compress_hook): remove "
            "the compression hook to reduce them in fp32 (cause ddp-half-allreduce)."
        )
        == 1
    )  # the same hook on every rank: rank 0 says so, once
    for rank in (0, 1):  # every rank says so
        assert (
            f"fp16doctor: rank-disagreement at optimizer step 0 on rank {rank}: the ranks disagree (rank 0: scale "
            "65536, stepped, rank 1: scale 4096, stepped)."
        ) in proc.stderr
    assert (
        "stepped). No capsule: rank 0 is to write it (its line says where)." in proc.stderr
    )  # rank 1's line points at the capsule's writer


GAN_LOOP = SCRIPTS / "gan_loop.py"


def test_a_gan_whose_discriminator_joins_later_is_watched_at_every_step_of_both_optimizers(tmp_path):
    """The discriminator's optimizer is created and first stepped at step 3, after the generator's model was
    found: its steps are checked, its alarm names it, and its capsule holds the discriminator and exactly
    its two forwards of that step (not the detached generator forward, not the generator loss's D(fake))."""
    plain = run_python(GAN_LOOP, "--steps", "8", cwd=tmp_path)
    watched = run_cli("watch", GAN_LOOP, "--steps", "8", cwd=tmp_path)
    assert watched.returncode == 0 and watched.stdout == plain.stdout and "loss_d" in plain.stdout, watched.stderr[
        -2000:
    ]
    assert not any(tmp_path.iterdir())

    proc = run_cli("watch", "--capsule-dir", "caps", GAN_LOOP, "--nan-at", "5", cwd=tmp_path)
    assert proc.returncode == 1 and "step 4 loss_g" in proc.stdout and "step 5" not in proc.stdout, proc.stderr[-2000:]
    capsule = tmp_path / "caps" / "step_00000002"  # the discriminator's third step (it began at step 3)
    assert (
        "fp16doctor: nonfinite at optimizer step 2 of Adam (Discriminator): the loss is nan. Capsule: caps/step_00000002."
        in proc.stderr
    )
    state = torch.load(capsule / "capsule.pt", weights_only=True)
    assert torch.load(capsule / "model.pt", weights_only=False).__class__.__name__ == "Discriminator"
    assert len(state["batches"]) == 2 and [torch.isnan(b["args"][0]).sum().item() for b in state["batches"]] == [1, 0]
    assert all(grads[0].shape == (16, 1) for grads in state["output_grads"])

    shutil.move(str(capsule), tmp_path / "moved")
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", tmp_path / "moved", cwd=ROOT)
    top = json.loads(diagnosis.stdout)["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["evidence"]["nan"] == 1, diagnosis.stderr[-3000:]
    assert top["verification"]["repaired"]  # the NaN row dropped, with its row of the recorded output gradient


def test_diagnose_given_a_script_whose_model_is_a_module_points_at_watch(tmp_path):
    """A script's `model = torch.compile(net)` is a module, not the contract's `def model()`: still a script."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\n")
    proc = run_cli("diagnose", script, cwd=tmp_path)
    assert proc.returncode == 2 and "does not define model() and data()" in proc.stderr
    assert f"fp16doctor watch {script} ARGS" in " ".join(proc.stderr.split())
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\n\ndef data():\n    return []\n")
    with_data = run_cli("diagnose", script, cwd=tmp_path)
    assert with_data.returncode == 2 and "does not define model()" in with_data.stderr
    assert f"fp16doctor watch {script} ARGS" in " ".join(with_data.stderr.split())
