"""The probe engine: modes, determinism, identical starts, snapshots, skip detection, user exceptions."""

import math

import pandas as pd
import pytest
import torch
from conftest import MLP_FILE, SAMPLES

from fp16doctor.config import build_config
from fp16doctor.engine.probe import RECORD_COLUMNS, Workbench
from fp16doctor.userfile.spec import load_training_file


def bench_for(path, **config):
    spec = load_training_file(path)
    return Workbench(spec, build_config(spec.config, {"device": "cpu", **config}))


def test_record_has_the_documented_columns(training_file):
    frame = bench_for(training_file(MLP_FILE), steps=3).probe("fp32").run()
    assert list(frame.columns) == RECORD_COLUMNS and len(frame) == 3
    assert frame["loss"].notna().all() and (frame["grad_norm"] > 0).all()
    assert not frame["skipped"].any() and frame["optimizer_stepped"].all()


@pytest.mark.parametrize("mode", ["fp32", "amp", "bf16"])
def test_two_probes_of_a_mode_are_bit_identical(mode):
    bench = bench_for(SAMPLES / "transformer_encoder.py", steps=4)  # dropout included
    first, second = bench.probe(mode).run(), bench.probe(mode).run()
    # Two probes failing the same way would also be identical: both must have trained, finite, to the end.
    assert len(first) == 4 and first["exception_type"].isna().all() and first["loss"].map(math.isfinite).all()
    assert first["optimizer_stepped"].any()
    pd.testing.assert_frame_equal(first, second, check_exact=True)


def test_every_mode_starts_from_the_same_weights():
    bench = bench_for(SAMPLES / "cnn_batchnorm.py", steps=1)
    states = {m: bench.probe(m).model.state_dict() for m in ("fp32", "amp", "bf16")}
    for name, tensor in states["fp32"].items():
        assert torch.equal(tensor, states["amp"][name]) and torch.equal(tensor, states["bf16"][name])


def test_fp32_probe_neutralises_the_users_half_casts(training_file):
    source = MLP_FILE.replace(
        "return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))",
        "return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).half()",
    )
    bench = bench_for(training_file(source), steps=2)
    fp32 = bench.probe("fp32")
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())
    assert not fp32.run()["exception_type"].notna().any()
    amp = bench.probe("amp")
    assert all(p.dtype == torch.float16 for p in amp.model.parameters())
    fp32.close()
    assert any("the FP32 baseline runs those casts in fp32" in note for note in bench.spec.notes)  # said


def test_a_file_without_half_casts_gets_no_note_about_them():
    bench = bench_for(SAMPLES / "cnn_batchnorm.py", steps=2)
    probe = bench.probe("fp32")
    probe.run()
    probe.close()
    assert not any("runs those casts in fp32" in note for note in bench.spec.notes)


def test_half_parameters_surface_as_a_recorded_exception_with_location(training_file):
    source = MLP_FILE.replace("nn.Linear(16, 3))", "nn.Linear(16, 3)).half()") + (
        "\nimport torch.nn.functional as F\ndef loss(model, batch):\n    return F.cross_entropy(model(batch[0].half()).float(), batch[1])\n"
    )
    frame = bench_for(training_file(source), steps=3).probe("amp").run()
    assert len(frame) == 1  # the probe stops at the exception
    row = frame.iloc[0]
    assert row["exception_type"] == "ValueError" and "FP16 gradients" in row["exception"]


def test_user_exception_mid_run_is_evidence(training_file):
    source = (
        MLP_FILE
        + """
calls = {"n": 0}
import torch.nn.functional as F
def loss(model, batch):
    calls["n"] += 1
    if calls["n"] == 3:
        raise KeyError("label column missing")
    return F.cross_entropy(model(batch[0]), batch[1])
"""
    )
    path = training_file(source)
    frame = bench_for(path, steps=5).probe("fp32").run()
    assert len(frame) == 3
    last = frame.iloc[-1]
    assert last["exception_type"] == "KeyError" and "label column" in last["exception"]
    raise_line = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if "raise KeyError" in line)
    assert last["exception_location"] == f"{path}:{raise_line}"


def test_snapshot_restore_replays_identically():
    bench = bench_for(SAMPLES / "transformer_encoder.py", steps=6)
    probe = bench.probe("amp")
    probe.run(2)
    snap = probe.snapshot()
    first = probe.run(3).iloc[2:].reset_index(drop=True)
    probe.restore(snap)
    second = probe.run(3).iloc[2:].reset_index(drop=True)
    assert len(first) == 3 and first["exception_type"].isna().all() and first["loss"].map(math.isfinite).all()
    pd.testing.assert_frame_equal(first, second, check_exact=True)


ACCUMULATING = """
import torch
from torch import nn
import torch.nn.functional as F

def model():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(4)]

def train_step(model, batch, optimizer, scaler, autocast):
    group = optimizer.param_groups[0]          # the phase lives in the optimizer's state dict
    group["micro"] = group.get("micro", 0) + 1
    x, y = batch
    with autocast():
        loss = F.cross_entropy(model(x), y) / 2
    scaler.scale(loss).backward()
    if group["micro"] % 2 == 0:                # every second micro-batch: one optimizer step
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss
"""


@pytest.mark.parametrize("kept", [False, True])
def test_a_snapshot_inside_an_accumulation_keeps_the_gradients(training_file, kept):
    """Restored mid-accumulation, the next step adds to the accumulated gradients, as the original did; and
    a restore frees the probe's own gradients and optimizer state rather than keeping them beside the copy."""
    from fp16doctor.engine.kept import StateKeeper

    bench = bench_for(training_file(ACCUMULATING), steps=4)
    probe = bench.probe("fp32", instruments=None)
    probe.run(1)  # a micro-step: gradients accumulated, no optimizer step yet
    store = StateKeeper(budget=0).kept()
    store[1] = probe.snapshot(copy_state=False)
    snap = probe.snapshot()
    assert snap.grads and all(g.abs().sum() > 0 for g in snap.grads.values())
    probe.step()
    first = [p.detach().clone() for p in probe.model.parameters()]
    import weakref

    old_moment = weakref.ref(next(iter(probe.optimizer.state.values()))["exp_avg"])
    if kept:
        probe.restore_kept(store, 1)
    else:
        probe.restore(snap)
    assert old_moment() is None  # the probe's own optimizer state went, not kept beside the restored one
    probe.step()
    assert all(torch.equal(a, b) for a, b in zip(first, probe.model.parameters()))
    probe.close()


@pytest.mark.parametrize("fused", [False, True])
def test_skipped_steps_are_detected_from_the_scalers_found_inf(training_file, fused):
    source = (
        MLP_FILE
        + f"\nimport torch\ndef optimizer(params):\n    return torch.optim.Adam(params, lr=1e-3, fused={fused})\n"
    )
    bench = bench_for(training_file(source), steps=4, scaler={"init_scale": 2.0**40})
    probe = bench.probe("amp")
    weights = [p.detach().clone() for p in probe.model.parameters()]
    frame = probe.run()
    assert frame["skipped"].iloc[0] and not frame["optimizer_stepped"].iloc[0]
    assert frame["nonfinite_grads"].iloc[0] and not frame["nonfinite_loss"].iloc[0]
    assert frame["loss_scale"].iloc[1] == frame["loss_scale"].iloc[0] / 2  # backoff after the skip
    assert frame["skipped"].all() and not frame["micro_step"].any()  # 2^40 needs more than 4 halvings to settle
    assert all(torch.equal(w, p) for w, p in zip(weights, probe.model.parameters()))  # no skipped step moved a weight


def test_custom_train_step_is_observed(training_file):
    source = (
        MLP_FILE
        + """
import torch.nn.functional as F
def train_step(model, batch, optimizer, scaler, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = F.cross_entropy(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
"""
    )
    frame = bench_for(training_file(source), steps=3).probe("amp").run()
    assert frame["optimizer_stepped"].all() and (frame["grad_norm"] > 0).all()
    assert (frame["loss_scale"] == 65536.0).all()


def test_scheduler_steps_once_per_step():
    frame = bench_for(SAMPLES / "transformer_encoder.py", steps=4).probe("fp32").run()
    assert frame["lr"].tolist() == pytest.approx([5e-4 * min(1.0, (k + 1) / 10) for k in range(4)])


def test_amp_probe_on_cpu_sees_what_cuda_autocast_would(training_file):
    """exp of values past ln(65504) inside autocast: CUDA runs exp in fp32 (finite), plain CPU autocast in fp16 (inf)."""
    source = """
import torch
from torch import nn
import torch.nn.functional as F

class SoftplusByHand(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)
    def forward(self, x):
        h = self.proj(x)
        return torch.log1p(torch.exp(h))   # exp of ~12: 1.6e5, beyond fp16

def model():
    net = SoftplusByHand()
    with torch.no_grad():
        net.proj.weight.fill_(0.0)
        net.proj.bias.fill_(12.0)
    return net

def data():
    return [(torch.randn(6, 8), torch.randint(0, 4, (6,)))]
"""
    probe = bench_for(training_file(source), steps=1).probe("amp")
    frame = probe.run()
    assert not frame["nonfinite_loss"].any()  # faithful to CUDA's fp32 list
    with torch.autocast("cpu", dtype=torch.float16):  # what plain CPU autocast would have shown
        assert torch.isinf(torch.exp(torch.full((2,), 12.0).half())).all()


def test_the_fp32_baseline_loads_a_half_precision_checkpoint_model_builds_from(training_file, tmp_path):
    """model() that torch.loads a module saved in fp16 (a pretrained table, a capsule's model.pt): unpickling
    rebuilds each fp16 tensor as an fp16 torch.empty, which the baseline's fp32 rewrite made unloadable ("Trying
    to resize storage that is not resizable"). It loads as saved, and the baseline casts the model up."""
    saved = tmp_path / "half.pt"
    torch.save(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).half(), saved)
    source = MLP_FILE.replace(
        "return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))",
        f"return torch.load({str(saved)!r}, weights_only=False)",
    )
    bench = bench_for(training_file(source), steps=2)
    fp32 = bench.probe("fp32")
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())
    assert not fp32.run()["exception_type"].notna().any()


def test_a_bug_inside_the_doctors_own_hooks_is_raised_not_blamed_on_the_training(monkeypatch, training_file):
    """An exception the doctor's instruments raise is its own bug: it goes up as one (the CLI's internal error, exit
    3), not into the record as the training's failure at the user's line. The user's own exception still is
    evidence."""
    from fp16doctor.engine.instruments import Instruments
    from fp16doctor.tensors import grad_values

    def broken(self, module, args, output):
        grad_values(None)  # the package's own code raises: None has no .grad

    monkeypatch.setattr(Instruments, "_post_forward", broken)
    with pytest.raises(AttributeError, match="grad"):
        bench_for(training_file(MLP_FILE), steps=2).probe("amp").step()
    monkeypatch.undo()
    raising = training_file(
        """
        import torch
        def model():
            return torch.nn.Linear(4, 2)
        def data():
            return [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
        def loss(model, batch):
            raise ValueError("the user's own")
        """
    )
    probe = bench_for(raising, steps=2).probe("amp")
    record = probe.step()
    assert probe.failed is record and record.exception_type == "ValueError"
