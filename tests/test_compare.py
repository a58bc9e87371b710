"""``compare``: verdicts, alignment, JSON shape, exit codes, bad input."""

import json
import re

import pandas as pd
import pytest
from conftest import MLP_FILE, SAMPLES, run_cli

from fp16doctor.config import build_config
from fp16doctor.engine.probe import Workbench
from fp16doctor.measure.compare import compare
from fp16doctor.userfile.spec import load_training_file

HEALTHY = ["mlp.py", "cnn_batchnorm.py", "transformer_encoder.py"]


def bench_for(path, **config):
    spec = load_training_file(path)
    return Workbench(spec, build_config(spec.config, {"device": "cpu", **config}))


@pytest.mark.parametrize("sample", HEALTHY)
def test_healthy_samples_are_healthy(sample):
    result = compare(bench_for(SAMPLES / sample), ["fp32", "amp", "bf16"])
    assert result.verdict == "healthy", result.max_rel_dev
    assert all(result.max_rel_dev[m] <= result.tolerance[m] for m in ("amp", "bf16"))


def test_overflowing_loss_diverges_at_step_zero():
    result = compare(bench_for(SAMPLES / "loss_in_half.py"), ["amp", "bf16"])
    assert result.verdict == "diverged"
    assert result.verdict_by_mode == {"amp": "diverged", "bf16": "healthy"}
    assert result.first_nonfinite_step["amp"] == 0 and result.first_divergent_step["amp"] == 0
    assert result.trajectories["amp"].first_nonfinite_module is None  # the overflow is in the loss, outside any module


def test_diverged_mode_names_its_first_nonfinite_module():
    result = compare(bench_for(SAMPLES / "bf16_pretrained_ffn.py", steps=3), ["amp"])
    assert result.verdict == "diverged" and result.trajectories["amp"].first_nonfinite_module == "block.ff.wo"
    assert result.to_json()["first_nonfinite_module"] == {"amp": "block.ff.wo"}


def test_precision_loss_is_drift_with_its_worst_step():
    result = compare(bench_for(SAMPLES / "fast_variance_norm.py"), ["amp"])
    assert result.verdict == "drift"
    assert result.max_rel_dev["amp"] > 0.01 and result.first_divergent_step["amp"] is not None
    assert result.first_nonfinite_step["amp"] is None


def test_skips_of_a_settling_scale_are_aligned_not_called_drift(training_file):
    # An init_scale far too high: the first steps overflow and are skipped while the scale backs off.
    bench = bench_for(training_file(MLP_FILE), steps=8, scaler={"init_scale": 2.0**26})
    result = compare(bench, ["amp"])
    assert result.trajectories["amp"].skipped >= 3
    assert result.verdict == "healthy" and result.trajectories["amp"].symptoms == []
    assert result.trajectories["amp"].aligned[0]["skipped_before"] >= 3


def test_a_scale_that_settles_too_slowly_is_unstable_not_healthy(training_file):
    """2^30 needs 12 halvings (more than a scale's calibration allows): the steps taken agree, the run does not."""
    bench = bench_for(training_file(MLP_FILE), steps=8, scaler={"init_scale": 2.0**30})
    result = compare(bench, ["amp"])
    assert result.verdict == "unstable" and result.verdict_by_mode == {"amp": "unstable"}
    assert [s.code for s in result.trajectories["amp"].symptoms] == ["skips"]
    assert result.to_json()["symptoms"]["amp"][0]["measured"]["leading"] == 12


def test_a_scale_that_keeps_growing_past_the_window_is_unstable():
    result = compare(bench_for(SAMPLES / "scale_grows_fast.py", steps=40), ["amp"])
    skips = next(s for s in result.trajectories["amp"].symptoms if s.code == "skips")
    assert result.verdict_by_mode["amp"] == "unstable" and skips.measured["after_settling"] >= 3


def test_bf16_tolerance_is_eight_times_fp16():
    result = compare(bench_for(SAMPLES / "mlp.py", steps=3), ["amp", "bf16"], tolerance=1e-3)
    assert result.tolerance == {"amp": 1e-3, "bf16": 8e-3}


def test_fp32_that_diverges_is_reported(training_file):
    source = (
        MLP_FILE + "\nimport torch\ndef loss(model, batch):\n    return torch.log(model(batch[0]).relu().mean() * 0)\n"
    )
    result = compare(bench_for(training_file(source), steps=3), ["amp"])
    assert result.verdict == "diverged" and result.first_nonfinite_step["fp32"] == 0


# ---- the command line, as a user runs it ------------------------------------------------------


def test_cli_healthy_json_and_exit_zero(tmp_path):
    csv = tmp_path / "records.csv"
    proc = run_cli("compare", SAMPLES / "mlp.py", "--fp32", "--amp", "--steps", "5", "--json", "--csv", csv)
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    assert payload["modes"] == ["fp32", "amp"] and payload["verdict"] == "healthy"
    assert [row["step"] for row in payload["steps"]] == list(range(5))
    assert set(payload["steps"][0]["fp32"]) >= {"loss", "grad_norm"} and "loss" in payload["steps"][0]["amp"]
    assert set(payload["max_rel_dev"]) == {"amp"} and set(payload["first_divergent_step"]) == {"amp"}
    records = pd.read_csv(csv)
    assert set(records["mode"]) == {"fp32", "amp"} and len(records) == 10


def test_cli_diverged_names_mode_and_step_exit_one():
    proc = run_cli("compare", SAMPLES / "loss_in_half.py", "--fp32", "--amp", "--steps", "4")
    assert proc.returncode == 1
    assert "diverged" in proc.stdout and "amp: first non-finite step 0" in proc.stdout


def test_cli_diverged_json_is_valid_json_without_nan():
    proc = run_cli("compare", SAMPLES / "loss_in_half.py", "--amp", "--steps", "3", "--json")
    assert proc.returncode == 1
    payload = json.loads(proc.stdout)
    assert payload["verdict"] == "diverged" and payload["first_divergent_step"]["amp"] == 0
    assert "NaN" not in proc.stdout and "Infinity" not in proc.stdout


@pytest.mark.parametrize(
    "source,needle",
    [
        (None, "does not exist"),
        ("def model(:\n", "syntax error"),
        ("import torch\ndef data():\n    return [torch.zeros(2)]\n", "model()"),
        (
            "import torch\ndef model():\n    return 'net'\ndef data():\n    return [torch.zeros(2)]\n",
            "not a torch.nn.Module",
        ),
        ("import torch\ndef model():\n    return torch.nn.Linear(2, 2)\ndef data():\n    return []\n", "no batches"),
        (
            "import torch\ndef model():\n    return torch.nn.Linear(2, 2)\ndef data():\n    return ['a']\n",
            "not a supported batch",
        ),
        (
            MLP_FILE
            + "\nimport torch.nn.functional as F\ndef loss(m, b):\n    return F.cross_entropy(m(b[0]), b[1], reduction='none')\n",
            "scalar",
        ),
        ("CONFIG = {'stepz': 3}\n" + MLP_FILE, "Did you mean 'steps'"),
    ],
    ids=[
        "missing-file",
        "syntax",
        "no-model",
        "not-module",
        "empty-data",
        "bad-batch",
        "non-scalar-loss",
        "bad-config",
    ],
)
def test_cli_bad_input_is_one_message_and_exit_two(tmp_path, source, needle):
    path = tmp_path / "broken_training.py"
    if source is not None:
        path.write_text(source)
    proc = run_cli("compare", path, "--steps", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("import torch\ndef model():\n    return 1\ndef data():\n    return [torch.zeros(1)]\n")
    proc = run_cli("compare", path, "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_cli_bad_yaml_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("scaler:\n  init_scale: lots\n")
    proc = run_cli("compare", SAMPLES / "mlp.py", "--config", config)
    assert proc.returncode == 2 and "scaler.init_scale" in proc.stderr


def test_every_mode_reads_the_gradient_norm_before_the_clip(tmp_path):
    """A train_step that clips at 0.01: AMP recorded its norm at unscale_ (before the clip) and FP32/bf16 at the
    optimizer step (after it), so FP32's column read 0.01 at every step beside AMP's raw norm (user check)."""
    path = tmp_path / "clipped.py"
    path.write_text(
        MLP_FILE
        + """

def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()
"""
    )
    proc = run_cli("compare", path, "--fp32", "--amp", "--bf16", "--json", "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = json.loads(proc.stdout)["steps"]
    for row in steps:
        fp32, amp, bf16 = (row[m]["grad_norm"] for m in ("fp32", "amp", "bf16"))
        assert fp32 > 0.05 and abs(amp - fp32) < 0.01 * fp32 and abs(bf16 - fp32) < 0.05 * fp32, row


LARGE_LOSSES = """
import torch
from torch import nn

CONFIG = {"steps": 4}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def data():
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        x = torch.randn(8, 16, generator=g)
        batches.append((x, x.sum(1, keepdim=True) * 300))  # losses about 1.5e6: every number 8 characters wide
    return batches


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
"""


@pytest.mark.parametrize("width", [80, 100])
def test_the_step_table_leaves_columns_out_before_it_cuts_a_number(training_file, width):
    import io

    from rich.console import Console

    from fp16doctor.output.terminal import render_comparison

    result = compare(bench_for(training_file(LARGE_LOSSES)), ["fp32", "amp", "bf16"])
    buffer = io.StringIO()
    render_comparison(result, Console(file=buffer, width=width, color_system=None))
    table = buffer.getvalue().split("Loss and gradient norm")[1]
    assert "…" not in table and "column(s) left out to fit" in table
    assert len(re.findall(r"\b\d\.\d+e\+0[56]\b", table)) >= 3 * 4  # every mode's loss, whole, on every step
    assert max(len(line) for line in table.splitlines()) <= width
