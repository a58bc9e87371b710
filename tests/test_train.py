"""``fp16doctor train``: the corrected run, checkpoints, resume, Ctrl-C, SIGKILL, two processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ROOT, SAMPLES, diagnosed, run_cli

from fp16doctor.config import build_config
from fp16doctor.diagnosis import fixed_config
from fp16doctor.diagnosis.rules import all_rules
from fp16doctor.run.train import Trainer, TrainOptions, checkpoint_paths
from fp16doctor.userfile.spec import load_training_file


def trainer_for(path, run_dir, steps, every=5, resume=False, **config):
    spec = load_training_file(path)
    cfg = build_config(spec.config, {"device": "cpu", "steps": steps, **config})
    return Trainer(spec, cfg, TrainOptions(run_dir=run_dir, checkpoint_every=every, resume=resume))


def test_run_writes_metrics_checkpoints_and_summary(tmp_path):
    result = trainer_for(SAMPLES / "cnn_batchnorm.py", tmp_path, steps=12, every=5).run()
    assert result.ok and result.steps == 12
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert metrics["step"].tolist() == list(range(12)) and metrics["loss"].notna().all()
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step_00000005.pt", "step_00000010.pt", "step_00000012.pt"]
    state = torch.load(checkpoint_paths(tmp_path)[-1], weights_only=True)  # loads without unpickling code
    assert set(state) >= {"model", "optimizer", "scheduler", "scaler", "rng", "data_position", "step"}
    assert state["step"] == 12 and state["data_position"] == 12
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    sample = SAMPLES / "transformer_encoder.py"  # dropout, a warm-up schedule and an early skipped step
    trainer_for(sample, tmp_path / "full", steps=24).run()
    trainer_for(sample, tmp_path / "part", steps=13, every=5).run()
    resumed = trainer_for(sample, tmp_path / "part", steps=24, every=5, resume=True).run()
    assert resumed.first_step == 13 and resumed.ok
    full = pd.read_csv(tmp_path / "full" / "metrics.csv")
    part = pd.read_csv(tmp_path / "part" / "metrics.csv")
    assert full["loss"].tolist() == part["loss"].tolist()
    assert full["grad_norm"].tolist() == part["grad_norm"].tolist()
    a = torch.load(checkpoint_paths(tmp_path / "full")[-1], weights_only=True)["model"]
    b = torch.load(checkpoint_paths(tmp_path / "part")[-1], weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_first_nonfinite_step_is_diagnosed_next_to_the_run(tmp_path):
    result = trainer_for(SAMPLES / "nan_in_data.py", tmp_path, steps=12, scaler={"init_scale": 1024.0}).run()
    assert (
        result.ok and result.nonfinite == 2 and result.skipped == 2
    )  # batches 3 and 11: skipped like the scaler would, then on
    report = json.loads((tmp_path / "nonfinite_step_3.json").read_text())
    assert report["localisation"]["phase"] == "data" and report["localisation"]["step"] == 3
    assert report["localisation"]["operator"] == "<batch field '0'>" and "nan" in report["localisation"]["output"]
    assert (tmp_path / "nonfinite_step_3.md").exists()


def test_stop_policy_and_consecutive_limit(tmp_path):
    spec = load_training_file(SAMPLES / "log_of_zero.py")  # every batch gives log(0): every step is non-finite
    cfg = build_config(spec.config, {"device": "cpu", "steps": 10})
    stopped = Trainer(spec, cfg, TrainOptions(run_dir=tmp_path / "a", max_nonfinite=3)).run()
    assert not stopped.ok and stopped.status == "stopped"
    assert stopped.steps == 3 and stopped.nonfinite == 3 and "3 non-finite steps in a row" in stopped.reason
    spec = load_training_file(SAMPLES / "nan_in_data.py")
    cfg = build_config(spec.config, {"device": "cpu", "steps": 12})
    result = Trainer(spec, cfg, TrainOptions(run_dir=tmp_path / "b", on_nonfinite="stop")).run()
    assert result.status == "stopped" and result.first_nonfinite is not None
    assert result.steps == result.first_nonfinite["step"] + 1  # stopped on the first non-finite step


FIXABLE = sorted(
    {s for r in all_rules() if r.verifiable for s in r.triggers}
    | {"mlp.py", "cnn_batchnorm.py", "transformer_encoder.py"}
)


@pytest.mark.parametrize("sample", FIXABLE)
def test_corrected_training_runs_to_the_end(sample, tmp_path):
    layers, result = diagnosed(sample)
    config = build_config(fixed_config(layers, result), {"device": "cpu"})
    run = Trainer(load_training_file(SAMPLES / sample), config, TrainOptions(run_dir=tmp_path)).run()
    assert run.ok, run.reason
    assert run.steps == config.steps
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    # what is left non-finite is the scaler's own business (a settling scale skips a few steps):
    # the loss itself stays finite on every step, and most steps update the weights
    assert metrics["loss"].map(lambda v: v == v and abs(v) != float("inf")).all()
    assert metrics["skipped"].mean() <= 0.25


SLOW_FILE = """
import time
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 40}

def model():
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 4))

def data():
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        yield torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

def loss(model, batch):
    time.sleep(0.1)   # a slow step, so a signal lands mid-run
    return F.cross_entropy(model(batch[0]), batch[1])
"""


def start_training(path: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fp16doctor",
            "train",
            str(path),
            "--run-dir",
            str(run_dir),
            "--device",
            "cpu",
            "--checkpoint-every",
            "5",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_rows(run_dir: Path, rows: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.csv"
        if path.exists() and len(path.read_text().splitlines()) > rows:
            return
        time.sleep(0.05)
    raise AssertionError("the run did not progress")


@pytest.fixture
def slow_file(tmp_path):
    path = tmp_path / "slow_training.py"
    path.write_text(textwrap.dedent(SLOW_FILE))
    return path


@pytest.fixture
def reference_losses(slow_file, tmp_path):
    proc = start_training(slow_file, tmp_path / "reference")
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    return pd.read_csv(tmp_path / "reference" / "metrics.csv")["loss"].tolist()


def test_ctrl_c_writes_a_checkpoint_and_exits_cleanly(slow_file, tmp_path, reference_losses):
    run_dir = tmp_path / "run"
    proc = start_training(slow_file, run_dir)
    wait_for_rows(run_dir, 7)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr
    done = len(pd.read_csv(run_dir / "metrics.csv"))
    newest = checkpoint_paths(run_dir)[-1]
    assert torch.load(newest, weights_only=True)["step"] == done  # exactly the completed steps
    resume = start_training(slow_file, run_dir, "--resume")
    resume.communicate(timeout=300)
    assert resume.returncode == 0
    assert pd.read_csv(run_dir / "metrics.csv")["loss"].tolist() == reference_losses


def test_sigkill_loses_at_most_k_steps(slow_file, tmp_path, reference_losses):
    run_dir = tmp_path / "run"
    proc = start_training(slow_file, run_dir)
    wait_for_rows(run_dir, 13)
    proc.kill()
    proc.communicate(timeout=60)
    done = len(pd.read_csv(run_dir / "metrics.csv"))
    newest = torch.load(checkpoint_paths(run_dir)[-1], weights_only=True)["step"]
    assert done - newest <= 5
    resume = start_training(slow_file, run_dir, "--resume")
    resume.communicate(timeout=300)
    assert resume.returncode == 0
    assert pd.read_csv(run_dir / "metrics.csv")["loss"].tolist() == reference_losses


def test_a_fresh_run_never_replaces_an_earlier_one_without_asking(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli("train", SAMPLES / "mlp.py", "--steps", "3", "--run-dir", run_dir).returncode == 0
    again = run_cli("train", SAMPLES / "mlp.py", "--steps", "3", "--run-dir", run_dir)
    assert again.returncode == 2 and "earlier run" in again.stderr
    assert run_cli("train", SAMPLES / "mlp.py", "--steps", "3", "--run-dir", run_dir, "--force").returncode == 0


def test_diagnose_train_and_train_with_the_fixed_config(tmp_path):
    fixed = tmp_path / "fixed.yaml"
    proc = run_cli("diagnose", SAMPLES / "model_half.py", "--train", "--fix-config", fixed, "--run-dir", tmp_path / "a")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "half-weights" in proc.stdout and "completed" in proc.stdout
    later = run_cli("train", SAMPLES / "model_half.py", "--config", fixed, "--run-dir", tmp_path / "b")
    assert later.returncode == 0, later.stderr[-3000:]
    a = pd.read_csv(tmp_path / "a" / "metrics.csv")["loss"].tolist()
    b = pd.read_csv(tmp_path / "b" / "metrics.csv")["loss"].tolist()
    assert a == b


def test_diagnose_train_exits_one_when_the_run_stops(tmp_path):
    proc = run_cli(
        "diagnose", SAMPLES / "log_of_zero.py", "--train", "--max-nonfinite", "3", "--run-dir", tmp_path / "a"
    )
    assert proc.returncode == 1 and "stopped" in proc.stdout


DDP_FILE = """
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 6, "lr": 0.01}
MICRO = {micro}

def model():
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))

def data():
    g = torch.Generator().manual_seed(5)
    micro = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(12)]
    if MICRO:
        return micro
    # the same global batches for one process: micro-batches 2k and 2k+1 together
    return [(torch.cat([micro[2 * k][0], micro[2 * k + 1][0]]), torch.cat([micro[2 * k][1], micro[2 * k + 1][1]])) for k in range(6)]
{extra}
"""

HOOK = """
def train_step(model, batch, optimizer, scaler, autocast):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    if hasattr(model, "register_comm_hook") and not getattr(model, "_hooked", False):
        model.register_comm_hook(None, fp16_compress_hook)
        model._hooked = True
    optimizer.zero_grad()
    with autocast():
        loss = F.cross_entropy(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
"""


@pytest.mark.slow
def test_two_processes_agree_and_match_one_process_on_the_global_batch(tmp_path):
    micro, whole = tmp_path / "micro.py", tmp_path / "whole.py"
    micro.write_text(DDP_FILE.replace("{micro}", "True").replace("{extra}", ""))
    whole.write_text(DDP_FILE.replace("{micro}", "False").replace("{extra}", ""))
    two = run_cli("train", micro, "--nproc", "2", "--run-dir", tmp_path / "two", "--device", "cpu")
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    ranks = [json.loads((tmp_path / "two" / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["param_sum"] == ranks[1]["param_sum"] and ranks[0]["param_abs_sum"] == ranks[1]["param_abs_sum"]
    assert ranks[0]["loss_scale"] == ranks[1]["loss_scale"] and ranks[0]["skipped"] == ranks[1]["skipped"]
    one = trainer_for(whole, tmp_path / "one", steps=6)
    one.run()
    two_losses = pd.read_csv(tmp_path / "two" / "metrics.csv")["loss"]
    one_losses = pd.read_csv(tmp_path / "one" / "metrics.csv")["loss"]
    assert two_losses.tolist() == pytest.approx(one_losses.tolist(), rel=2e-3)
    a = torch.load(checkpoint_paths(tmp_path / "two")[-1], weights_only=True)["model"]
    b = torch.load(checkpoint_paths(tmp_path / "one")[-1], weights_only=True)["model"]
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-3, atol=1e-4), key


@pytest.mark.slow
def test_fp16_gradient_compression_is_reported(tmp_path):
    path = tmp_path / "hooked.py"
    path.write_text(DDP_FILE.replace("{micro}", "True").replace("{extra}", HOOK))
    proc = run_cli("train", path, "--nproc", "2", "--run-dir", tmp_path / "run", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [f["cause"] for f in summary["findings"]] == ["ddp-half-allreduce"]
    assert "fp16_compress_hook" in summary["findings"][0]["title"]


def test_a_user_exception_mid_run_stops_with_its_location(tmp_path):
    path = tmp_path / "breaks.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        import torch.nn.functional as F
        calls = {"n": 0}
        def model():
            return nn.Linear(4, 2)
        def data():
            return [(torch.randn(3, 4), torch.tensor([0, 1, 0]))] * 4
        def loss(model, batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("the label file is gone")
            return F.cross_entropy(model(batch[0]), batch[1])
    """)
    )
    proc = run_cli("train", path, "--steps", "6", "--run-dir", tmp_path / "run")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "the label file is gone" in proc.stdout and "breaks.py:13" in proc.stdout
    assert len(pd.read_csv(tmp_path / "run" / "metrics.csv")) == 2


@pytest.mark.slow
def test_two_process_resume_reproduces_the_uninterrupted_run(tmp_path):
    path = tmp_path / "micro.py"
    path.write_text(
        DDP_FILE.replace("{micro}", "True")
        .replace("{extra}", "")
        .replace("nn.Linear(12, 32), nn.Tanh()", "nn.Linear(12, 32), nn.Dropout(0.2), nn.Tanh()")
    )  # every rank's RNG matters
    common = ("--nproc", "2", "--device", "cpu")
    assert run_cli("train", path, *common, "--run-dir", tmp_path / "full").returncode == 0
    assert run_cli("train", path, *common, "--run-dir", tmp_path / "part", "--steps", "3").returncode == 0
    resumed = run_cli("train", path, *common, "--run-dir", tmp_path / "part", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    full = pd.read_csv(tmp_path / "full" / "metrics.csv")["loss"].tolist()
    assert pd.read_csv(tmp_path / "part" / "metrics.csv")["loss"].tolist() == full


@pytest.mark.slow
def test_under_ddp_the_first_nonfinite_step_names_the_users_module(tmp_path):
    """The replay of a bad step under DistributedDataParallel names modules as the user's model does
    ('1.proj'), not with the wrapper's 'module.' prefix."""
    path = tmp_path / "overflows.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        CONFIG = {"steps": 3}
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(16, 16)
                with torch.no_grad():
                    self.proj.bias.fill_(1e5)   # beyond 65504 once cast to fp16
            def forward(self, x):
                return self.proj(x)
        def model():
            return nn.Sequential(nn.Linear(8, 16), Block(), nn.Linear(16, 2))
        def data():
            g = torch.Generator().manual_seed(0)
            return [(torch.rand(4, 8, generator=g) + 1, torch.randint(0, 2, (4,), generator=g)) for _ in range(6)]
    """)
    )
    proc = run_cli("train", path, "--nproc", "2", "--run-dir", tmp_path / "run", "--device", "cpu")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    localisation = summary["first_nonfinite"]["localisation"]
    assert (localisation["module"], localisation["phase"]) == ("1.proj", "forward"), (localisation, proc.stderr[-2000:])
    assert not localisation["module"].startswith("module.")


def test_a_run_whose_every_step_is_skipped_stops_and_writes_strict_json(tmp_path):
    """It reached its last step, but the weights never moved: not "completed" (user check), and summary.json and
    the non-finite step's report are strict JSON (non-finite numbers as strings, as diagnose --json writes them)."""
    proc = run_cli("train", SAMPLES / "eps_underflow_norm.py", "--steps", "4", "--run-dir", tmp_path / "run")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every one of the 4 optimizer steps was skipped" in proc.stdout

    def refuse(name):
        raise ValueError(f"bare {name} in JSON")

    summary = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=refuse)
    assert summary["status"] == "stopped" and summary["skipped"] == 4
    for report in (tmp_path / "run").glob("nonfinite_step_*.json"):
        json.loads(report.read_text(), parse_constant=refuse)
    assert list((tmp_path / "run").glob("nonfinite_step_*.json"))
