"""The intervention search, through the CLI in fresh processes, on faults that no rule names.

Each training file (tests/training_files/) holds a fault written the way people write it; the doctor
measured and localised each of them before the search existed, and then said ``unexplained``. The cause
must now come from what an intervention, tried, repaired: ``found_by: intervention``, a verification that
names the intervention, and the localisation as evidence.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import ROOT, diagnose_ci, run_cli

FILES = ROOT / "tests" / "training_files"


def diagnose(name: str, *extra: str) -> dict:
    proc = diagnose_ci(FILES / name, *extra)
    assert proc.returncode == 1, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.report()


def search_stage(report: dict) -> dict:
    return next(s for s in report["stages"] if s["name"] == "intervention search")


def test_a_custom_functions_backward_overflow_is_named_by_keeping_its_module_in_fp32():
    report = diagnose("custom_rmsnorm_backward.py")
    top = report["findings"][0]
    assert (top["cause"], top["severity"], top["found_by"]) == ("backward-overflow", "error", "intervention")
    assert top["fix"]["config_patch"] == {"overrides": {"fp32_modules": ["norm"]}}
    assert top["verification"]["repaired"] and top["verification"]["tried"] == "keeping 'norm' (RMSNorm) in fp32"
    assert (
        top["evidence"]["localisation"]["phase"] == "backward" and top["evidence"]["localisation"]["module"] == "norm"
    )
    assert "custom_fwd" in top["fix"]["summary"] and "RMSNormFunction" in top["fix"]["summary"]
    assert "unexplained" not in [f["cause"] for f in report["findings"]]
    assert all(s["explained_by"] for s in report["symptoms"])


def test_a_custom_backward_overflowing_at_every_scale_is_localised_past_the_calibration_skip():
    """Every step skipped: step 0's skip at the default 2^16 is the output layer's bias gradient (calibration),
    and localising it kept that Linear in fp32 and never named the custom Function (user check). The last
    skipped step, at the lowest scale, holds the fault that no scale removes: the Mish's hand-written backward."""
    report = diagnose("mish_backward_every_scale.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("backward-overflow", "intervention")
    assert top["evidence"]["localisation"]["module"] in ("1", "3") and top["evidence"]["localisation"]["step"] > 0
    kept = top["fix"]["config_patch"]["overrides"]["fp32_modules"]
    assert kept and set(kept) <= {"1", "3"}  # the Mish modules only, not the output Linear '4'
    assert "MishFunction" in top["fix"]["summary"] and "custom_fwd" in top["fix"]["summary"]
    assert top["verification"]["repaired"]


def test_a_repeated_block_is_kept_in_fp32_as_a_class_when_one_block_alone_moves_the_overflow_on():
    report = diagnose("repeated_block_overflow.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("activation-overflow", "intervention")
    assert top["fix"]["config_patch"]["overrides"]["fp32_modules"] == [f"blocks.{i}" for i in range(5)]
    trials = search_stage(report)["details"]["trials"]
    assert trials[0]["intervention"] == "keeping 'blocks.3' (Block) in fp32" and not trials[0]["repaired"]
    assert (
        "still fails" in trials[0]["screen"] and "blocks.4" in trials[0]["screen"]
    )  # the fault moved to the next block
    assert trials[-1]["repaired"] and len(trials) <= 3  # --ci tries at most three interventions


def test_a_deep_stacks_last_blocks_are_kept_in_fp32_not_every_block_when_the_overflow_moves_on_steps_later():
    """The last block's overflow at step 0 held in fp32, the one before it overflows steps later: that pair repairs,
    found by tracing the later step (the search kept all six blocks, where the user's measurement needed two)."""
    report = diagnose("squared_relu_deep_stack.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("activation-overflow", "intervention")
    assert top["fix"]["config_patch"]["overrides"]["fp32_modules"] == ["blocks.5", "blocks.4"]
    trials = search_stage(report)["details"]["trials"]
    assert trials[0]["screen"] == "the failing step stays finite" and not trials[0]["repaired"]
    assert top["verification"]["repaired"]


def test_an_overflowing_library_module_is_kept_in_fp32_where_it_sits_in_each_block():
    """Every layer's FFN `wo` (an nn.Linear) overflows: the set the search keeps is every FFN's wo, not every
    Linear of the model (user trial: 5 Linears, and a fix that told the user to edit nn.Linear)."""
    report = diagnose("t5_ffn_wo_overflow.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("activation-overflow", "intervention"), [
        (f["cause"], f["title"]) for f in report["findings"]
    ]
    assert top["fix"]["config_patch"]["overrides"]["fp32_modules"] == ["layers.0.ffn.wo", "layers.1.ffn.wo"]
    assert "every FFN's wo" in top["title"] or "every FFN's wo" in top["evidence"]["intervention"]
    assert "class Linear" not in top["fix"]["code"] and top["verification"]["repaired"]


def test_a_log_of_a_half_precision_sigmoid_is_loss_in_half_although_the_log_ran_in_fp32():
    report = diagnose("sigmoid_log_loss.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("loss-in-half", "intervention")
    assert top["evidence"]["localisation"]["output"].endswith("(float32)")  # the op itself ran in fp32
    assert top["fix"]["config_patch"] == {"overrides": {"loss_in_fp32": True}}
    assert "logsigmoid" in top["fix"]["summary"] and "binary_cross_entropy_with_logits" in top["fix"]["summary"]


def test_a_repair_no_rule_names_is_reported_with_what_repaired_it():
    """An FFT refusing half-precision input: keeping its module in fp32 repairs it, and no cause code claims that."""
    report = diagnose("spectral_mixing_fft.py")
    top = report["findings"][0]
    assert top["found_by"] == "intervention" and top["severity"] == "error"
    assert top["fix"]["config_patch"] == {"overrides": {"fp32_modules": ["mix"]}} and top["verification"]["repaired"]
    assert "RuntimeError" in top["title"] and "repairs the training" in top["title"]


def test_a_config_that_keeps_a_module_in_fp32_keeps_it_in_every_fix_tried_and_in_the_corrected_patch(tmp_path):
    """The user keeps ``project`` in fp32; the repair adds ``mix``. The corrected config's patch carries both, so a
    tool that merges it into the user's config by "a list replaces a list" keeps ``project``."""
    config = tmp_path / "user.yaml"
    config.write_text("overrides:\n  fp32_modules: [project]\n")
    proc = diagnose_ci(FILES / "spectral_mixing_fft.py", "--config", str(config))
    report = proc.report()
    assert proc.returncode == 1, proc.stderr[-2000:]
    top = report["findings"][0]
    assert top["fix"]["config_patch"] == {"overrides": {"fp32_modules": ["mix"]}} and top["verification"]["repaired"]
    assert report["corrected"]["config_patch"] == {"overrides": {"fp32_modules": ["project", "mix"]}}
    assert yaml.safe_load(proc.fix_config)["overrides"]["fp32_modules"] == ["project", "mix"]


def test_the_corrected_config_of_an_intervention_repair_is_healthy_when_diagnosed_again(tmp_path):
    first = diagnose_ci(FILES / "custom_rmsnorm_backward.py")
    assert first.returncode == 1 and first.fix_config is not None, first.stderr[-2000:]
    assert yaml.safe_load(first.fix_config)["overrides"]["fp32_modules"] == ["norm"]
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(first.fix_config)
    proc = run_cli("diagnose", FILES / "custom_rmsnorm_backward.py", "--ci", "--json", "--config", fixed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["verdict"] == "healthy"


@pytest.mark.parametrize("name", ["mlp.py", "loss_in_half.py"])
def test_no_search_runs_where_every_symptom_is_explained(name):
    report = diagnose_ci(ROOT / "sample_models" / name).report()
    assert search_stage(report)["status"] == "skipped"
    assert all(f["found_by"] == "rule" for f in report["findings"])


def test_the_modules_in_a_library_modules_place_are_found_through_containers():
    from fp16doctor.diagnosis.rules._helpers import class_members, role_members

    types = {
        "": "Net",
        "blocks": "ModuleList",
        "blocks.0": "Block",
        "blocks.1": "Block",
        "blocks.0.mlp": "Sequential",
        "blocks.1.mlp": "Sequential",
        "blocks.0.mlp.2": "Linear",
        "blocks.1.mlp.2": "Linear",
        "head": "Sequential",
        "head.2": "Linear",
        "blocks.0.attn": "Attn",
        "blocks.1.attn": "Attn",
        "blocks.0.attn.wo": "Linear",
        "blocks.1.attn.wo": "Linear",
    }
    role = role_members("blocks.0.mlp.2", types)  # through the Sequential: in its place in every Block
    assert (
        role is not None
        and role.members == ["blocks.0.mlp.2", "blocks.1.mlp.2"]
        and (role.owner, role.place) == ("Block", "mlp.2")
    )
    assert role.description() == "every Block's mlp.2 (blocks.0.mlp.2, blocks.1.mlp.2)"
    wo = role_members("blocks.1.attn.wo", types)
    assert wo is not None and wo.members == ["blocks.0.attn.wo", "blocks.1.attn.wo"] and wo.owner == "Attn"
    assert role_members("head.2", types) is None  # its owner is the model itself: nothing else holds that place
    assert class_members("blocks.0.attn", types) == ["blocks.0.attn", "blocks.1.attn"]
    assert len(class_members("blocks.0.mlp.2", types)) == 5  # every Linear: the wider candidate, tried after
