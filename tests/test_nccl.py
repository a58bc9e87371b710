"""The multi-GPU paths, on NCCL: each needs two CUDA GPUs and is skipped without them (CI has none; on one GPU too).

The same training files and scripts as the gloo tests, each rank on its own GPU: ``diagnose --nproc`` and ``train
--nproc`` with ``--device cuda`` (the doctor's ranks are spawned, not forked, where CUDA is visible), and ``watch``
under real torchrun on DDP and on FSDP2, whose capsule the ranks write together (the object collectives on a gloo
group beside NCCL) and which replays on the CPU.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import ROOT, diagnose_ci, run_cli
from rank_launches import launch_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

FILES = ROOT / "tests" / "training_files"
SCRIPTS = ROOT / "tests" / "scripts"


def torchrun_watch(tmp_path, script, *args):
    """``torchrun --nproc-per-node 2 -m fp16doctor watch --capsule-dir caps SCRIPT --device cuda ARGS``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "fp16doctor", "watch", "--capsule-dir", "caps", str(script), "--device", "cuda", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return launch_ranks(command, tmp_path, env)


def test_diagnose_nproc_on_nccl_finds_what_gloo_finds():
    """An fp16 compression hook under bf16 training: the reduction, verified repaired, on the GPUs as on the CPU."""
    on_cpu = diagnose_ci(FILES / "bf16_prices_fp16_hook.py", "--nproc", "2")
    on_gpus = diagnose_ci(FILES / "bf16_prices_fp16_hook.py", "--nproc", "2", "--device", "cuda")
    assert on_gpus.returncode == on_cpu.returncode == 1, on_gpus.stderr[-3000:]
    top = on_gpus.report()["findings"][0]
    assert top["cause"] == on_cpu.report()["findings"][0]["cause"] == "half-precision-reduce", top
    assert top["verification"]["repaired"] is True
    stage = next(s for s in on_gpus.report()["stages"] if s["name"] == "parallel")
    assert stage["status"] == "ran", stage


def test_train_nproc_on_nccl_trains_in_the_files_topology(tmp_path):
    proc = run_cli(
        "train", FILES / "bf16_prices_fp16_hook.py", "--nproc", "2", "--device", "cuda", "--steps", "3",
        "--run-dir", tmp_path / "run",
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [f["cause"] for f in summary["findings"]] == ["ddp-half-allreduce"]


def test_a_watched_ddp_run_on_nccl_names_the_rank_of_a_bad_batch(tmp_path):
    plain = torchrun_watch(tmp_path, SCRIPTS / "ddp_loop.py")
    assert plain.returncode == 0, plain.stderr[-3000:]
    poisoned = torchrun_watch(tmp_path, SCRIPTS / "ddp_loop.py", "--poison-rank", "1", "--poison-step", "3")
    assert poisoned.returncode != 0
    assert "at optimizer step 3 on rank 1" in poisoned.stderr, poisoned.stderr[-3000:]


def test_a_watched_fsdp2_run_on_nccl_is_captured_together_and_replays_on_the_cpu(tmp_path):
    proc = torchrun_watch(tmp_path, SCRIPTS / "fsdp2_loop.py", "--poison-rank", "1", "--poison-step", "3")
    assert proc.returncode != 0
    capsules = sorted((tmp_path / "caps").glob("ranks_step_*"))
    assert len(capsules) == 1, proc.stderr[-3000:]
    diagnosis = run_cli("diagnose", "--ci", "--json", "--capsule", capsules[0], "--device", "cpu", timeout=300)
    assert diagnosis.returncode == 1, diagnosis.stderr[-3000:]
    top = json.loads(diagnosis.stdout)["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["evidence"]["ranks"] == [1], top
