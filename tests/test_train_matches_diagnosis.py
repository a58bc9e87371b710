"""``train`` runs what ``diagnose`` measured: the same numerics on CPU, step for step.

Both commands run in a fresh process, as a user runs them. The AMP probe of the diagnosis and the run
``train`` starts are the same training (same config, weights, batches), so on CPU they must skip the same
steps and turn non-finite at the same step: the one the diagnosis localised. A file diagnosed healthy
trains without a non-finite step.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import ROOT, SAMPLES, run_cli

FILES = ROOT / "tests" / "training_files"

HEALTHY = [FILES / "log_of_softmax.py", SAMPLES / "mlp.py"]
"""``log_of_softmax.py`` is safe on a GPU and went non-finite in ``train`` while its diagnosis said healthy."""
FAULTY = [SAMPLES / "loss_in_half.py", SAMPLES / "nan_in_data.py", SAMPLES / "warmup_peak.py"]
"""A loss non-finite from step 0; NaN data at step 3 after calibration skips; skips from the LR peak at step 9."""


def diagnosis(path) -> dict:
    proc = run_cli("diagnose", path, "--ci", "--json", "--device", "cpu")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def trained(path, tmp_path, steps: int) -> pd.DataFrame:
    run_dir = tmp_path / "run"
    proc = run_cli("train", path, "--steps", steps, "--device", "cpu", "--run-dir", run_dir)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return pd.read_csv(run_dir / "metrics.csv")


def stage_details(report: dict, name: str) -> dict:
    return next(s["details"] for s in report["stages"] if s["name"] == name)


def first_fault(metrics: pd.DataFrame) -> int | None:
    """The step the diagnosis localises: the first non-finite loss, else the first skipped step."""
    nonfinite_loss = metrics.step[~metrics.loss.apply(lambda v: pd.notna(v) and abs(v) != float("inf"))]
    if len(nonfinite_loss):
        return int(nonfinite_loss.iloc[0])
    skipped = metrics.step[metrics.skipped]
    return int(skipped.iloc[0]) if len(skipped) else None


@pytest.mark.parametrize("path", HEALTHY, ids=lambda p: p.name)
def test_a_file_diagnosed_healthy_trains_without_a_nonfinite_step(path, tmp_path):
    report = diagnosis(path)
    assert report["verdict"] == "healthy", [f["cause"] for f in report["findings"]]
    metrics = trained(path, tmp_path, stage_details(report, "amp as configured")["steps"])
    assert not metrics.nonfinite.any(), metrics[metrics.nonfinite].head().to_dict("records")
    assert metrics.step[metrics.skipped].tolist() == stage_details(report, "amp as configured")["skipped_steps"]


@pytest.mark.parametrize("path", FAULTY, ids=lambda p: p.name)
def test_a_faulty_file_turns_nonfinite_in_train_at_the_step_the_diagnosis_localised(path, tmp_path):
    report = diagnosis(path)
    assert report["verdict"] == "unhealthy"
    amp = stage_details(report, "amp as configured")
    localised = stage_details(report, "localisation")["amp"]["step"]
    metrics = trained(path, tmp_path, amp["steps"])
    assert first_fault(metrics) == localised
    trained_steps = metrics.step.max() + 1  # train may stop early, after too many non-finite steps in a row
    assert metrics.step[metrics.skipped].tolist() == [s for s in amp["skipped_steps"] if s < trained_steps]


def test_a_healthy_file_whose_scale_settles_skips_the_same_steps_in_train(tmp_path):
    """A block kept in fp32 with ``autocast("cuda", enabled=False)``: train honours it on CPU as the diagnosis
    did (the loss stays finite), and the scale's settling skips are the same steps."""
    path = FILES / "gpu_style_fp32_block.py"
    report = diagnosis(path)
    assert report["verdict"] == "healthy", [f["cause"] for f in report["findings"]]
    amp = stage_details(report, "amp as configured")
    metrics = trained(path, tmp_path, amp["steps"])
    assert metrics.loss.map(lambda v: abs(v) != float("inf") and v == v).all()
    assert metrics.step[metrics.skipped].tolist() == amp["skipped_steps"] and amp["skipped_steps"]
