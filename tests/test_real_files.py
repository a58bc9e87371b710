"""Training files written the way people write them, run through the CLI in a fresh process each.

The first release passed every test in one warm process while most real files crashed the
CLI: modules a user's code imports lazily (torch._dynamo, transformers) broke when the loader
scoped them. These tests run `fp16doctor` as a subprocess, exactly as a user does.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import ROOT, diagnose_ci, run_cli

SPREAD_OVER_WORKERS = True
"""Independent fresh-process diagnoses: the workers share them out (see conftest.py)."""

FILES = ROOT / "tests" / "training_files"
HEALTHY = [
    "own_optimizer.py",
    "hf_bert.py",
    "hf_checkpointing.py",
    "compiled.py",
    "dataloader_workers.py",
    "uses_sibling.py",
    "grad_accumulation.py",
    "returns_item.py",
    "sparse_embeddings.py",
    "hf_batch_encoding.py",
    "plateau_scheduler.py",
    "scripted_activation.py",
    "gradient_penalty.py",
]


def diagnose_json(name: str, *extra: str, env: dict | None = None) -> tuple[int, dict, str]:
    proc = diagnose_ci(FILES / name, *extra, env=env)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.returncode, proc.report(), proc.stderr


@pytest.mark.parametrize("name", HEALTHY)
def test_realistic_healthy_file_is_diagnosed_healthy(name):
    code, report, _ = diagnose_json(name)
    errors = [(f["cause"], f["title"]) for f in report["findings"] if f["severity"] == "error"]
    assert code == 0 and report["verdict"] == "healthy", errors
    assert report["symptoms"] == []
    assert {s["name"]: s["status"] for s in report["stages"]}["fp32 baseline"] == "ran"


def test_spawned_dataloader_workers_import_the_files_dataset_class():
    code, report, stderr = diagnose_json("dataloader_workers.py", env={"DATALOADER_START": "spawn"})
    assert code == 0 and report["verdict"] == "healthy", stderr[-2000:]


def test_a_compiled_model_is_probed_eager_and_compiled_and_the_user_is_told():
    code, report, stderr = diagnose_json("compiled.py")
    assert code == 0 and any("torch.compile" in note for note in report["notes"])
    assert "runs compiled too" in " ".join(stderr.split())  # on stderr, so --json stays one object on stdout


def test_static_hand_rolled_loss_scaling_is_never_healthy():
    """AMP NaN from the second step with a finite FP32 baseline: a symptom, explained by scale-overflow."""
    code, report, _ = diagnose_json("static_loss_scale.py")
    assert code == 1 and report["verdict"] == "unhealthy"
    top = report["findings"][0]
    assert top["cause"] == "scale-overflow" and top["evidence"]["scaler_called"] is False
    assert "GradScaler" in top["fix"]["summary"]
    nonfinite = next(s for s in report["symptoms"] if s["symptom"] == "nonfinite")
    assert nonfinite["explained_by"] == ["scale-overflow"] and nonfinite["measured"]["first_nonfinite_step"] <= 1


def compare_json(name: str, *extra: str) -> dict:
    proc = run_cli("compare", FILES / name, "--json", *extra)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_accumulation_micro_steps_are_not_skips_in_compare():
    report = compare_json("grad_accumulation.py", "--steps", "12")
    assert report["skipped_steps"] == {"fp32": 0, "amp": 0} and report["verdict_by_mode"]["amp"] != "unstable"
    assert report["symptoms"]["amp"] == []


def test_accumulation_micro_steps_are_not_skips_in_train(tmp_path):
    proc = run_cli(
        "train", FILES / "grad_accumulation.py", "--steps", "8", "--run-dir", tmp_path / "run", "--device", "cpu"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert metrics["micro_step"].tolist() == [True, True, True, False] * 2  # the optimizer steps every 4th micro-batch
    assert not metrics["skipped"].any()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped"] == 0


def test_checkpointed_recompute_sees_the_same_precision_policy_as_the_forward():
    """Activation checkpointing recomputes the forward in backward: same autocast policy and same FP32 guards,
    so every loss and gradient norm equals the uncheckpointed model's, in fp32 and in AMP."""
    plain = compare_json("hf_bert.py", "--steps", "4")
    checkpointed = compare_json("hf_checkpointing.py", "--steps", "4")
    for mode in ("fp32", "amp"):
        for a, b in zip(plain["steps"], checkpointed["steps"]):
            assert a[mode]["loss"] == pytest.approx(b[mode]["loss"], rel=1e-5)
            assert a[mode]["grad_norm"] == pytest.approx(b[mode]["grad_norm"], rel=1e-4)
    assert checkpointed["verdict"] == "healthy"


def test_own_optimizer_and_scheduler_through_compare_and_train(tmp_path):
    assert compare_json("own_optimizer.py", "--steps", "8")["verdict"] == "healthy"
    proc = run_cli(
        "train", FILES / "own_optimizer.py", "--steps", "6", "--run-dir", tmp_path / "run", "--device", "cpu"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lrs = pd.read_csv(tmp_path / "run" / "metrics.csv")["lr"].tolist()
    assert (
        lrs[0] < lrs[1] < lrs[2] < lrs[3] and lrs[4] == pytest.approx(0.05) and lrs[5] < lrs[4]
    )  # warm-up, then cosine


def test_a_fault_whose_run_does_not_replay_the_same_is_reported_non_deterministic():
    """The replay reaches the fault at the same step, but its losses on the way differ from the AMP run's
    (the model draws from a generator no seed resets): the localisation says it is not deterministic."""
    code, report, _ = diagnose_json("unseeded_noise_overflow.py")
    assert code == 1
    localisation = next(s for s in report["stages"] if s["name"] == "localisation")
    assert localisation["details"]["amp"]["step"] == 3 and localisation["details"]["amp"]["module"] == "inp"
    assert localisation["details"]["deterministic"] is False and "non-deterministic" in localisation["summary"]


def test_recurring_gradient_overflow_gets_the_scale_its_gradients_call_for():
    """The sweep's recommendation is the scale the FP32 gradients call for (the window's), not the lowest one
    a short run happens to put a little closer to FP32; and the overflowing backward op is blamed on the
    module that owns it (a Linear of the model: the head at step 0's calibration skip, attn.qkv at the skip after
    the scale settled, which the localisation traces), not on the model that merely returns the head's output."""
    code, report, _ = diagnose_json("unscaled_attention.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "scale-overflow" and top["verification"]["repaired"] is True
    sweep = next(s for s in report["stages"] if s["name"] == "loss-scale sweep")
    derived = sweep["details"]["window_recommended"]
    row = next(r for r in sweep["details"]["sweep"] if r["init_scale"] == derived)
    assert row["skip_rate"] == 0 and row["verdict"] != "diverged"  # the derived scale works: it is the one to give
    assert sweep["details"]["recommended"]["init_scale"] == derived, sweep["summary"]
    localisation = next(s for s in report["stages"] if s["name"] == "localisation")["details"]["amp"]
    assert localisation["module"] in ("head", "attn.qkv", "attn.proj") and localisation["phase"] == "backward"
    assert localisation["step"] > 0  # past the calibration skips: a skip after an applied step


def test_a_block_kept_in_fp32_with_cuda_autocast_stays_fp32_in_a_cpu_probe():
    """`autocast("cuda", enabled=False)` around a block whose values pass 65504: healthy, as on a GPU; the
    scale's 3 settling skips are calibration, and their lag is no drift."""
    code, report, _ = diagnose_json("gpu_style_fp32_block.py")
    assert code == 0 and report["verdict"] == "healthy", report["findings"]
    amp = next(s for s in report["stages"] if s["name"] == "amp as configured")
    assert amp["details"]["first_nonfinite_loss"] is None and 0 < len(amp["details"]["skipped_steps"]) <= 3


def test_nan_from_a_fully_masked_attention_row_is_localised_in_fp32():
    """The -inf of a padding mask is legitimate until a softmax over a row of nothing but -inf makes NaN:
    the localisation names that softmax (before, every op with an infinite input was passed over, and the
    replay 'stayed finite')."""
    code, report, _ = diagnose_json("fully_masked_rows.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "fp32-divergence"
    assert (top["evidence"]["module"], top["evidence"]["operator"], top["evidence"]["step"]) == (
        "mha",
        "aten::_softmax",
        2,
    )
    assert "every key masked" in top["fix"]["summary"]


def test_a_forward_overflow_after_skips_is_localised_where_the_loss_turns_nan():
    """Skipped steps come first (the scaler at work); the localisation goes to the step whose loss is NaN,
    where the attention scores overflow, and the fix keeps the attention in fp32, verified."""
    code, report, _ = diagnose_json("huge_attention_logits.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and top["evidence"]["module"] == "attn"
    assert top["evidence"]["overflowing_value"] > 65504 and top["verification"]["repaired"] is True
    nonfinite = next(s for s in report["symptoms"] if s["symptom"] == "nonfinite")
    assert top["evidence"]["step"] == nonfinite["measured"]["first_nonfinite_step"]


def test_a_loop_without_scaler_update_is_scaler_misuse():
    code, report, _ = diagnose_json("scaler_without_update.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "scaler-misuse" and any("without update()" in p for p in top["evidence"]["problems"])


def test_a_float32_min_mask_cast_to_fp16_is_a_constant_out_of_range():
    """The culprit op multiplies a [0, 1] mask by the Python number finfo(float32).min: the constant is the
    evidence (recorded from the op's arguments), not an activation that grew."""
    code, report, _ = diagnose_json("finfo_min_mask.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "constant-out-of-range", [(f["cause"], f["title"]) for f in report["findings"]]
    assert top["evidence"]["constant"] == -3.4028234663852886e38 and top["evidence"]["module"] == "attn"
    assert top["verification"]["repaired"] is True


def test_a_constant_in_every_block_is_named_and_fixed_in_every_block():
    """The same additive finfo(float32).min mask in each of two blocks: keeping the localised block in fp32 alone
    left the next one failing, the rule's fix was demoted and the search's repair was named activation-overflow
    (user trial). The rule's fix now keeps every module of the class, and it repairs."""
    code, report, _ = diagnose_json("finfo_min_mask_stacked.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "constant-out-of-range", [(f["cause"], f["title"]) for f in report["findings"]]
    assert top["severity"] == "error" and top["verification"]["repaired"] is True
    assert top["evidence"]["module"] == "blocks.0.attn" and top["evidence"]["same_code_in"] == [
        "blocks.0.attn",
        "blocks.1.attn",
    ]
    assert top["fix"]["config_patch"] == {"overrides": {"fp32_modules": ["blocks.0.attn", "blocks.1.attn"]}}
    assert "activation-overflow" not in [f["cause"] for f in report["findings"]]


def test_a_scheduler_that_follows_the_loss_is_given_the_loss(tmp_path):
    """ReduceLROnPlateau.step(metrics) crashed every probe (an internal error); now each step's loss is passed,
    and the learning rate of the run drops when the loss stops improving."""
    proc = run_cli("train", FILES / "plateau_scheduler.py", "--run-dir", tmp_path / "run", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lrs = pd.read_csv(tmp_path / "run" / "metrics.csv")["lr"]
    assert lrs.iloc[0] == pytest.approx(1e-3) and lrs.min() < lrs.iloc[0]
    _, report, _ = diagnose_json("plateau_scheduler.py")
    stage = next(s for s in report["stages"] if s["name"] == "LR schedule peak")
    assert stage["status"] == "skipped" and "follows the loss" in stage["summary"]


def test_a_gradient_penalty_from_scaled_gradients_is_scaler_misuse_not_a_precision_gap():
    """Same weights, same batch: AMP's loss is 10^7 times FP32's, and equal to it with loss scaling off. The
    scale leaks into the loss; keeping modules in fp32 cannot help, and the diagnosis says what to change."""
    code, report, _ = diagnose_json("gradient_penalty_scaled.py")
    assert code == 1
    causes = [f["cause"] for f in report["findings"]]
    assert causes[0] == "scaler-misuse" and "precision-gap" not in causes, causes
    top = report["findings"][0]
    assert top["evidence"]["gap_without_loss_scaling"] < 1e-3 and "get_scale()" in top["fix"]["summary"]


def test_t5_feed_forward_overflow_is_found_past_its_deliberate_log_of_zero():
    """The first op to make an infinity is T5's log(0) in the position buckets, cast to integers right after:
    its infinity never reaches a module's output. The culprit is the wo projection whose output overflows."""
    code, report, _ = diagnose_json("t5_bf16_pretrained.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow"
    assert (
        top["evidence"]["module"] == "encoder.block.1.layer.1.DenseReluDense.wo"
        and top["verification"]["repaired"] is True
    )


def test_an_exp_that_grows_past_1e8_is_an_activation_overflow_not_a_constant():
    """A hand-written softmax (exp of cosine scores over a temperature, times a causal mask, normalised at the
    end) reaches 4.9e8: large enough to pass for a mask's constant by its size, but made of many distinct values.
    It was named constant-out-of-range, with a masked_fill fix for code that has no constant."""
    code, report, _ = diagnose_json("hand_softmax_attention.py")
    assert code == 1
    causes = [f["cause"] for f in report["findings"]]
    assert causes[0] == "activation-overflow" and "constant-out-of-range" not in causes, causes
    top = report["findings"][0]
    assert top["verification"]["repaired"] is True
    assert set(top["fix"]["config_patch"]["overrides"]["fp32_modules"]) == {"blocks.0.attn", "blocks.1.attn"}


def test_a_head_bias_fp16_cannot_hold_is_kept_in_fp32_alone_with_the_scale_its_gradients_need():
    """A regression head whose bias starts at the median price (1.6e5): autocast's cast of that parameter
    overflows. Keeping the head alone in fp32 leaves GradScaler halving from 65536 for many steps; the fix is
    completed with the sweep's scale and measured, instead of keeping every Linear (the whole model) in fp32."""
    code, report, _ = diagnose_json("raw_price_head_bias.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and top["verification"]["repaired"] is True
    patch = top["fix"]["config_patch"]
    assert patch["overrides"]["fp32_modules"] == ["head"]
    assert patch["scaler"]["init_scale"] < 65536 and "initial loss scale" in top["fix"]["summary"]
    localisation = next(s for s in report["stages"] if s["name"] == "localisation")
    assert "parameter 'head.bias'" in localisation["summary"]


def test_a_low_temperature_contrastive_loss_is_computed_outside_autocast_and_rescaled():
    """NT-Xent over unnormalised embeddings divided by 0.01 overflows in the loss; computed in fp32, the loss
    (about 9000) still needs a scale of a few units, not 65536: the verified fix carries both."""
    code, report, _ = diagnose_json("infonce_low_temperature.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "loss-in-half" and top["verification"]["repaired"] is True
    assert top["fix"]["config_patch"]["overrides"]["loss_in_fp32"] is True
    assert top["fix"]["config_patch"]["scaler"]["init_scale"] < 65536
    assert "enabled=False" in top["fix"]["code"]  # casting the outputs up is not enough while autocast is on


def test_a_vae_with_sigmoid_and_binary_cross_entropy_is_told_to_use_the_logits():
    code, report, _ = diagnose_json("vae_bce.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "loss-in-half" and top["verification"]["repaired"] is True
    assert "binary_cross_entropy_with_logits" in top["fix"]["code"] and "sigmoid" in top["fix"]["summary"]


def test_a_focal_loss_on_fp16_probabilities_breaks_in_the_losss_backward_and_is_loss_in_half():
    """softmax(dtype=float32).to(logits.dtype): a noisy label's p_t rounds to fp16's smallest subnormal and the
    backward of log(p_t) divides by it, outside the model; every step skips. The loss is named (not a 0.15% precision
    gap whose fp32 head happened to compute the loss in fp32), and computing it in fp32 repairs the training."""
    code, report, _ = diagnose_json("focal_loss_fp16_probs.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "loss-in-half" and top["verification"]["repaired"] is True, top["title"]
    assert top["evidence"]["phase"] == "backward" and "in its backward" in top["title"]
    assert "precision-gap" not in [f["cause"] for f in report["findings"] if f["severity"] == "error"]


def test_a_masked_mean_written_as_bmm_overflows_in_the_models_own_code_and_the_fix_weights_before_summing():
    """bmm(mask, h) / lengths: a sum over 2048 tokens fp16 cannot hold, in the model's own forward. The culprit is
    the product, one of whose measured operands is all ones; the fix weights the mask first, not a generic cast."""
    code, report, _ = diagnose_json("meanpool_bmm.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and top["evidence"]["operator"] == "aten::bmm", top["title"]
    assert top["evidence"]["module"] == "<root>" and top["evidence"]["overflowing_value"] > 65504
    assert "mask / mask.sum(1, keepdim=True)" in top["fix"]["code"] and "sums many values" in top["fix"]["summary"]


@pytest.mark.parametrize(
    "operator, ranges, summing",
    [
        ("aten::bmm", [(1.0, 1.0), (-163.0, 186.0)], True),  # bmm(mask, h): all ones
        ("aten::addmm", [(0.0, 0.0), (-163.0, 186.0), (-3.0, 3.0)], False),  # F.linear's zero bias is added, no factor
        ("aten::addmm", [(-1.0, 1.0), (0.0, 1.0), (-3.0, 3.0)], True),
        ("aten::mm", [(0.0, 0.0), (-3.0, 3.0)], False),  # an all-zero factor sums nothing
        ("aten::mul", [(0.0, 1.0), (-3.0, 3.0)], False),  # no product over a dimension
    ],
)
def test_only_a_matrix_products_factor_in_0_1_makes_it_a_sum(operator, ranges, summing):
    from fp16doctor.diagnosis import rule_cases as fx
    from fp16doctor.diagnosis.rules.activation_overflow import sums_by_product

    assert sums_by_product(fx.localisation("forward", "<root>", operator, ranges)) is summing


def test_a_gap_no_small_module_set_closes_is_left_to_the_search_which_keeps_the_whole_class():
    """A hand-written LayerNorm squares a residual stream of a few hundred: (d * d) passes 65504 in every norm and
    the output collapses. No small set closes the 45% gap, so the finding proposes nothing and explains nothing:
    the search runs and keeps every module of the class in fp32, verified (it used to stop at 'try bf16')."""
    code, report, _ = diagnose_json("hand_layernorm_square.py")
    assert code == 1
    top = report["findings"][0]
    assert top["found_by"] == "intervention" and top["verification"]["repaired"] is True, top["title"]
    assert sorted(top["fix"]["config_patch"]["overrides"]["fp32_modules"]) == [
        "blocks.0.norm",
        "blocks.1.norm",
        "blocks.2.norm",
        "norm",
    ]
    assert {s["name"]: s["status"] for s in report["stages"]}["intervention search"] == "ran"
    # the gap is range, hidden: the norm's square passed 65504 and d / sqrt(inf) = 0 made the output finite
    assert "aten::mul" in top["title"] and "overflow no module output shows" in top["title"]


def test_a_linear_attention_normaliser_that_overflows_silently_is_named_with_its_operator():
    """fast-transformers' linear attention at 2048 tokens: the normaliser's einsum passes 65504 and 1 / inf = 0
    hides it, so the run stays finite and only a 1.6% gap shows. The attention blocks in fp32 close it, and the
    finding names the operator that overflowed instead of calling it rounding."""
    code, report, _ = diagnose_json("linear_attention_normaliser.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "precision-gap" and "overflow no module output shows" in top["title"], top["title"]
    absorbed = top["evidence"]["absorbed_overflow"]
    assert (
        absorbed["module"].startswith("blocks.") and absorbed["module"].endswith(".attn") and absorbed["peak"] > 65504
    )


def test_a_one_pass_variance_that_cancels_below_zero_is_precision_not_overflow():
    """A hand-written GroupNorm computes E[x^2] - E[x]^2 on raw intensities (~100): fp16 rounds both terms and the
    variance goes negative under a square root. Nothing passes 65504: keeping the norm in fp32 repairs it, and it
    is named precision-gap (rounding), not activation-overflow."""
    code, report, _ = diagnose_json("groupnorm_onepass.py")
    assert code == 1
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("precision-gap", "intervention"), top["title"]
    assert top["verification"]["repaired"] is True and top["evidence"]["localisation"]["operator"] == "aten::sqrt"
    assert "activation-overflow" not in [f["cause"] for f in report["findings"]]


def test_a_divisor_whose_squares_flushed_is_made_from_fp32_values_not_cast_up_afterwards():
    """f / sqrt((f * f).sum()) on dark pixels: f * f flushes to 0 in fp16 where f does not, so x / 0 = inf. Casting
    the finished divisor up (or adding an epsilon to it) would divide by the epsilon; the fix casts the input up
    before the squares (a user trial applied the old snippet literally and the loss overflowed)."""
    code, report, _ = diagnose_json("dense_cosine_lowlight.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "divisor-underflow" and top["evidence"]["module"] == "<root>", top["title"]
    assert "x32 = x.float()" in top["fix"]["code"] and "d.float() + eps" not in top["fix"]["code"]
    assert "before the squares" in top["fix"]["summary"]


def test_an_arcface_clamp_fp16_rounds_to_one_is_a_divisor_reaching_zero_in_backward():
    """clamp(cos, -1 + 1e-7, 1 - 1e-7) is 1.0 in fp16, and acos's backward divides by sqrt(1 - cos^2) = 0."""
    code, report, _ = diagnose_json("arcface_imprint.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "divisor-underflow" and top["verification"]["repaired"] is True, top["title"]
    assert "backward of module 'head'" in top["title"] and "AcosBackward0" in top["title"]
    assert top["fix"]["config_patch"]["overrides"]["fp32_modules"] == ["head"]
    assert "aligned on the steps taken" in top["verification"]["summary"]  # not the lag of the settling skips


def test_an_overflow_in_the_models_own_forward_code_is_fixed_there_not_by_a_patch_naming_the_root():
    """The model un-normalises its output (z * 8e4 + 2.4e5) in its own forward, outside every submodule: no
    module can be kept in fp32 short of the whole model, so the fix is that arithmetic in fp32. The target (3.2e5)
    never enters the model: no extreme-data."""
    code, report, stderr = diagnose_json("denorm_output.py")
    assert code == 1, stderr[-2000:]
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and "own forward code" in top["title"]
    assert "<root>" not in json.dumps(top["fix"]["config_patch"]) and ".float()" in top["fix"]["code"]
    assert "extreme-data" not in [f["cause"] for f in report["findings"]]


def test_an_exception_under_amp_is_no_skipped_step_for_the_scheduler():
    """A region with autocast disabled fed an fp16 activation raises at step 0: the probe ended there, nothing was
    skipped and the scheduler never stepped."""
    code, report, _ = diagnose_json("fp32_head_region.py")
    assert code == 1
    causes = [f["cause"] for f in report["findings"]]
    assert "scheduler-skip-drift" not in causes, causes
    top = report["findings"][0]
    assert top["verification"]["repaired"] is True and "dtype mismatch" in top["fix"]["summary"]


def test_a_clamp_floor_fp16_cannot_hold_under_a_log_is_named_as_the_constant():
    """10 * log10(clamp(power, min=1e-10)) on silent frames: the bound is 0 in fp16, so log10(0) = -inf. The tracer
    saw the clamp given 1e-10 make the log's input: the cause names the constant and its line, not a divisor."""
    code, report, _ = diagnose_json("log_floor_db.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "constant-out-of-range", top["title"]
    evidence = top["evidence"]
    assert evidence["constant"] == 1e-10 and evidence["constant_in_dtype"] == 0.0 and evidence["dtype"] == "float16"
    assert evidence["made_by"] == "aten::clamp" and evidence["operator"] == "aten::log10"
    assert evidence["location"].endswith("log_floor_db.py:36")
    assert "1e-10" in top["title"] and "divisor-underflow" not in [f["cause"] for f in report["findings"]]
    assert top["verification"]["repaired"] is True
