"""Trainings with several optimizers, and optimizers the training makes itself, through the CLI in fresh processes.

The files under tests/training_files are written the way people write them: a GAN following PyTorch's AMP
recipe for several optimizers (healthy), PyTorch's DCGAN example on one GradScaler whose first discriminator step
the scaler's calibration skips (healthy), the same GAN with a stray plain step (scaler-misuse), a distillation
with a frozen fp16 teacher (healthy: the teacher is not the training's weights), a Lightning-style module that
builds its optimizer on the first step, a script whose optimizer lives in a module-level global, and an
accumulating step whose clip raises on a non-finite norm (scaler-misuse).
"""

from __future__ import annotations

import json

import pandas as pd
import torch
from conftest import ROOT, diagnose_ci, run_cli

FILES = ROOT / "tests" / "training_files"


def diagnose(name: str, *extra: str) -> tuple[int, dict]:
    proc = diagnose_ci(FILES / name, *extra)
    assert proc.returncode in (0, 1), f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.returncode, proc.report()


def amp_stage(report: dict) -> dict:
    return next(s for s in report["stages"] if s["name"] == "amp as configured")


def test_gan_following_the_several_optimizer_recipe_is_healthy_and_counts_skips_per_optimizer():
    code, report = diagnose("gan_two_optimizers.py")
    assert code == 0 and report["verdict"] == "healthy", [(f["cause"], f["title"]) for f in report["findings"]]
    assert "scaler-misuse" not in {f["cause"] for f in report["findings"]}
    skips = amp_stage(report)["details"]["skipped_by_optimizer"]
    assert set(skips) == {"optimizers[0]", "optimizers[1]"}
    # The scaler starts at 2^24: both optimizers see skipped steps while the scale settles, each counted on its own.
    assert all(count > 0 for count in skips.values())
    assert sum(skips.values()) >= len(amp_stage(report)["details"]["skipped_steps"])


def test_dcgan_with_one_scaler_is_healthy_though_calibration_skips_its_first_discriminator_step():
    """PyTorch's DCGAN loop with its optimizers made in the file, on one GradScaler. At the default scale the first
    discriminator step overflows and is skipped, so the generator's loss of that iteration is computed against
    another discriminator than FP32's: the same-state comparison is taken at the scale calibration lowers to, and
    the skip is not read as the loss scale leaking into the loss."""
    code, report = diagnose("dcgan_one_scaler.py")
    details = amp_stage(report)["details"]
    assert details["skipped_steps"] == [0] and sum(details["skipped_by_optimizer"].values()) == 1
    assert "scaler-misuse" not in {f["cause"] for f in report["findings"]}
    assert code == 0 and report["verdict"] == "healthy", [(f["cause"], f["title"]) for f in report["findings"]]
    gap = next(s for s in report["stages"] if s["name"] == "precision-gap search")["details"]
    assert gap["gap"] <= gap["tolerance"] and "scale_leak" not in gap


def test_gan_with_a_plain_step_besides_scaler_step_is_scaler_misuse_with_the_call_sequence():
    code, report = diagnose("gan_double_step.py")
    assert code == 1 and report["verdict"] == "unhealthy"
    top = report["findings"][0]
    assert top["cause"] == "scaler-misuse" and top["severity"] == "error"
    assert top["evidence"]["double_stepped"] == ["optimizers[1]"]
    sequence = top["evidence"]["scaler_calls_per_iteration"][0]
    assert sequence.index("step(optimizers[1])") < sequence.index("optimizers[1].step()") < sequence.index("update")
    assert "nonfinite" in top["evidence"]["symptoms"]  # the plain step applied the inf gradients the scaler skipped


def test_distillation_with_a_frozen_fp16_teacher_is_healthy_and_not_half_weights():
    code, report = diagnose("distill_fp16_teacher.py")
    assert code == 0 and report["verdict"] == "healthy", [(f["cause"], f["title"]) for f in report["findings"]]
    assert not {"half-weights", "half-batchnorm", "half-optimizer-state"} & {f["cause"] for f in report["findings"]}


def test_an_optimizer_made_on_the_first_step_is_found_and_counted():
    code, report = diagnose("optimizer_on_first_use.py")
    assert code == 0 and report["verdict"] == "healthy", [(f["cause"], f["title"]) for f in report["findings"]]
    assert "found: AdamW" in amp_stage(report)["details"]["skipped_by_optimizer"]
    # The optimizer it made really trains: an untrained 4-class classifier stays near ln 4 = 1.39.
    assert amp_stage(report)["details"]["final_loss"] < 1.1


def test_an_optimizer_kept_from_an_earlier_probe_is_refused_as_bad_input():
    proc = run_cli("diagnose", FILES / "module_global_optimizer.py", "--ci")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = " ".join(proc.stderr.split())
    assert "not this probe's model's" in message and "module-level global" in message
    assert "module_global_optimizer.py:34" in message  # the line that stepped it: scaler.step(OPTIMIZER)
    assert "Traceback" not in proc.stderr


def test_several_optimizers_without_train_step_is_bad_input(training_file):
    path = training_file("""
        import torch
        from torch import nn

        def model():
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

        def data():
            g = torch.Generator().manual_seed(0)
            return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(4)]

        def optimizers(model):
            return {"body": torch.optim.SGD(model[0].parameters(), lr=0.1), "head": torch.optim.Adam(model[2].parameters())}
    """)
    proc = run_cli("diagnose", path, "--ci")
    assert proc.returncode == 2
    message = " ".join(proc.stderr.split())
    assert "several optimizers" in message and "train_step" in message


def test_train_and_compare_run_a_training_with_optimizers_of_its_own(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train",
        FILES / "gan_two_optimizers.py",
        "--steps",
        "12",
        "--checkpoint-every",
        "6",
        "--run-dir",
        run_dir,
        "--device",
        "cpu",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = pd.read_csv(run_dir / "metrics.csv")
    assert len(metrics) == 12 and metrics["lr"].iloc[-1] == metrics["lr"].iloc[0] / 2  # both StepLR schedules stepped
    checkpoint = torch.load(sorted((run_dir / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert set(checkpoint["optimizers"]) == {"optimizers[0]", "optimizers[1]"}
    assert all(state["state"] for state in checkpoint["optimizers"].values())  # both Adam states were written
    assert len(checkpoint["schedulers"]) == 2
    proc = run_cli("compare", FILES / "gan_two_optimizers.py", "--json", "--steps", "10")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["verdict_by_mode"]["amp"] != "diverged"
    assert report["skipped_by_optimizer"]["fp32"] == {"optimizers[0]": 0, "optimizers[1]": 0}
    assert sum(report["skipped_by_optimizer"]["amp"].values()) > 0  # the 2^24 scale settles on both optimizers


def test_snapshot_and_restore_cover_every_optimizer_also_one_found_while_stepping():
    """Losses after a restore repeat bit for bit: every optimizer's state (and each scheduler's) came back."""
    from fp16doctor.config import build_config
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.userfile.spec import load_training_file

    for name in ("gan_two_optimizers.py", "optimizer_on_first_use.py"):
        spec = load_training_file(FILES / name)
        bench = Workbench(spec, build_config({**spec.config, "steps": 8}, {"device": "cpu"}))
        probe = bench.probe("amp", instruments=None)
        before = [probe.step().loss for _ in range(2)]  # each step enters the probe's precision session itself
        snap = probe.snapshot()
        first = [probe.step().loss for _ in range(4)]
        probe.restore(snap)
        again = [probe.step().loss for _ in range(4)]
        probe.close()
        assert len(probe.optimizers.all()) >= 2 and before
        assert first == again, name


def test_a_clip_that_raises_on_the_steps_the_scaler_skips_is_scaler_misuse_not_unexplained():
    """clip_grad_norm_(..., error_if_nonfinite=True) under a GradScaler: the calibration's first overflow raises. The
    intervention search found a lower initial scale 'repairs' it and no rule named the cause (user-style trial);
    the cause is the raise itself, and the fix is the default error_if_nonfinite=False, not a scale."""
    code, report = diagnose("clip_raises_on_skip.py")
    assert code == 1
    top = report["findings"][0]
    assert top["cause"] == "scaler-misuse" and top["severity"] == "error", [
        (f["cause"], f["title"]) for f in report["findings"]
    ]
    assert "error_if_nonfinite=False" in top["fix"]["summary"] and "unexplained" not in {
        f["cause"] for f in report["findings"]
    }
    assert top["evidence"]["exception"]["type"] == "RuntimeError"
