"""Rules: stable unique codes, their own sample cases, and fixes that really fix.

Every rule names the sample models whose top cause it is (``triggers``) and
the healthy ones it must leave alone (``passes``); this file turns them into
tests. Diagnoses are cached per (sample, config) for the session.
"""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, SAMPLES, diagnosed

from fp16doctor.diagnosis import fixed_config
from fp16doctor.diagnosis.findings import EvidenceRecord
from fp16doctor.diagnosis.rules import all_rules

CONTRACT_CODES = {
    "compiled-divergence",
    "half-precision-reduce",
    "fp16-params-unscaled",
    "half-outputs",
    "half-cast-inputs",
    "bf16-accumulation",
    "nonfinite-data",
    "extreme-data",
    "fp32-divergence",
    "loss-in-half",
    "activation-overflow",
    "grad-underflow",
    "scale-overflow",
    "scale-growth",
    "half-weights",
    "half-batchnorm",
    "half-optimizer-state",
    "clip-before-unscale",
    "lr-schedule-peak",
    "scheduler-skip-drift",
    "precision-gap",
    "bf16-advice",
    "constant-out-of-range",
    "empty-targets",
    "scaler-misuse",
    "backward-overflow",
    "loss-name-mismatch",
    "constant-loss",
    "fp32-loss-rises",
    "divisor-underflow",
    "unstable-loss",
    "capsule-state",
    "loss-jump",
    "lr-too-high",
}
RULES = all_rules()
TRAINING_FILES = ROOT / "tests" / "training_files"
HEALTHY = ["mlp.py", "cnn_batchnorm.py", "transformer_encoder.py"]


def test_codes_are_unique_and_exactly_the_contract():
    codes = [r.code for r in RULES]
    assert len(codes) == len(set(codes))
    assert set(codes) == CONTRACT_CODES


def test_every_rule_documents_itself_and_has_a_sample():
    for rule in RULES:
        assert rule.doc(), rule.code
        assert rule.severity in ("error", "warning", "info")
        # Advice, and a warning that explains no symptom, never becomes an error: it tops no unhealthy sample
        # (bf16-advice; loss-name-mismatch, constant-loss and fp32-loss-rises have their training files in tests/test_loss_warnings.py).
        never_an_error = rule.severity != "error" and not rule.explains
        if not never_an_error and rule.fires_on and not rule.capsule_only:
            # (a cause only the intervention search names has training files instead; one only a capsule shows,
            # watched scripts)
            assert rule.triggers or rule.training_files, rule.code
        for sample in rule.triggers + rule.passes:
            assert (SAMPLES / sample).is_file(), sample
        for name in rule.training_files:
            assert (TRAINING_FILES / name).is_file(), name


TRIGGERS = [(r.code, s) for r in RULES for s in r.triggers]


@pytest.mark.parametrize("code,sample", TRIGGERS, ids=[f"{c}:{s}" for c, s in TRIGGERS])
def test_sample_gets_its_top_cause(code, sample):
    _, result = diagnosed(sample)
    assert result.findings, f"{sample}: no findings"
    top = result.findings[0]
    assert top.cause == code, [(f.cause, f.severity, f.title) for f in result.findings]
    assert top.evidence_json() and top.fix.summary
    expected_severity = next(r.severity for r in RULES if r.code == code)
    assert top.severity in ("error", expected_severity)


@pytest.mark.parametrize("sample", HEALTHY)
def test_healthy_samples_have_no_error_finding(sample):
    _, result = diagnosed(sample)
    assert result.healthy, [(f.cause, f.title) for f in result.findings]
    assert result.evidence.symptoms == [], [
        s.description for s in result.evidence.symptoms
    ]  # measured, not only ruled out


VERIFIABLE = [(r.code, s) for r in RULES if r.verifiable for s in r.triggers]


@pytest.mark.parametrize("code,sample", VERIFIABLE, ids=[f"{c}:{s}" for c, s in VERIFIABLE])
def test_applying_the_config_patch_fixes_the_training(code, sample):
    layers, result = diagnosed(sample)
    patched = fixed_config(layers, result)
    assert patched != layers  # the fix changed something
    _, again = diagnosed(sample, json.dumps(patched))
    assert again.healthy, [(f.cause, f.title) for f in again.findings if f.severity == "error"]


def test_a_root_cause_hides_its_symptoms():
    _, result = diagnosed("nan_in_data.py")
    causes = [f.cause for f in result.findings]
    assert causes == ["nonfinite-data"]  # not fp32-divergence, not scale-overflow
    evidence = result.findings[0].evidence_json()
    assert (
        evidence["first"]["batch"] == 3 and evidence["first"]["position"] == [5, 7] and evidence["batches"] == [3, 11]
    )


def test_user_exception_in_a_probe_is_evidence():
    _, result = diagnosed("model_half.py")
    finding = result.findings[0]
    assert finding.cause == "half-weights"
    assert "FP16 gradients" in finding.evidence_json()["exception"]["message"]
    assert finding.fix.config_patch["overrides"]["fp32_weights"] is True


def test_diagnosed_findings_come_in_severity_order_with_consecutive_ranks():
    mixed = 0
    for sample in ("loss_in_half.py", "warmup_skips.py", "bf16_pretrained_ffn.py"):
        _, result = diagnosed(sample)
        severities = [("error", "warning", "info").index(f.severity) for f in result.findings]
        assert severities == sorted(severities)
        assert [f.rank for f in result.findings] == list(range(1, len(result.findings) + 1))
        mixed += len(set(severities)) > 1
    assert mixed  # at least one diagnosis where the order had something to decide


def test_ranking_is_severity_then_repair_then_size_then_root_cause_then_causal_order():
    """Each neighbouring pair below is decided by one criterion of the documented ranking."""
    from fp16doctor.diagnosis.findings import Finding, Fix, Verification
    from fp16doctor.diagnosis.triage import rank

    def finding(cause, order, severity="error", removed=None, size=None):
        verification = (
            None
            if removed is None
            else Verification(
                tried="x",
                symptoms_before=["nonfinite"],
                symptoms_after=[],
                removed_share=removed,
                repaired=removed == 1.0,
                size=size,
            )
        )
        return Finding(
            cause=cause,
            severity=severity,
            title=cause,
            evidence=EvidenceRecord(),
            fix=Fix("x"),
            order=order,
            verification=verification,
        )

    expected = [
        finding("lr-schedule-peak", 80, removed=1.0, size=1),  # repaired, the smallest change, a root cause
        finding("scale-overflow", 70, removed=1.0, size=1),  # same, but lr-schedule-peak names it as its symptom
        finding("precision-gap", 90, removed=1.0, size=2),  # repaired, a larger change
        finding("clip-before-unscale", 65, removed=0.5, size=1),  # removed some symptoms only
        finding("extreme-data", 20),  # nothing tried: causal order decides
        finding("half-batchnorm", 41),
        finding("scale-growth", 72, severity="warning"),  # severity before everything
        finding("bf16-advice", 100, severity="info"),
    ]
    ranked = rank(list(reversed(expected)))
    assert [f.cause for f in ranked] == [f.cause for f in expected]
    assert [f.rank for f in ranked] == list(range(1, 9))
    # a reduction in fp16 that overflows: a loss scale below 1 repairs it too, but the reduction is the cause
    overflow, reduction = (
        finding("scale-overflow", 70, removed=1.0, size=1),
        finding("half-precision-reduce", 86, removed=1.0, size=1),
    )
    assert [f.cause for f in rank([overflow, reduction])] == ["half-precision-reduce", "scale-overflow"]


def test_localisation_names_module_and_operator():
    _, result = diagnosed("bf16_pretrained_ffn.py")
    finding = result.findings[0]
    assert finding.evidence_json()["module"] == "block.ff.wo" and finding.evidence_json()["operator"] == "aten::mm"
    assert finding.evidence_json()["deterministic"] is True
    assert finding.fix.config_patch == {
        "overrides": {"fp32_modules": ["block"]}
    }  # the block whose fp32 output fits fp16


def test_loss_scale_recommendation_lies_in_the_derived_window():
    _, result = diagnosed("no_loss_scaling.py")
    finding = result.findings[0]
    low, high = finding.evidence_json()["scale_window"]
    assert low <= finding.fix.config_patch["scaler"]["init_scale"] <= high
    assert finding.fix.config_patch["scaler"]["enabled"] is True


@pytest.mark.parametrize("sample", ["fast_variance_norm.py", "scale_grows_fast.py", "half_optimizer_state.py"])
def test_ci_fast_path_agrees_with_the_full_diagnosis(sample):
    _, full = diagnosed(sample)
    _, fast = diagnosed(sample, ci=True)
    assert not full.healthy and not fast.healthy
    assert fast.findings[0].cause == full.findings[0].cause
    assert fast.evidence.steps <= 20 and fast.evidence.steps <= full.evidence.steps


def test_ci_fast_path_keeps_a_healthy_model_healthy():
    _, full = diagnosed("mlp.py")
    _, fast = diagnosed("mlp.py", ci=True)
    assert full.healthy and fast.healthy and fast.evidence.steps <= 20


HAND_ROLLED = """import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "scaler": {"enabled": False}}
STATIC_SCALE = 2.0 ** 26

def model():
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

def data():
    g = torch.Generator().manual_seed(0)
    c = torch.randn(10, 32, generator=g)
    for _ in range(20):
        y = torch.randint(0, 10, (64,), generator=g)
        yield c[y] + 0.5 * torch.randn(64, 32, generator=g), y

def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = F.cross_entropy(model(x), y)
    (loss * STATIC_SCALE).backward()
    grads = [p.grad for p in model.parameters()]
    if all(torch.isfinite(g).all() for g in grads):
        for g in grads:
            g.div_(STATIC_SCALE)
        optimizer.step()
    return loss
"""


def test_hand_rolled_static_scaling_is_recognised(tmp_path):
    from fp16doctor.config import build_config
    from fp16doctor.diagnosis import diagnose
    from fp16doctor.userfile.spec import load_training_file

    path = tmp_path / "hand_rolled.py"
    path.write_text(HAND_ROLLED)
    spec = load_training_file(path)
    result = diagnose(spec, build_config(spec.config, {"device": "cpu", "steps": 8}))
    top = result.findings[0]
    assert top.cause == "scale-overflow" and top.evidence_json()["scaler_called"] is False
    assert "scaler.scale(loss).backward()" in top.fix.code


def test_an_overflow_settling_only_predicts_beyond_calibration_is_a_warning_not_an_error():
    """Ten leading skips are calibration (no symptom); the window predicting eleven is no measured fault: an error
    there made a healthy VAE exit 1 with no symptom."""
    from fp16doctor.diagnosis.rules.scale_overflow import ScaleOverflow, predicted_settling

    (finding,) = ScaleOverflow().check(predicted_settling())
    assert finding.severity == "warning" and "settling" in finding.title


def test_a_reduction_that_breaks_finite_gradients_under_another_fault_is_an_error_that_says_both():
    """The reduction made inf of gradients every rank held finite on 20 steps, and the same training reduced in fp32
    still skips (a backward overflow on top): measured, so an error, not 'no symptom yet', naming the other fault."""
    from fp16doctor.diagnosis.rules.half_precision_reduce import HalfPrecisionReduce, reduction_case

    (found,) = HalfPrecisionReduce().check(reduction_case(float("inf"), 20, ["skips"], ["skips"]))
    assert found.severity.value == "error" and "no symptom" not in found.title
    assert "reduced in fp32 the ranks still show skips: another cause on top of it" in found.title


def test_a_reduction_within_rounding_at_2_ranks_that_overflows_at_4_says_so_first():
    from fp16doctor.diagnosis.rules.half_precision_reduce import HalfPrecisionReduce, reduction_case

    (found,) = HalfPrecisionReduce().check(reduction_case(4e-4, 0, [], [], growth={4: float("inf")}))
    assert found.severity.value == "warning"
    assert found.title.startswith(
        "The gradients are reduced in half precision (fp16_compress_hook): over 4 ranks the reduction makes an inf "
        "or NaN of finite gradients; over 2 it is within 0.0004 of fp32"
    ), found.title


def test_the_reduction_fix_is_written_for_the_users_wrapper_keeping_its_own_fields():
    from fp16doctor.diagnosis.rules.half_precision_reduce import _fix, reduction_case

    fsdp1 = reduction_case(
        float("inf"),
        3,
        ["skips"],
        [],
        policy={"param_dtype": "float16", "reduce_dtype": "float16", "buffer_dtype": "float16"},
    ).parallel
    fsdp1.topology = "FullyShardedDataParallel"
    code = _fix(fsdp1).code
    assert code.startswith("FullyShardedDataParallel(model, mixed_precision=MixedPrecision(") and "buffer_dtype" in code
    fsdp2 = reduction_case(
        float("inf"),
        3,
        ["skips"],
        [],
        policy={
            "param_dtype": "bfloat16",
            "reduce_dtype": "float16",
            "output_dtype": "float32",
            "cast_forward_inputs": False,
        },
    ).parallel
    fsdp2.topology = "FSDPNet"
    assert _fix(fsdp2).code == (
        "fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32, "
        "cast_forward_inputs=False, reduce_dtype=torch.float32))"
    )
