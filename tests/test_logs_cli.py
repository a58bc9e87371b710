"""`fp16doctor logs` in a fresh process on the files real trainers wrote (a Hugging Face Trainer, a Lightning
Trainer, the watch's capsule), healthy and faulty, and its one-message exit 2 for input it cannot read."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "tests" / "integrations"))

pytest.importorskip("lightning")
pytest.importorskip("transformers")


def logs_json(*args) -> tuple[int, dict]:
    proc = run_cli("logs", "--json", *args)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    from history_runs import train_hf

    base = tmp_path_factory.mktemp("hf")
    train_hf(base / "healthy")
    train_hf(base / "jump", lr_jump=True)
    return base


def test_a_healthy_hf_output_dir_exits_0(hf_runs):
    code, report = logs_json(hf_runs / "healthy")
    assert code == 0 and report["verdict"] == "healthy" and report["findings"] == []
    assert report["sources"][0]["format"] == "hf-trainer-state" and report["history"]["rows"] == 40
    assert [c["step"] for c in report["checkpoints"]] == [20, 40]


def test_a_loss_spike_after_the_lr_jump_names_the_schedule_and_the_checkpoint_before_it(hf_runs, tmp_path):
    code, report = logs_json(hf_runs / "jump")
    assert code == 1
    (finding,) = report["findings"]
    assert finding["cause"] == "lr-schedule-peak" and finding["evidence"]["event_step"] == 31
    assert 31 < finding["evidence"]["trouble_step"] <= 41
    checkpoint = hf_runs / "jump" / "checkpoint-20"
    assert finding["next_command"].endswith(f"--from-checkpoint {checkpoint} --from-step 20")
    assert f"start the diagnosis from {checkpoint} (step 20" in finding["next_reason"]
    html = tmp_path / "jump.html"
    proc = run_cli("logs", hf_runs / "jump" / "checkpoint-40" / "trainer_state.json", "--html", html)
    assert proc.returncode == 1 and "lr-peak-trouble" in proc.stdout and "checkpoint-20" in proc.stdout
    page = html.read_text()
    assert 'id="plot-history"' in page and 'data-findings="lr-peak-trouble"' in page and "<svg" in page


def test_the_watchs_capsule_history_points_at_its_replay(tmp_path):
    from history_runs import train_hf

    from fp16doctor.integrations.hf import FP16DoctorCallback

    callback = FP16DoctorCallback(capsule_dir=tmp_path / "capsules")
    train_hf(tmp_path / "out", nan_at=5, steps=12, callbacks=[callback])
    assert callback.watch.alarm is not None and callback.watch.alarm.step == 5
    code, report = logs_json(tmp_path / "capsules")
    assert code == 1 and report["sources"][0]["format"] == "fp16doctor-watch"
    (finding,) = report["findings"]
    assert finding["pattern"] == "nonfinite-loss" and finding["first_step"] == 5
    assert finding["next_command"] == f"fp16doctor diagnose --capsule {callback.watch.alarm.capsule}"


def test_lightning_runs_healthy_and_diverging(tmp_path):
    from history_runs import fit_lightning

    fit_lightning(tmp_path / "healthy", lr=0.01)
    fit_lightning(tmp_path / "diverging", lr=0.13)
    code, report = logs_json(tmp_path / "healthy")
    assert code == 0 and report["sources"][0]["format"] == "lightning-csv"
    assert set(report["history"]["carried"]) == {"loss", "loss_scale", "grad_norm", "lr"}
    code, report = logs_json(tmp_path / "diverging" / "run" / "version_0" / "metrics.csv")
    assert code == 1
    found = {f["pattern"]: f for f in report["findings"]}
    assert set(found) == {"scale-collapse", "grad-norm-growth"}
    assert found["scale-collapse"]["cause"] is None and found["scale-collapse"]["evidence"]["lowest_scale"] < 1
    assert found["grad-norm-growth"]["evidence"]["growth"] > 10
    assert found["grad-norm-growth"]["next_command"].startswith("fp16doctor watch")  # its checkpoint is after
    # the healthy run as the reference the diverging one is read against: it ends far behind it
    code, report = logs_json(tmp_path / "diverging", "--reference", tmp_path / "healthy")
    assert report["reference"]["rows"] == 60 and "behind-fp32" in {f["pattern"] for f in report["findings"]}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.log", "", "is empty"),
        ("trainer_state.json", '{"log_history": [{"loss": 1', "is not valid JSON"),
        ("notes.log", "epoch 1 done\n", "no line in a format the doctor reads"),
        ("weights.bin", "\0\0\0\1", "not in a format the doctor reads"),
    ],
)
def test_input_it_cannot_read_is_one_message_and_exit_2(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    proc = run_cli("logs", path)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and message in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("logs", "--json", path)
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"]["exit_code"] == 2


def test_a_path_that_does_not_exist_is_exit_2(tmp_path):
    proc = run_cli("logs", tmp_path / "nowhere")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
