"""``serve-check``: the trained model served in half precision against FP32, on models whose fp16 serving breaks
in different ways (logits past 65504, an input normalisation that overflows, a regression head at a large scale),
each of which must get a keep-set that repairs it, and a healthy model that must be called safe. In process through
the API, and once as a user runs it, in a fresh CLI process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, SAMPLES, run_cli
from typer.testing import CliRunner

import fp16doctor
from fp16doctor.cli import app

SERVING = ROOT / "tests" / "serving"


@pytest.mark.parametrize(
    "name, kept, past_range",
    [
        ("logits_past_fp16.py", ["head"], "head"),  # logits past 65504 from an fp32-trained head
        ("kelvin_input_norm.py", ["norm"], None),  # 300 * 300 inside the norm: no output past the range in fp32
        ("price_head.py", ["head"], "head"),  # prices of 2e5 scaled by an fp16 buffer
    ],
)
def test_a_model_whose_fp16_serving_breaks_gets_the_keep_set_that_repairs_it(name, kept, past_range):
    result = fp16doctor.serve_check(SERVING / name)
    assert not result.safe and not result.modes["fp16"].finite
    assert result.modes["fp16-autocast"].within(result.tolerance)  # as trained, with AMP: fine
    assert result.keep is not None and result.keep.verified and result.keep.modules == kept
    assert result.keep.rel_dev <= result.tolerance
    overflowing = list(result.overflowing["module"])
    assert (past_range in overflowing) if past_range else overflowing == []
    assert result.keep.first_nonfinite == kept[0]
    assert result.keep.why == {kept[0]: "its fp16 output is inf or NaN from finite inputs"}
    report = result.to_json()
    assert report["verdict"] == "unsafe" and report["keep_fp32"]["modules"] == kept
    json.dumps(report, allow_nan=False)  # JSON without NaN or inf


def test_a_norm_whose_overflow_stays_inside_it_is_kept_for_how_far_it_strays():
    """fp16's inf sum of squares makes the norm's output 0, finite: no module turns inf or NaN, and no FP32 output
    passes 65504; the norm is found by its deviation from FP32, and the keep-set says so."""
    result = fp16doctor.serve_check(SERVING / "rms_sum_of_squares.py")
    assert not result.safe and result.modes["fp16"].finite and list(result.overflowing["module"]) == []
    assert result.keep.verified and result.keep.modules == ["norm"] and result.keep.first_nonfinite is None
    assert result.keep.why["norm"].startswith("its fp16 output strays furthest from FP32's")
    shown = CliRunner().invoke(app, ["serve-check", str(SERVING / "rms_sum_of_squares.py")])
    said = " ".join(shown.output.split())
    assert shown.exit_code == 1 and "norm: kept because its fp16 output strays furthest" in said


def test_a_healthy_model_is_safe_to_serve_in_fp16_and_needs_no_keep_set():
    result = fp16doctor.serve_check(SAMPLES / "mlp.py")
    assert result.safe and result.keep is None
    assert all(mode.finite for mode in result.modes.values())
    assert result.to_json()["verdict"] == "safe"


def test_a_tolerance_only_fp32_meets_keeps_the_whole_model_and_says_so():
    result = fp16doctor.serve_check(SAMPLES / "mlp.py", tolerance=1e-7)  # fp16's own rounding is past it
    assert not result.safe and result.keep.verified and result.keep.whole_model
    shown = CliRunner().invoke(app, ["serve-check", str(SAMPLES / "mlp.py"), "--tolerance", "1e-7"])
    assert shown.exit_code == 1 and "Only the whole model in fp32 serves it" in " ".join(shown.output.split())
    held = fp16doctor.serve_check(SERVING / "logits_past_fp16.py").keep
    assert held.modules == ["head"] and not held.whole_model


def test_parameters_fp16_cannot_hold_are_named_with_their_counts(training_file):
    path = training_file(
        """
        import torch
        def model():
            net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            with torch.no_grad():
                net[0].weight[0, 0] = 1e5     # past 65504
                net[1].weight[0, :2] = 1e-9   # below fp16's smallest subnormal
            return net
        def data():
            return [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(2)]
        """
    )
    result = fp16doctor.serve_check(path, batches=2)
    rows = {row["name"]: row for row in result.cast_parameters.to_dict("records")}
    assert rows["0.weight"]["overflow"] == 1 and rows["1.weight"]["flushed"] == 2
    # module 0's fp32 outputs (about 1e5) cannot be handed to module 1 in fp16 either: both stay fp32
    assert result.keep is not None and result.keep.verified and result.keep.modules == ["0", "1"]


def test_serve_check_from_the_command_line_exits_1_with_the_keep_set_and_0_when_safe():
    proc = run_cli("serve-check", SERVING / "price_head.py", "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["verdict"] == "unsafe" and report["keep_fp32"]["modules"] == ["head"]
    assert report["overflowing_modules"][0]["module"] == "head" and report["overflowing_modules"][0]["max_abs"] > 65504
    shown = CliRunner().invoke(app, ["serve-check", str(SAMPLES / "mlp.py")], env={"COLUMNS": "160"})
    assert shown.exit_code == 0 and "safe in fp16" in shown.output


def test_a_checkpoint_of_another_model_is_bad_input(tmp_path):
    torch.save({"model": {"weight": torch.zeros(3)}}, tmp_path / "other.pt")
    shown = CliRunner().invoke(
        app, ["serve-check", str(SAMPLES / "mlp.py"), "--checkpoint", str(tmp_path / "other.pt")]
    )
    assert shown.exit_code == 2 and "does not hold this model's weights" in " ".join(shown.output.split())


@pytest.mark.parametrize("tolerance", ["-1", "nan", "0"])
def test_a_tolerance_that_is_not_a_share_above_0_is_bad_input_before_anything_runs(tolerance):
    shown = CliRunner().invoke(app, ["serve-check", str(SAMPLES / "mlp.py"), f"--tolerance={tolerance}"])
    assert shown.exit_code == 2 and "--tolerance must be a share above 0" in " ".join(shown.output.split())


def test_a_model_whose_own_forward_raises_is_bad_input_with_one_message(training_file):
    path = training_file(
        """
        import torch
        def model():
            return torch.nn.Linear(4, 2)
        def data():
            return [(torch.randn(8, 3), torch.randint(0, 2, (8,)))]  # 3 features for a model of 4
        """
    )
    shown = CliRunner().invoke(app, ["serve-check", str(path)])
    assert shown.exit_code == 2 and "FP32 forward raised RuntimeError" in " ".join(shown.output.split())


def test_a_mask_fill_past_65504_gets_the_dtype_s_own_minimum_as_its_fix(training_file):
    path = training_file(
        """
        import torch
        class Pool(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.score = torch.nn.Linear(8, 1)
            def forward(self, x, mask):
                s = self.score(x).squeeze(-1)
                s = torch.where(mask, s, torch.full_like(s, -1e9))  # past fp16's range
                return torch.softmax(s, -1)
        def model():
            return Pool()
        def data():
            return [(torch.randn(4, 6, 8), torch.rand(4, 6) > 0.3, torch.zeros(4, 6)) for _ in range(2)]
        def loss(model, batch):
            x, mask, y = batch
            return ((model(x, mask).float() - y) ** 2).mean()
        """
    )
    shown = CliRunner().invoke(app, ["serve-check", str(path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 1 and "torch.finfo(x.dtype).min" in shown.output, shown.output


def test_pytorch_still_says_a_number_past_65504_cannot_become_half():
    from fp16doctor.measure.serving import HALF_SCALAR_OVERFLOW

    with pytest.raises(RuntimeError, match=HALF_SCALAR_OVERFLOW):
        torch.full_like(torch.zeros(2, dtype=torch.float16), -1e9)
