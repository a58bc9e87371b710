"""Every sample model through `fp16doctor diagnose --ci --json` in a fresh process: no crash, the right cause,
every error finding's fix tried (or why not), a repairing fix on top whenever there is one, and the
`--fix-config` it writes diagnosed healthy (or, for a data or code fix, saying what is still needed).

A sample's expected top cause is the one whose rule lists it in ``triggers``; the healthy samples
are the ones every rule lists in ``passes``. Exit 3 (an internal error) anywhere fails.
"""

from __future__ import annotations

import json

import pytest
from conftest import SAMPLES, diagnose_ci, run_cli

from fp16doctor.diagnosis.rules import all_rules

SPREAD_OVER_WORKERS = True
"""Independent fresh-process diagnoses: the workers share them out (see conftest.py)."""

RULES = all_rules()
EXPECTED = {sample: rule.code for rule in RULES for sample in rule.triggers}
HEALTHY = sorted(set.intersection(*(set(rule.passes) for rule in RULES)))
SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.py"))


def test_every_sample_is_a_trigger_or_healthy():
    assert set(SAMPLE_FILES) == set(EXPECTED) | set(HEALTHY)


@pytest.mark.parametrize("sample", SAMPLE_FILES)
def test_sample_diagnosed_from_a_fresh_process(sample, tmp_path):
    proc = diagnose_ci(SAMPLES / sample)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    report = proc.report()
    if sample in HEALTHY:
        assert proc.returncode == 0 and report["verdict"] == "healthy", report["findings"]
        return
    assert proc.returncode == 1 and report["verdict"] == "unhealthy"
    findings = report["findings"]
    assert findings[0]["cause"] == EXPECTED[sample], [(f["cause"], f["title"]) for f in findings]
    errors = [f for f in findings if f["severity"] == "error"]
    assert all(f["verification"] and (f["verification"]["tried"] or f["verification"]["reason"]) for f in errors)
    if any(f["verification"] and f["verification"]["repaired"] for f in findings):
        assert findings[0]["verification"]["repaired"], "a verified fix exists but another cause ranks first"
    assert proc.fix_config is not None, "--fix-config wrote nothing"
    if report["corrected"] is None:  # a data or code fix: the corrected config says what is still needed
        assert "Still needed" in proc.fix_config and findings[0]["cause"] in proc.fix_config
        return
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(proc.fix_config)
    again = run_cli("diagnose", SAMPLES / sample, "--ci", "--json", "--config", fixed)
    assert again.returncode == 0, f"the corrected config, re-diagnosed: {again.stdout[-3000:]}"
    assert json.loads(again.stdout)["verdict"] == "healthy"
