"""The loss the doctor trained with is probably not the one the user meant: a loss function under another
name than the contract's ``loss(model, batch)`` (the doctor ignores it and uses its default loss), a loss
that is the same number at every FP32 step (measured: nothing is trained), and one that rises in FP32 (the
twin AMP is compared with diverges itself). All are warnings: the exit code of a file that is otherwise
healthy stays 0 (README, Exit codes)."""

from __future__ import annotations

import json

from conftest import ROOT, diagnose_ci, run_cli

from fp16doctor.userfile.spec import load_training_file

FILES = ROOT / "tests" / "training_files"
USERS_FILE = FILES / "regression_loss_fn.py"
"""A regression model whose loss function is called ``loss_fn``, written as the user who reported it did."""

REGRESSION = """
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.functional import mse_loss   # imported, not defined here: never a near miss

def model():
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

def data():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        x = torch.randn(32, 6, generator=g)
        out.append((x, x[:, :1] * 2.0 - x[:, 1:2]))
    return out

CONFIG = {"steps": 20}
"""


def test_the_loader_records_the_callables_it_ignored_under_a_near_miss_name():
    spec = load_training_file(USERS_FILE)
    assert spec.loss is None
    assert spec.near_misses == {"loss": {"loss_fn": "(model, batch)"}}


def test_only_what_the_file_itself_defines_counts(training_file):
    imported_only = load_training_file(training_file(REGRESSION, "imported_only.py"))
    assert imported_only.near_misses == {}  # mse_loss is torch's
    criterion = load_training_file(
        training_file(
            REGRESSION + "criterion = nn.MSELoss()\n"
            "def training_step(model, batch, optimizer, scaler, autocast):\n"
            "    pass\n",
            "criterion.py",
        )
    )
    assert set(criterion.near_misses["loss"]) == {"criterion"}
    assert set(criterion.near_misses["train_step"]) == {"training_step"}
    proper = load_training_file(
        training_file(
            REGRESSION + "def loss(model, batch):\n    x, y = batch\n"
            "    return F.mse_loss(model(x), y)\n"
            "def loss_fn(model, batch):\n    return loss(model, batch)\n",
            "proper.py",
        )
    )
    assert "loss" not in proper.near_misses  # a file with loss() is read as it is: nothing was ignored


def test_a_users_loss_fn_gets_both_warnings_and_the_exit_code_of_a_healthy_file():
    proc = diagnose_ci(USERS_FILE)
    assert proc.returncode == 0, proc.stderr[-2000:]  # warnings only: healthy exit code
    report = json.loads(proc.stdout)
    assert report["verdict"] == "healthy"
    by_cause = {f["cause"]: f for f in report["findings"]}
    mismatch = by_cause["loss-name-mismatch"]
    assert mismatch["severity"] == "warning"
    assert "loss_fn" in mismatch["title"] and "default loss" in mismatch["title"]
    assert mismatch["evidence"]["ignored"] == "loss_fn"
    assert (
        "Rename `loss_fn` to `loss`" in mismatch["fix"]["summary"]
        and "def loss(model, batch)" in mismatch["fix"]["code"]
    )
    constant = by_cause["constant-loss"]
    assert constant["severity"] == "warning"
    assert constant["title"].startswith("The loss is 0.0 at every step") and "nothing is trained" in constant["title"]
    assert constant["evidence"]["losses"] == [0.0] * 10 and constant["evidence"]["steps"] == 20  # measured, not guessed
    assert constant["evidence"]["default_loss"] is True


def test_the_warnings_show_in_the_terminal_report():
    proc = run_cli("diagnose", USERS_FILE, "--ci")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = " ".join(proc.stdout.split())
    assert "loss-name-mismatch" in text and "loss_fn" in text and "constant-loss" in text
    headline = text.split(" Triage")[0]  # a training that trains nothing is not "like its FP32 twin" in the headline
    assert headline.startswith("healthy: ") and "2 warning(s) below" in headline and "FP32 twin" not in headline


def test_a_file_with_a_proper_loss_gets_neither_warning(training_file):
    path = training_file(
        REGRESSION + "def loss(model, batch):\n    x, y = batch\n    return F.mse_loss(model(x), y)\n",
        "regression_loss.py",
    )
    proc = run_cli("diagnose", path, "--ci", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    causes = {f["cause"] for f in json.loads(proc.stdout)["findings"]}
    assert not causes & {"loss-name-mismatch", "constant-loss"}, causes


NEGATIVE_ZERO_LOSS = """
import torch
from torch import nn

CONFIG = {"steps": 4}
criterion = nn.MSELoss()                      # meant as the loss; the doctor reads only loss(model, batch)


def model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def data():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 4, generator=g) for _ in range(4)]
    return [(x, x.sum(1, keepdim=True)) for x in xs]  # float targets: the default cross-entropy is -0.0
"""


def test_a_loss_of_minus_zero_reads_as_zero(training_file):
    proc = run_cli("diagnose", training_file(NEGATIVE_ZERO_LOSS, "negative_zero.py"), "--ci", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    fp32 = next(s for s in report["stages"] if s["name"] == "fp32 baseline")
    assert "loss 0 -> 0" in fp32["summary"] and "-0" not in fp32["summary"]
    assert {"loss-name-mismatch", "constant-loss"} <= {f["cause"] for f in report["findings"]}


def test_a_training_that_diverges_in_fp32_gets_the_warning_and_a_converging_one_not(training_file):
    proper_loss = "def loss(model, batch):\n    x, y = batch\n    return F.mse_loss(model(x), y)\n"
    adam = "def optimizer(params):\n    return torch.optim.Adam(params, lr=3e-2, maximize={maximize})\n"
    diverging = training_file(
        REGRESSION + proper_loss + adam.format(maximize=True), "gradient_ascent.py"
    )  # a flag set wrong
    proc = run_cli("diagnose", diverging, "--ci", "--json")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]  # growing gradients may overflow a scale too: that is AMP's
    report = json.loads(proc.stdout)
    rises = next(f for f in report["findings"] if f["cause"] == "fp32-loss-rises")
    assert rises["severity"] == "warning"
    evidence = rises["evidence"]
    assert evidence["last_third_median"] >= 2 * evidence["first_third_median"] > 0  # measured on the FP32 probe
    assert evidence["losses"][-1] > evidence["losses"][0]
    converging = training_file(REGRESSION + proper_loss + adam.format(maximize=False), "gradient_descent.py")
    proc = run_cli("diagnose", converging, "--ci", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fp32-loss-rises" not in {f["cause"] for f in json.loads(proc.stdout)["findings"]}
