"""The public API as a library caller uses it: ``fp16doctor.diagnose``, ``compare``, ``corrected_config`` and
``watch``, returning typed records."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import MLP_FILE, SAMPLES

import fp16doctor
from fp16doctor.errors import ConfigError, DoctorError


def test_diagnose_returns_an_immutable_ranked_diagnosis_with_a_stable_json():
    diagnosis = fp16doctor.diagnose(SAMPLES / "nan_in_data.py", ci=True, device="cpu")
    assert isinstance(diagnosis, fp16doctor.Diagnosis) and not diagnosis.healthy
    top = diagnosis.findings[0]
    assert top.cause == "nonfinite-data" and top.rank == 1 and top.severity == "error"
    with pytest.raises(dataclasses.FrozenInstanceError):
        top.title = "changed"  # type: ignore[misc]
    payload = json.loads(json.dumps(diagnosis.to_json(), allow_nan=False))
    assert payload["verdict"] == "unhealthy" and payload["findings"][0]["evidence"] == top.evidence_json()


def test_config_keys_are_keyword_arguments_checked_like_the_cli(training_file):
    with pytest.raises(ConfigError, match="scaler.init_scael"):
        fp16doctor.diagnose(training_file(MLP_FILE), scaler={"init_scael": 8.0})
    with pytest.raises(DoctorError, match="does not exist"):
        fp16doctor.diagnose("no/such/file.py")


def test_corrected_config_starts_from_the_users_own_layers(training_file):
    path = training_file(MLP_FILE + "\nCONFIG = {'steps': 6}\n")
    diagnosis = fp16doctor.diagnose(path, ci=True, device="cpu", seed=3)
    corrected = fp16doctor.corrected_config(diagnosis)
    assert diagnosis.healthy and corrected == {"steps": 6, "device": "cpu", "seed": 3}


def test_compare_runs_the_modes_from_the_same_weights(training_file):
    comparison = fp16doctor.compare(training_file(MLP_FILE), ("fp32", "amp", "bf16"), steps=3, device="cpu")
    assert isinstance(comparison, fp16doctor.Comparison) and comparison.healthy
    assert set(comparison.to_json()["modes"]) == {"fp32", "amp", "bf16"}
    with pytest.raises(DoctorError, match="unknown mode"):
        fp16doctor.compare(training_file(MLP_FILE), ("fp8",))


def nan_training(steps: int = 8, nan_at: int = 3) -> list[float]:
    """A plain AMP loop whose batch turns NaN at ``nan_at``: what a watched user loop looks like."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8)
        if step == nan_at:
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), torch.zeros(4, 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_watch_as_a_context_manager_stops_at_the_alarm_and_writes_a_capsule(tmp_path):
    with fp16doctor.watch(capsule_dir=tmp_path) as watching:
        nan_training()
    assert watching.alarms, "a NaN batch raises an alarm"
    assert any(tmp_path.iterdir()), "and leaves a capsule"


def test_watch_as_a_decorator_returns_the_functions_result_when_healthy(tmp_path):
    watched = fp16doctor.watch(capsule_dir=tmp_path)(nan_training)
    losses = watched(steps=4, nan_at=99)
    assert len(losses) == 4 and not any(tmp_path.iterdir())


def test_the_watch_module_stays_the_import_path_of_its_records():
    from fp16doctor.watch import Watch, WatchOptions

    assert fp16doctor.watch is __import__("fp16doctor.watch").watch
    assert Watch and WatchOptions(skip_streak=3).skip_streak == 3
