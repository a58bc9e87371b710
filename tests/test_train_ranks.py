"""`train --nproc`: the ranks build the training as the file does (optimizers over the model it built, the regions it
runs eagerly named as in that model), compiled where it compiles, and the command reads only this run's outcome."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from conftest import run_cli
from torch import nn

from fp16doctor.config import build_config
from fp16doctor.engine.probe import _as_optimized
from fp16doctor.errors import DoctorError
from fp16doctor.run import launch
from fp16doctor.run.train import SHARDED_NOT_REPLAYED, TrainOptions

COMPILED_WITH_OWN_OPTIMIZERS = """
import torch
from torch import nn

CONFIG = {"compile": {"eager_modules": ["head"]}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x))


def model():
    return torch.compile(Net(), backend="eager")


def optimizers(model):
    # the file knows its model's attributes: a slower learning rate for the head
    return torch.optim.AdamW([
        {"params": model.body.parameters()},
        {"params": model.head.parameters(), "lr": 1e-4},
    ], lr=1e-3)


def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(8)]
"""


def test_the_ranks_hand_optimizers_the_built_model_and_run_its_named_region_eagerly(training_file, tmp_path):
    path = training_file(COMPILED_WITH_OWN_OPTIMIZERS)
    proc = run_cli("train", path, "--nproc", "2", "--steps", "3", "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert any("train runs the model compiled" in note for note in summary["notes"])


class Flattening(nn.Module):
    """A wrapper that replaces its module's parameters with one flat parameter of its own, as FSDP1 does."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        self.module = module
        for child in module.modules():
            child._parameters.clear()


class Keeping(nn.Module):
    """A wrapper that trains its module's own parameters, as DDP does."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def test_optimizers_get_the_built_model_unless_the_wrapper_replaced_its_parameters():
    built = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert _as_optimized(built, built) is built
    assert _as_optimized(built, Keeping(built)) is built
    flattening = Flattening(nn.Sequential(nn.Linear(4, 4)))
    assert _as_optimized(flattening.module, flattening) is flattening


def test_a_crashed_run_is_a_failure_though_an_earlier_runs_summary_is_in_its_folder(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 100, "first_step": 0}))
    monkeypatch.setattr(launch.subprocess, "run", lambda command: subprocess.CompletedProcess(command, 1))
    with pytest.raises(DoctorError, match="2-process run failed"):
        launch.train_distributed(build_config({}), TrainOptions(run_dir=run_dir), 2, tmp_path / "train.py")


FSDP_COMPILED = """
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

WRAPPER = "{wrapper}"


def model():
    torch.manual_seed(0)
    return torch.compile(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)), backend="eager")


def parallelize(model):
    if WRAPPER == "fsdp1":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))  # use_orig_params=False, its default
    fully_shard(model)
    return model


def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(8)]
"""


@pytest.mark.parametrize("wrapper", ["fsdp1", "fully_shard"])
def test_an_fsdp1_model_dynamo_cannot_compile_is_said_to_train_eager(training_file, tmp_path, wrapper):
    """Dynamo refuses FSDP1 units without use_orig_params=True (a graph break at each): compiled, they run eager, and
    the run says so; FSDP2's fully_shard compiles."""
    path = training_file(FSDP_COMPILED.format(wrapper=wrapper))
    proc = run_cli("train", path, "--nproc", "2", "--steps", "2", "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = json.loads((tmp_path / "run" / "summary.json").read_text())["notes"]
    assert any("train runs the model compiled" in note for note in notes)
    assert any("without use_orig_params=True eagerly" in note for note in notes) == (wrapper == "fsdp1")


SHARDED_TRAINING = """
import torch
from torch import nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard

CONFIG = {"steps": 6, "lr": 1e-3, "dtype": "bfloat16"}
WRAPPER = "{wrapper}"


def model():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def data():
    g = torch.Generator().manual_seed(5)
    for _ in range(48):
        yield torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)


def loss(model, batch):
    return F.cross_entropy(model(batch[0]).float(), batch[1])


def parallelize(model):
    if WRAPPER == "fsdp1":
        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return FullyShardedDataParallel(model, mixed_precision=policy, use_orig_params=True, device_id=torch.device("cpu"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    return fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
"""


@pytest.mark.parametrize("wrapper", ["fsdp1", "fully_shard"])
def test_a_sharded_run_resumed_from_its_checkpoint_reproduces_the_uninterrupted_run(training_file, tmp_path, wrapper):
    """Each rank holds a shard of the weights and of the optimizer state: the checkpoint holds them whole (the
    user's names and shapes), and each rank takes its own shard back. Rank 0's shards saved and loaded on every rank
    would give rank 1 rank 0's shard: the resumed loss would jump back."""
    path = training_file(SHARDED_TRAINING.replace("{wrapper}", wrapper))
    common = ("--nproc", "2", "--device", "cpu", "--checkpoint-every", "2")
    assert run_cli("train", path, *common, "--run-dir", tmp_path / "full").returncode == 0
    part = run_cli("train", path, *common, "--run-dir", tmp_path / "part", "--steps", "3")
    assert part.returncode == 0, part.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "part" / "checkpoints" / "step_00000003.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in checkpoint["model"].items()} == {
        "0.weight": (64, 32), "0.bias": (64,), "2.weight": (4, 64), "2.bias": (4,),
    }  # fmt: skip
    (optimizer,) = checkpoint["optimizers"].values()
    assert tuple(optimizer["state"]["0.weight"]["exp_avg"].shape) == (64, 32)  # whole, not rank 0's shard
    resumed = run_cli("train", path, *common, "--run-dir", tmp_path / "part", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full, part = (pd.read_csv(tmp_path / run / "metrics.csv") for run in ("full", "part"))
    assert len(full) == 6
    for column in ("loss", "grad_norm", "loss_scale", "skipped"):
        assert part[column].tolist() == full[column].tolist(), column  # bit for bit


def test_a_parallelize_that_raises_in_train_is_the_files_error_at_its_line(training_file, tmp_path):
    path = training_file(
        SHARDED_TRAINING.replace('WRAPPER == "fsdp1"', "True").replace(', device_id=torch.device("cpu")', "")
    )
    proc = run_cli("train", path, "--nproc", "2", "--device", "cpu", "--run-dir", tmp_path / "run")
    assert proc.returncode == 2
    line = next(
        i for i, text in enumerate(path.read_text().splitlines(), 1) if "FullyShardedDataParallel(model" in text
    )
    assert "error: parallelize() raised RuntimeError: FSDP needs a non-CPU accelerator device" in proc.stderr
    assert f"({path}:{line})" in proc.stderr and "Traceback" not in proc.stderr


SLOW_TRAINING = """
import time
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 200, "lr": 0.01}


def model():
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(400)]


def loss(model, batch):
    time.sleep(0.1)  # a slow step, so that Ctrl-C lands mid-run
    return F.cross_entropy(model(batch[0]), batch[1])
"""


def test_ctrl_c_on_two_ranks_checkpoints_the_completed_steps_and_exits_130(training_file, tmp_path):
    """Ctrl-C reaches the whole foreground group (the command, the launcher, the ranks), as a terminal sends it."""
    path, run_dir = training_file(SLOW_TRAINING), tmp_path / "run"
    command = [sys.executable, "-m", "fp16doctor", "train", str(path), "--nproc", "2", "--device", "cpu"]
    command += ["--run-dir", str(run_dir), "--checkpoint-every", "5"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics, deadline = run_dir / "metrics.csv", time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 7) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    done = len(pd.read_csv(metrics))
    newest = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    assert torch.load(newest, weights_only=True)["step"] == done  # exactly the completed steps


def test_a_sharded_checkpoint_before_any_applied_step_keeps_the_optimizer_unstepped(training_file, tmp_path):
    """Every step skipped (a loss scale far too high): the optimizer has no state yet. The state-dict API would make
    one by a step at learning rate 0 (Adam's step count 1, zero moments), at the checkpoint and again at the resume;
    the checkpoints, before the resume and after it, must hold none, as the training has none."""
    source = SHARDED_TRAINING.replace("{wrapper}", "fully_shard").replace(
        '"dtype": "bfloat16"}', '"dtype": "float16", "scaler": {"init_scale": 1e30}}'
    )
    path = training_file(source.replace("torch.bfloat16", "torch.float32"))
    common = ("--nproc", "2", "--device", "cpu", "--checkpoint-every", "2")
    part = run_cli("train", path, *common, "--run-dir", tmp_path / "run", "--steps", "3")
    assert part.returncode in (0, 1), part.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["first_nonfinite"]["explanation"] == SHARDED_NOT_REPLAYED  # said, where the replay used to crash
    resumed = run_cli("train", path, *common, "--run-dir", tmp_path / "run", "--resume")
    assert resumed.returncode in (0, 1), resumed.stderr[-3000:]
    assert pd.read_csv(tmp_path / "run" / "metrics.csv")["skipped"].all()  # no step applied: no state to have
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step_*.pt"))
    assert [c.name for c in checkpoints] == ["step_00000003.pt", "step_00000004.pt", "step_00000006.pt"]
    for checkpoint in checkpoints:  # written before the resume (the save) and after it (the load, then a save)
        (optimizer,) = torch.load(checkpoint, weights_only=True)["optimizers"].values()
        assert optimizer["state"] == {}, checkpoint.name
