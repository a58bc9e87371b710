"""No error without a symptom: every error finding stands on a measured symptom tied to it.

A static fact (half-precision parameters, half BatchNorm, half optimizer state) is a warning that says what
it can lead to; only a measured symptom that its rule explains makes it an error. Checked over every sample
model and every training file under tests/training_files, each diagnosed by the CLI in a fresh process.
"""

from __future__ import annotations

import pytest
from conftest import ROOT, SAMPLES, diagnose_ci

SPREAD_OVER_WORKERS = True
"""Independent fresh-process diagnoses: the workers share them out (see conftest.py)."""

FILES = ROOT / "tests" / "training_files"
SIBLING_MODULES = {"sibling_layers.py"}
"""Helper modules other training files import: not training files themselves."""
BAD_INPUT = {"module_global_optimizer.py"}
"""Training files the doctor refuses as bad input (exit 2): they have no diagnosis to check."""
EVERY_FILE = sorted(
    p for p in [*SAMPLES.glob("*.py"), *FILES.glob("*.py")] if p.name not in SIBLING_MODULES | BAD_INPUT
)


@pytest.mark.slow
@pytest.mark.parametrize("path", EVERY_FILE, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_error_finding_has_a_tied_measured_symptom(path):
    proc = diagnose_ci(path)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    report = proc.report()
    measured = {s["symptom"] for s in report["symptoms"]}
    for finding in report["findings"]:
        if finding["severity"] != "error":
            continue
        tied = finding["evidence"].get("symptoms") or []
        codes = {s["symptom"] if isinstance(s, dict) else s for s in tied}
        assert codes, f"{finding['cause']} is an error with no measured symptom tied to it: {finding['title']}"
        assert codes <= measured, f"{finding['cause']} is tied to {codes - measured}, which was not measured"
    assert (report["verdict"] == "healthy") == (proc.returncode == 0)
