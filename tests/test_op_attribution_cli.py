"""A bf16 regression whose precision gap is made by operators no module holds, diagnosed in a fresh CLI process:
the model's own forward de-standardises its output (``z * ZONE_STD + ZONE_MEAN``, a mean near -10,000, which bf16
rounds to multiples of 64). Each submodule adds well under 1%; the operators at that line make the gap, and the
line computed in fp32 (``overrides.fp32_lines``) closes it, in the diagnosis, in the corrected config and in
``fp16doctor train``."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import ROOT, diagnose_ci, run_cli

FILE = ROOT / "tests" / "training_files" / "zone_load_bf16.py"


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(FILE.read_text().splitlines(), 1) if marker in text)


@pytest.fixture(scope="module")
def diagnosis(tmp_path_factory):
    proc = diagnose_ci(FILE)
    assert proc.returncode == 1 and proc.fix_config is not None, proc.stderr[-3000:]
    fixed = tmp_path_factory.mktemp("zone") / "fixed.yaml"
    fixed.write_text(proc.fix_config)
    return proc.report(), fixed


def stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def test_the_gap_is_named_at_the_root_forwards_line_with_the_code_to_write_there(diagnosis):
    report, _ = diagnosis
    line = f"zone_load_bf16.py:{line_of('z * ZONE_STD + ZONE_MEAN')}"
    top = report["findings"][0]
    assert top["cause"] == "precision-gap" and top["severity"] == "error", top["title"]
    assert line in top["title"] and "the model's own forward code" in top["title"]
    evidence = top["evidence"]
    assert evidence["closing_set"] is None  # no module set closed it: each submodule adds under 1%
    assert all(m["added_error"] < 0.01 for m in evidence["ranked_modules"])
    assert evidence["fp32_lines"] == [line] and evidence["lines_closed_gap"] <= evidence["tolerance"]
    site = evidence["operators"]["sites"][0]
    assert site["site"] == line and site["module"] == "<root>" and site["share"] > 0.9
    assert set(site["operators"]) == {"mul", "add"} and evidence["operators"]["unmatched"] == 0
    assert "zone_load = z.float() * ZONE_STD + ZONE_MEAN" in top["fix"]["code"]
    assert top["fix"]["config_patch"] == {"overrides": {"fp32_lines": [line]}}
    assert top["verification"]["repaired"] is True, top["verification"]
    assert "unexplained" not in [f["cause"] for f in report["findings"]]
    assert report["corrected"]["healthy_after"] is True


def test_the_corrected_config_is_diagnosed_healthy(diagnosis):
    report, fixed = diagnosis
    proc = run_cli("diagnose", FILE, "--ci", "--json", "--config", fixed)
    again = json.loads(proc.stdout)
    assert proc.returncode == 0 and again["verdict"] == "healthy", [f["title"] for f in again["findings"]]
    assert "precision-gap search" in {s["name"] for s in again["stages"]}


def test_train_with_the_corrected_config_reaches_fp32s_loss(diagnosis, tmp_path):
    report, fixed = diagnosis
    fp32 = stage(report, "fp32 baseline")["details"]
    amp = stage(report, "amp as configured")["details"]
    proc = run_cli("train", FILE, "--config", fixed, "--steps", fp32["steps"], "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = float(pd.read_csv(tmp_path / "run" / "metrics.csv")["loss"].iloc[-1])
    assert abs(amp["final_loss"] - fp32["final_loss"]) > 3 * fp32["final_loss"]  # the gap, without the fix
    assert abs(final - fp32["final_loss"]) < 0.05 * fp32["final_loss"]
