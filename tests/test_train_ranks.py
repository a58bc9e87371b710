"""`train --nproc`: the ranks build the training as the file does (optimizers over the model it built, the regions it
runs eagerly named as in that model), compiled where it compiles, and the command reads only this run's outcome."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import run_cli
from torch import nn

from fp16doctor.config import build_config
from fp16doctor.engine.probe import _as_optimized
from fp16doctor.errors import DoctorError
from fp16doctor.run import launch
from fp16doctor.run.train import TrainOptions

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
