"""The measured symptoms that decide a verdict, on records built by hand (no probe needed)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fp16doctor.config import build_config
from fp16doctor.diagnosis.findings import Evidence, EvidenceRecord, Finding, Fix
from fp16doctor.diagnosis.triage import UNEXPLAINED, explain_symptoms, unexplained_finding
from fp16doctor.engine.probe import RECORD_COLUMNS
from fp16doctor.measure.symptoms import CALIBRATION_SKIPS, excess_skips, measure, skip_profile


def records(losses, skipped=None, micro=None, nonfinite_grads=None):
    n = len(losses)
    skipped = skipped or [False] * n
    micro = micro or [False] * n
    grads = nonfinite_grads or [False] * n
    rows = []
    for i, loss in enumerate(losses):
        rows.append(
            {
                "step": i,
                "batch_index": i,
                "loss": loss,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "loss_scale": 65536.0,
                "skipped": skipped[i],
                "optimizer_stepped": not skipped[i] and not micro[i],
                "micro_step": micro[i],
                "nonfinite_loss": not math.isfinite(loss),
                "nonfinite_grads": grads[i] or skipped[i],
                "exception_type": None,
                "exception": None,
                "exception_location": None,
            }
        )
    return pd.DataFrame(rows, columns=RECORD_COLUMNS)


def codes(found):
    return [s.code for s in found]


def test_a_clean_run_has_no_symptom():
    fp32 = records([2.0 - 0.05 * i for i in range(20)])
    amp = records([2.0 - 0.05 * i + 1e-4 for i in range(20)])
    assert measure(amp, fp32) == []


def test_calibration_skips_are_no_symptom_but_slow_settling_and_recurring_skips_are():
    fp32 = records([1.0] * 40)
    settle = [True] * 3 + [False] * 37
    assert measure(records([1.0] * 40, skipped=settle), fp32) == []  # the default scale settling: normal
    slow = [True] * (CALIBRATION_SKIPS + 1) + [False] * (39 - CALIBRATION_SKIPS)
    assert codes(measure(records([1.0] * 40, skipped=slow), fp32)) == ["skips"]
    recurring = [i % 4 == 3 for i in range(40)]
    found = measure(records([1.0] * 40, skipped=recurring), fp32)
    assert codes(found) == ["skips"] and found[0].measured["after_settling"] == 10


def test_inf_gradients_the_scaler_caught_are_skips_not_nonfinite():
    fp32 = records([1.0] * 10)
    amp = records([1.0] * 10, skipped=[True] + [False] * 9)
    assert "nonfinite" not in codes(measure(amp, fp32))
    applied = records([1.0] * 10, nonfinite_grads=[False, True] + [False] * 8)  # inf gradients reached the optimizer
    found = measure(applied, fp32)
    assert codes(found) == ["nonfinite"] and found[0].step == 1 and found[0].measured["first_nonfinite"] == "gradients"


def test_nonfinite_amp_loss_with_finite_fp32_is_a_symptom_but_not_when_fp32_fails_too():
    amp = records([1.0, math.nan, math.nan])
    assert codes(measure(amp, records([1.0, 0.9, 0.8]))) == ["nonfinite"]
    assert measure(amp, records([1.0, math.nan, math.nan])) == []  # fp32-divergence's case, not a precision symptom


def test_accumulation_micro_steps_are_neither_skips_nor_steps():
    micro = [i % 4 != 3 for i in range(24)]
    profile = skip_profile(records([1.0] * 24, micro=micro))
    assert profile["attempted"] == 6 and profile["skipped"] == 0 and not excess_skips(profile)


def test_lost_updates_count_against_fp32s():
    fp32, amp = records([1.0] * 4), records([1.0] * 4)
    lost = pd.DataFrame({"lost_update_share": [0.6, 0.5]})
    none = pd.DataFrame({"lost_update_share": [0.0, 0.1]})
    assert codes(measure(amp, fp32, lost, none)) == ["lost-updates"]
    assert measure(amp, fp32, lost, lost) == []


@pytest.mark.parametrize("gap,bf16,expected", [(0.02, False, ["same-state-gap"]), (0.005, False, []), (0.05, True, [])])
def test_same_state_gap_tolerance_is_wider_for_bf16(gap, bf16, expected):
    assert codes(measure(records([1.0] * 4), records([1.0] * 4), same_state_gap=gap, bf16=bf16)) == expected


def test_trajectory_drift_compares_the_ends_of_the_curves():
    fp32 = records([2.0 - 0.1 * i for i in range(12)])
    amp = records([2.0 - 0.05 * i for i in range(12)])
    found = measure(amp, fp32)
    assert codes(found) == ["trajectory-drift"] and found[0].measured["rel_dev"] > 0.1
    assert measure(records([2.0 - 0.1 * i + 0.02 for i in range(12)]), fp32) == []  # 2% off: no symptom


def evidence_with(symptom_records):
    ev = Evidence(config=build_config({}), device="cpu", steps=10, has_scheduler=False, has_train_step=False)
    ev.symptoms = measure(symptom_records, records([1.0] * 20))
    return ev


def finding(cause, severity):
    return Finding(cause=cause, severity=severity, title=cause, evidence=EvidenceRecord(), fix=Fix("x"), order=70)


def test_a_symptom_no_rule_explains_becomes_an_unexplained_error():
    """Left over for the intervention search; what it cannot repair becomes the ``unexplained`` error."""
    ev = evidence_with(records([1.0] * 20, skipped=[True] * 20))
    _, left = explain_symptoms([], ev)
    assert [s.code for s in left] == ["skips"] and ev.explained == {"skips": []}
    made = unexplained_finding(left, ev)
    assert made.cause == UNEXPLAINED and made.severity == "error" and made.found_by == "rule"
    assert made.evidence_json()["symptoms"][0]["symptom"] == "skips" and "Inspect next" in made.fix.summary


def test_an_error_of_a_rule_that_explains_the_symptom_explains_it():
    ev = evidence_with(records([1.0] * 20, skipped=[True] * 20))
    findings, left = explain_symptoms([finding("scale-overflow", "error")], ev)
    assert left == [] and ev.explained == {"skips": ["scale-overflow"]}
    assert findings[0].evidence_json()["symptoms"] == ["skips"]


def test_a_rule_that_does_not_explain_the_symptom_leaves_it_unexplained():
    ev = evidence_with(records([1.0] * 20, skipped=[True] * 20))
    _, left = explain_symptoms([finding("grad-underflow", "error")], ev)
    assert [s.code for s in left] == ["skips"]


def test_a_warning_that_explains_a_measured_symptom_becomes_an_error():
    ev = evidence_with(records([1.0] * 20, skipped=[True] * 20))
    [warning], _ = explain_symptoms([finding("scale-growth", "warning")], ev)
    assert warning.severity == "error" and warning.evidence_json()["symptoms"] == ["skips"]


def test_a_settling_scales_lag_is_measured_aligned_before_it_is_called_drift():
    """3 settling skips in a 10-step run: batch for batch the AMP curve ends 3 updates behind FP32's (more than
    the drift threshold); on an AMP run aligned on the steps taken it agrees, so no drift is reported."""
    from conftest import ROOT

    from fp16doctor.diagnosis import DiagnoseOptions, diagnose
    from fp16doctor.measure.symptoms import probe_symptoms
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(ROOT / "tests" / "training_files" / "gpu_style_fp32_block.py")
    result = diagnose(spec, build_config(spec.config, {"device": "cpu"}), DiagnoseOptions(ci=True))
    ev = result.evidence
    assert 0 < len(ev.amp.skip_steps) <= CALIBRATION_SKIPS
    assert "trajectory-drift" in [s.code for s in probe_symptoms(ev.amp, ev.fp32)]  # unaligned: the lag
    assert ev.symptoms == [] and result.findings[0].severity != "error"


def test_every_rule_explains_only_symptoms_the_doctor_measures():
    """A misspelt code in a rule's ``explains`` would silently never tie that rule to its symptom."""
    from fp16doctor.diagnosis.rules import all_rules
    from fp16doctor.measure.symptoms import SYMPTOM_CODES, Symptom, SymptomCode

    rules = all_rules()
    assert sum(len(rule.explains) for rule in rules) > len(rules)  # the check has something to check
    for rule in rules:
        unknown = [code for code in (*rule.explains, *rule.repair_explains) if code not in set(SymptomCode)]
        assert not unknown, f"{rule.code} explains unknown symptom(s) {unknown}; known: {SYMPTOM_CODES}"
    assert Symptom(SymptomCode.SKIPS, "x").code == "skips" and type(Symptom("skips", "x").code) is str
    with pytest.raises(ValueError):
        Symptom("skip", "a typo is refused, not a symptom no rule explains")


def test_an_absorbed_overflow_is_a_result_past_range_not_an_infinity_at_zero():
    """The precision-gap stage keeps a forward operator's infinity that no module output shows only where the result
    itself left fp16's range: a product past 65504 (seen, or an infinity from a product), not log(0) or x / 0, whose
    infinity is its argument's (T5's relative-position buckets take log(0) on purpose)."""
    from fp16doctor.diagnosis import rule_cases as fx

    rounded = fx.localisation("forward", "attn", "aten::_to_copy", [(0.1, 3.0)], "+inf (float16)")
    rounded.peak = 9.15e4  # the emulated product's fp32 result, rounded to fp16
    assert rounded.made_past_range
    assert fx.localisation("forward", "norm", "aten::mul", [(-559.0, 688.5)], "+inf (float16)").made_past_range
    assert not fx.localisation("forward", "bias", "aten::log", [(0.0, 31.0)], "-inf (float32)").made_past_range
    assert not fx.localisation(
        "forward", "norm", "aten::div", [(-1.0, 1.0), (0.0, 2.0)], "nan/+inf (float16)"
    ).made_past_range
    assert rounded.inside(["attn"]) and not rounded.inside(["att"]) and rounded.inside(["attn", "ffn"])
