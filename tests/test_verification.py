"""Verified fixes: each cause's intervention is tried, and the ranking follows what it repaired."""

from __future__ import annotations

import json

import torch
import yaml
from conftest import ROOT, SAMPLES, diagnose_ci, run_cli

from fp16doctor.diagnosis.findings import EvidenceRecord, Finding, Fix, Verification
from fp16doctor.diagnosis.triage import demote_unrepairing, rank
from fp16doctor.measure.numerics import GradientCapture, scale_window

FILES = ROOT / "tests" / "training_files"


def finding(cause, order, verification=None, severity="error"):
    return Finding(
        cause=cause,
        severity=severity,
        title=cause,
        evidence=EvidenceRecord(),
        fix=Fix("x"),
        order=order,
        verification=verification,
    )


def verified(repaired, removed, size=1):
    return Verification(
        tried="something",
        symptoms_before=["nonfinite"],
        symptoms_after=[] if repaired else ["nonfinite"],
        removed_share=removed,
        repaired=repaired,
        size=size,
    )


def test_a_repairing_fix_outranks_an_earlier_cause_whose_fix_does_not():
    vague = finding(
        "fp32-divergence",
        30,
        Verification(
            tried=None,
            reason="nothing",
            symptoms_before=["nonfinite"],
            symptoms_after=None,
            removed_share=None,
            repaired=False,
        ),
    )
    precise = finding("lr-schedule-peak", 80, verified(True, 1.0))
    assert [f.cause for f in rank([vague, precise])] == ["lr-schedule-peak", "fp32-divergence"]


def test_among_repairing_fixes_the_smaller_change_ranks_first():
    big = finding("scale-overflow", 70, verified(True, 1.0, size=3))
    small = finding("lr-schedule-peak", 80, verified(True, 1.0, size=1))
    assert [f.cause for f in rank([big, small])] == ["lr-schedule-peak", "scale-overflow"]


def test_a_fix_that_removes_nothing_is_demoted_to_a_warning_that_says_so():
    useless, useful = (
        finding("grad-underflow", 71, verified(False, 0.0)),
        finding("precision-gap", 90, verified(True, 1.0)),
    )
    useless, useful = demote_unrepairing([useless, useful])
    assert useless.severity == "warning" and useless.demoted and "did not change the outcome" in useless.title
    assert useful.severity == "error"


def test_the_window_keeps_gradient_mass_not_element_counts():
    """A tail of entries a trillion times smaller than the rest carries no mass: it must not drag the low bound up."""
    g = torch.cat([torch.full((1000,), 1e-3), torch.full((10,), 1e-15)])
    window = scale_window(GradientCapture(tensors={"param:w": g, "param:v": torch.full((50,), 1e-3)}, scale=1.0))
    assert window.low < 1.0 < window.high  # 1e-3 * S above 2^-24 needs S > 0.06; the 1e-15 tail would need 6e7


def test_fp32_divergence_at_a_schedule_jump_gets_the_precise_cause():
    """FP32 failing is a symptom: the capped learning rate repairs FP32 and AMP, so the vague fp32-divergence, which
    stands only where nothing repairs, is gone."""
    proc = diagnose_ci(FILES / "lr_jump_fp32_diverges.py")
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    top, causes = report["findings"][0], [f["cause"] for f in report["findings"]]
    assert top["cause"] == "lr-schedule-peak" and top["verification"]["repaired"] is True
    assert "fp32-nonfinite" in top["verification"]["symptoms_before"] and top["verification"]["symptoms_after"] == []
    assert "fp32-divergence" not in causes, causes
    assert report["corrected"]["healthy_after"] is True and report["corrected"]["config_patch"] == {
        "overrides": {"max_lr": 0.001}
    }


def test_fix_config_header_carries_the_measured_before_and_after(tmp_path):
    fixed = tmp_path / "fixed.yaml"
    proc = run_cli("diagnose", SAMPLES / "warmup_peak.py", "--ci", "--fix-config", fixed)
    assert proc.returncode == 1, proc.stderr[-2000:]
    text = fixed.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("symptoms before: skips" in line and "after: none" in line for line in header), header
    assert yaml.safe_load(text)["overrides"]["max_lr"] == 0.0001
    assert "verified:" in " ".join(proc.stdout.split())  # the terminal shows what trying the fix measured
    again = run_cli("diagnose", SAMPLES / "warmup_peak.py", "--ci", "--json", "--config", fixed)
    assert again.returncode == 0 and json.loads(again.stdout)["verdict"] == "healthy", again.stdout[-3000:]


def test_the_verification_and_corrected_records_keep_their_documented_json_keys():
    """The JSON is made from the dataclasses in their to_json: an untried fix says why, a tried one what it ran
    and measured; the records the plots draw and the ranking's size stay out of it."""
    import pandas as pd

    from fp16doctor.diagnosis.findings import CorrectedConfig

    untried = Verification(
        tried=None,
        reason="no intervention",
        symptoms_before=["skips"],
        symptoms_after=None,
        removed_share=None,
        repaired=False,
    )
    tried = Verification(
        tried="a lower scale",
        config_patch={"scaler": {"init_scale": 1024.0}},
        symptoms_before=["skips"],
        symptoms_after=[],
        removed_share=1.0,
        repaired=True,
        size=1,
        summary="AMP finite",
        amp_records=pd.DataFrame({"loss": [1.0]}),
    )
    assert list(untried.to_json()) == [
        "tried",
        "reason",
        "symptoms_before",
        "symptoms_after",
        "removed_share",
        "repaired",
    ]
    assert list(tried.to_json()) == [
        "tried",
        "config_patch",
        "symptoms_before",
        "symptoms_after",
        "removed_share",
        "repaired",
        "summary",
    ]
    corrected = CorrectedConfig(
        config_patch=tried.config_patch,
        from_findings=["scale-overflow"],
        symptoms_before=["skips"],
        symptoms_after=["skips"],
        summary="AMP finite",
        amp_records=tried.amp_records,
    )
    payload = json.loads(json.dumps(corrected.to_json()))  # plain JSON: no frame leaks in
    assert payload["healthy_after"] is False and "amp_records" not in payload and "_amp_records" not in payload
    assert set(payload) == {
        "config_patch",
        "from_findings",
        "symptoms_before",
        "symptoms_after",
        "healthy_after",
        "summary",
        "needs_data_changes",
        "needs_code_changes",
        "ranks_not_rerun",
        "ranks_symptoms_after",
        "ranks_summary",
    }


def test_a_verified_run_that_diverged_states_both_losses_not_a_share_in_the_billions():
    from fp16doctor.diagnosis.verify import final_loss_phrase

    assert final_loss_phrase(0.503, 0.5, 0.006) == "final loss within 0.6% of FP32"
    diverged = final_loss_phrase(3.8e10, 0.5, 7.6e10)
    assert "%" not in diverged and "3.8e+10" in diverged and "0.5" in diverged
    from fp16doctor.diagnosis import rule_cases as fx
    from fp16doctor.diagnosis.verify import Outcome

    outcome = Outcome(
        amp=fx.records(steps=8, losses=[0.7, 0.9, 3.0, 40.0, 9e3, 2e6, 4e8, 3.8e10]),
        fp32=fx.records(steps=8, losses=[0.7, 0.65, 0.6, 0.57, 0.55, 0.53, 0.51, 0.5]),
        symptoms=[],
    )
    summary = outcome.summary()
    assert "AMP finite" in summary and "final loss" in summary and "against FP32's" in summary and "%" not in summary
