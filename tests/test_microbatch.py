"""Micro-batched FP32 probes: the plan, the same update, the refusals, and what the diagnosis says."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import warnings

import pandas as pd
import pytest
import torch
from conftest import MLP_FILE, ROOT, run_cli

from fp16doctor.config import build_config
from fp16doctor.engine.instruments import InstrumentOptions
from fp16doctor.engine.microbatch import ActivationBytes, MicroBatchPlan, micro_batch_count
from fp16doctor.engine.probe import Workbench
from fp16doctor.engine.rng import rng_state
from fp16doctor.measure.localise import trace_step
from fp16doctor.measure.numerics import capture_gradients, observed_underflow
from fp16doctor.userfile.batches import batch_rows, split_rows
from fp16doctor.userfile.spec import load_training_file

GATED_FILE = """
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 3}
WIDTH, BATCH = 256, 512


class Gated(nn.Module):
    # Elementwise gates on wide activations: each saves its input for backward, in fp32 in the FP32
    # baseline and in fp16 under AMP, so FP32's activations are well above AMP's (CPU's emulated AMP
    # GEMMs keep fp32 copies of their inputs, so a GEMM-only model shows little difference on CPU).
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.blowup = Exp()
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            u = block(h)
            h = h + F.silu(u) * torch.sigmoid(u) * torch.tanh(u)
        return self.head(self.blowup(h))


class Exp(nn.Module):
    def forward(self, h):
        return torch.exp(h.clamp(max=5.0)) if BLOWUP is None else torch.exp(h)


BLOWUP = None


def model():
    return Gated()


def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(3)]
"""

BATCHNORM_FILE = GATED_FILE.replace(
    "self.inp = nn.Linear(16, WIDTH)", "self.inp = nn.Sequential(nn.Linear(16, WIDTH), nn.BatchNorm1d(WIDTH))"
)
CONTRASTIVE_FILE = (
    GATED_FILE
    + """

def loss(model, batch):
    x, _ = batch
    z = F.normalize(model(x), dim=1)
    return F.cross_entropy(z @ z.T * 10, torch.arange(len(x)))  # every row against every other
"""
)
TOKEN_MEAN_FILE = (
    GATED_FILE
    + """

def data():  # (x, y, weight): the first batch weighs every row alike, the later ones do not (padding)
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(3):
        weight = torch.ones(BATCH) if i == 0 else torch.randint(1, 4, (BATCH,), generator=g).float()
        batches.append((torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g), weight))
    return batches


def loss(model, batch):
    x, y, weight = batch
    per_row = F.cross_entropy(model(x), y, reduction="none")
    return (per_row * weight).sum() / weight.sum()  # normalised by a count over the whole batch
"""
)
TRAIN_STEP_FILE = (
    GATED_FILE
    + """

def train_step(model, batch, optimizer, scaler, autocast):
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = F.cross_entropy(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
"""
)


def bench_for(path, micro_batching=True, **config):
    spec = load_training_file(path)
    return Workbench(spec, build_config(spec.config, {"device": "cpu", **config}), micro_batching=micro_batching)


def run_fp32(bench, steps=3):
    probe = bench.probe("fp32", instruments=InstrumentOptions())  # every table: each must survive the split
    try:
        frame = probe.run(steps)
        return frame, {k: v.clone() for k, v in probe.model.state_dict().items()}, probe.instruments.frames()
    finally:
        probe.close()


def test_a_decomposable_loss_gives_the_same_update_micro_batched(training_file):
    path = training_file(GATED_FILE)
    split_bench = bench_for(path)
    plan = split_bench.micro_batch_plan("fp32")
    assert plan.count >= 2 and plan.needed and plan.fp32_bytes > plan.amp_bytes, plan
    assert split_bench.probe("amp").batch_plan.count == 1  # only the FP32 probes split
    split, split_weights, split_tables = run_fp32(split_bench)
    whole, whole_weights, whole_tables = run_fp32(bench_for(path, micro_batching=False))
    assert bench_for(path, micro_batching=False).micro_batch_plan("fp32").count == 1
    assert split["loss"].tolist() == pytest.approx(whole["loss"].tolist(), rel=1e-5)
    assert split["grad_norm"].tolist() == pytest.approx(whole["grad_norm"].tolist(), rel=1e-4)
    assert split["optimizer_stepped"].all() and not split["micro_step"].any()  # one optimizer step per step
    # Adam divides each gradient by its own running magnitude: an element whose gradient is nearly zero moves
    # by up to the learning rate on summation-order noise. 3 steps at lr 1e-3 move a weight by up to 3e-3;
    # 1% of that is the tolerance.
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, rtol=1e-4, atol=3e-5)
    # The instruments: a row per module call per micro-batch, whose largest abs_max is the whole batch's; one
    # row per parameter and step for the summed gradients and the update.
    fwd, ref = split_tables["forward"], whole_tables["forward"]
    assert len(fwd) == plan.count * len(ref)
    peaks = fwd.groupby(["step", "module"])["abs_max"].max()
    pd.testing.assert_series_equal(peaks, ref.groupby(["step", "module"])["abs_max"].max(), rtol=1e-4)
    assert (fwd.groupby("step")["order"].apply(lambda o: o.is_monotonic_increasing and o.is_unique)).all()
    assert len(split_tables["param_grads"]) == len(whole_tables["param_grads"]) > 0
    assert len(split_tables["updates"]) == len(whole_tables["updates"])
    assert len(split_tables["activation_grads"]) == plan.count * len(whole_tables["activation_grads"]) > 0


@pytest.mark.parametrize("source, reason", [(BATCHNORM_FILE, "BatchNorm"), (CONTRASTIVE_FILE, "does not decompose")])
def test_a_loss_that_does_not_decompose_is_not_split_and_the_trajectory_is_unchanged(training_file, source, reason):
    path = training_file(source)
    bench = bench_for(path)
    plan = bench.micro_batch_plan("fp32")
    assert plan.count == 1 and plan.needed and reason in plan.reason and plan.detail, plan
    assert "not split" in plan.sentence() and reason in plan.sentence()
    planned, planned_weights, _ = run_fp32(bench)
    before, before_weights, _ = run_fp32(bench_for(path, micro_batching=False))
    pd.testing.assert_frame_equal(planned, before, check_exact=True)
    assert all(torch.equal(planned_weights[k], v) for k, v in before_weights.items())


def test_planning_leaves_every_generator_where_it_was(training_file):
    bench = bench_for(training_file(GATED_FILE))
    torch.manual_seed(123)
    before = rng_state()
    bench.micro_batch_plan("fp32")
    after = rng_state()
    assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]


def test_the_planner_splits_only_what_is_activation_heavy(training_file):
    mlp = bench_for(training_file(MLP_FILE, "mlp.py")).micro_batch_plan("fp32")
    assert mlp.count == 1 and not mlp.needed and mlp.fp32_bytes is not None and "not much above" in mlp.reason
    assert mlp.sentence() is None  # nothing to say: the diagnosis reads as it always did
    own_loop = bench_for(training_file(TRAIN_STEP_FILE, "own.py")).micro_batch_plan("fp32")
    assert own_loop.count == 1 and "train_step" in own_loop.reason and own_loop.fp32_bytes is None
    assert bench_for(training_file(GATED_FILE, "gated.py")).micro_batch_plan("fp32").count >= 2


def test_a_transformer_at_long_sequences_is_planned_from_what_the_probes_save(training_file, monkeypatch):
    spec = importlib.util.spec_from_file_location("diagnose_scale", ROOT / "benchmarks" / "diagnose_scale.py")
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "diagnose_scale", benchmark)  # its dataclasses look their module up
    spec.loader.exec_module(benchmark)
    source = benchmark.transformer_case(512, faulty=False, steps=2).source  # batch 4, width 128, dropout 0
    plan = bench_for(training_file(source, "t512.py")).micro_batch_plan("fp32")
    assert plan.fp32_bytes > 10e6 and plan.amp_bytes > 10e6  # measured, activation-heavy
    # The decision follows the measurement: on CPU the AMP probe's emulated GEMMs save fp32 copies of their
    # inputs, so its activations are no smaller than FP32's there and splitting FP32 would not lower the peak.
    heavier = plan.fp32_bytes - plan.amp_bytes > 0.1 * plan.amp_bytes
    assert plan.split == heavier, plan


def test_the_count_is_the_smallest_power_of_two_within_amp():
    per_row = ActivationBytes(0.0, 1e6)
    assert micro_batch_count(per_row, amp_bytes=int(0.5e8), rows=100, model_bytes=1000) == 2
    assert micro_batch_count(per_row, amp_bytes=int(0.3e8), rows=100, model_bytes=1000) == 4
    assert micro_batch_count(per_row, amp_bytes=int(1e6), rows=100, model_bytes=1000) == 8  # at most 8
    assert (
        micro_batch_count(ActivationBytes(0.0, 4e6), amp_bytes=int(1e6), rows=2, model_bytes=1000) == 2
    )  # at most the rows
    assert (
        micro_batch_count(ActivationBytes(0.0, 4e3), amp_bytes=int(1e3), rows=100, model_bytes=10) == 1
    )  # under 1 MiB to save
    assert micro_batch_count(per_row, amp_bytes=int(0.95e8), rows=100, model_bytes=1000) == 1  # within the margin
    assert (
        micro_batch_count(per_row, amp_bytes=int(0.5e8), rows=100, model_bytes=int(2e8)) == 1
    )  # small next to the model


def test_only_batches_of_rows_split():
    x, y = torch.zeros(6, 3), torch.zeros(6, dtype=torch.long)
    assert batch_rows((x, y)) == (6, "")
    assert batch_rows({"a": x, "b": [y, x]}) == (6, "")
    assert batch_rows((x, torch.zeros(5)))[0] is None and "leading" in batch_rows((x, torch.zeros(5)))[1]
    assert batch_rows((x, 7))[0] is None and "int" in batch_rows((x, 7))[1]
    assert batch_rows((x, torch.tensor(1.0)))[0] is None
    pieces = split_rows({"a": x, "b": (y,)}, [4, 2])
    assert [p["a"].shape[0] for p in pieces] == [4, 2] and isinstance(pieces[1]["b"], tuple)
    plan = MicroBatchPlan(count=4)
    assert [share for _, share in plan.pieces((x, y))] == [2 / 6, 2 / 6, 1 / 6, 1 / 6]
    assert plan.pieces((x[:1], y[:1]))[0][1] == 1.0  # a single row: whole
    assert len(plan.pieces((x, 7))) == 1


def test_a_file_whose_batches_cannot_split_is_not_planned(training_file):
    source = MLP_FILE.replace(
        "torch.randint(0, 3, (16,), generator=g))", "torch.randint(0, 3, (16,), generator=g), 16)"
    )
    source += "\nimport torch.nn.functional as F\ndef loss(model, batch):\n    return F.cross_entropy(model(batch[0]), batch[1])\n"
    plan = bench_for(training_file(source)).micro_batch_plan("fp32")
    assert plan.count == 1 and "cannot be split" in plan.reason and plan.fp32_bytes is None


def test_localisation_traces_a_micro_batched_fp32_step(training_file):
    # The second batch overflows in the blow-up module, in the rows of its second micro-batch only.
    source = (
        GATED_FILE.replace("BLOWUP = None", "BLOWUP = True")
        .replace("    return [(torch.randn", "    batches = [(torch.randn")
        .replace("for _ in range(3)]\n", "for _ in range(3)]\n    batches[1][0][-1] = 300.0\n    return batches\n")
    )
    bench = bench_for(training_file(source))
    probe = bench.probe("fp32")
    assert probe.batch_plan.split
    first = probe.step()
    assert first.loss == first.loss and not first.nonfinite_loss
    found = trace_step(probe)
    assert found is not None and found.phase == "forward" and found.module == "blowup" and found.operator == "aten::exp"
    assert probe.records[-1].nonfinite_loss  # the traced step is a step of the probe: recorded, instrumented
    first_bad = probe.instruments.first_nonfinite_forward()
    assert first_bad is not None and first_bad["module"] == "blowup" and first_bad["step"] == 1
    probe.close()


def test_the_diagnosis_says_when_its_fp32_probes_split(training_file):
    path = training_file(GATED_FILE)
    proc = run_cli("diagnose", path, "--json", "--ci", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    stage = next(s for s in report["stages"] if s["name"] == "fp32 baseline")
    assert "split each batch into 2 micro-batches" in stage["summary"], stage["summary"]
    assert stage["details"]["micro_batches"]["count"] == 2


def test_planning_keeps_nothing_it_measured(training_file):
    # The measured graphs are dropped: a pack hook that saved an output as itself would keep each of them
    # alive through a cycle no collection sees (90 MB on benchmarks/diagnose_scale.py's seq-512 transformer).
    bench = bench_for(training_file(GATED_FILE))

    def live_bytes() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every object touches torch.distributed's deprecated aliases
            warnings.simplefilter("ignore", FutureWarning)
            return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if isinstance(o, torch.Tensor))

    before = live_bytes()
    assert bench.micro_batch_plan("fp32").split
    assert live_bytes() - before < 100_000


def test_a_loss_normalised_over_the_batch_is_refused_even_when_the_first_batch_hides_it(training_file):
    """Equal weights in the first batch make its chunk decompose; the later batches' uneven ones do not: the
    check looks at several drawn batches, not only the first."""
    plan = bench_for(training_file(TOKEN_MEAN_FILE, "token_mean.py")).micro_batch_plan("fp32")
    assert plan.needed and plan.count == 1 and "does not decompose" in plan.reason, plan


TWICE_AND_TRANSPOSED = (
    GATED_FILE.replace(
        "        return self.head(self.blowup(h))",
        "        h = self.blocks[0](h)  # a module called twice per forward\n"
        "        return self.head(self.transposed(self.blowup(h)))",
    )
    .replace(
        "        self.head = nn.Linear(WIDTH, 4)",
        "        self.head = nn.Linear(WIDTH, 4)\n        self.transposed = Transposed()",
    )
    .replace(
        "class Exp(nn.Module):",
        "class Transposed(nn.Module):\n    def forward(self, h):\n"
        "        return (h.T * 1.0).T  # computed on a transposed copy: the output's rows are the batch's, its memory is not\n\n\n"
        "class Exp(nn.Module):",
    )
)


@pytest.mark.parametrize("sample, batch, rows", [(1000, 512, [256, 256]), (0, 512, [256, 256]), (997, 511, [256, 255])])
def test_a_micro_batched_capture_samples_what_the_whole_batch_would(training_file, sample, batch, rows):
    # The loss-scale stage's FP32 reference is micro-batched like every FP32 probe (its whole-batch step was
    # the diagnosis's peak): its capture must hold the elements a whole-batch capture holds, so that AMP's
    # gradients compare with it element for element (an uneven split and a sample size dividing nothing too).
    path = training_file(GATED_FILE.replace("WIDTH, BATCH = 256, 512", f"WIDTH, BATCH = 256, {batch}"))
    split_probe = bench_for(path).probe("fp32", instruments=None)
    assert split_probe.batch_plan.split and split_probe.next_micro_batch_rows() == rows
    split = capture_gradients(split_probe, sample=sample)
    split_probe.close()
    whole_probe = bench_for(path, micro_batching=False).probe("fp32", instruments=None)
    assert whole_probe.next_micro_batch_rows() is None
    whole = capture_gradients(whole_probe, sample=sample)
    whole_probe.close()
    assert set(split.tensors) == set(whole.tensors) and any(k.startswith("act:") for k in whole.tensors)
    assert split.shapes == whole.shapes  # the whole batch's gradient shapes, as the comparison checks them
    for key, tensor in whole.tensors.items():
        assert split.tensors[key].shape == tensor.shape, key
        torch.testing.assert_close(split.tensors[key], tensor, rtol=1e-4, atol=1e-6 * float(tensor.abs().max()))
        # the exact largest magnitude, over the micro-batches' gradients as over the whole one
        torch.testing.assert_close(split.abs_max[key], whole.abs_max[key], rtol=1e-4, atol=0.0)
        assert float(whole.abs_max[key]) >= float(tensor.abs().max())


def test_a_micro_batched_capture_leaves_out_what_it_cannot_place(training_file):
    # A module called twice per forward has no one output per micro-batch; the rest is captured as whole.
    path = training_file(TWICE_AND_TRANSPOSED)
    split_probe = bench_for(path).probe("fp32", instruments=None)
    assert split_probe.batch_plan.split
    split = capture_gradients(split_probe, sample=1000)
    split_probe.close()
    whole_probe = bench_for(path, micro_batching=False).probe("fp32", instruments=None)
    whole = capture_gradients(whole_probe, sample=1000)
    whole_probe.close()
    assert "act:blocks.0" in whole.tensors and "act:blocks.0" not in split.tensors
    assert {"act:transposed", "act:blowup", "act:head"} <= set(split.tensors)
    for key in split.tensors:
        torch.testing.assert_close(
            split.tensors[key], whole.tensors[key], rtol=1e-4, atol=1e-6 * float(whole.tensors[key].abs().max())
        )


def test_observed_underflow_is_the_same_against_a_micro_batched_reference(training_file):
    path = training_file(
        GATED_FILE.replace('CONFIG = {"steps": 3}', 'CONFIG = {"steps": 3, "scaler": {"enabled": False}}')
    )
    split, whole = observed_underflow(bench_for(path)), observed_underflow(bench_for(path, micro_batching=False))
    assert len(split) == len(whole) > 0 and list(split.columns) == list(whole.columns)
    pd.testing.assert_frame_equal(split.drop(columns=["rms"]), whole.drop(columns=["rms"]), atol=1e-3, rtol=1e-3)
    pd.testing.assert_series_equal(split["rms"], whole["rms"], rtol=1e-4)


def test_a_micro_batch_capture_leaves_out_outputs_it_cannot_tell_from_the_batch():
    from fp16doctor.measure.numerics import _WholeBatchSamples

    single = _WholeBatchSamples([1, 1], sample=100)  # a leading 1 may be the row or a broadcast (1, T, D)
    single.watch("act:wpe", torch.zeros(1, 4, 3, requires_grad=True))
    assert "act:wpe" in single.unaligned
    trimmed = _WholeBatchSamples([2, 2], sample=100)  # each micro-batch cut to its own longest sequence
    trimmed.watch("act:h", torch.zeros(2, 5, requires_grad=True))
    trimmed.next_piece()
    trimmed.watch("act:h", torch.zeros(2, 3, requires_grad=True))
    assert "act:h" in trimmed.unaligned
    steady = _WholeBatchSamples([2, 2], sample=100)
    steady.watch("act:h", torch.zeros(2, 5, requires_grad=True))
    steady.next_piece()
    steady.watch("act:h", torch.zeros(2, 5, requires_grad=True))
    assert not steady.unaligned


def test_a_counter_the_file_keeps_at_module_level_starts_every_probe_where_the_first_found_it():
    """An accumulation counter in a module-level dict, 20 steps (not a multiple of 8): the AMP probe began counting
    where FP32's had stopped, stepped at other micro-batches, and ended 30% off FP32 in a healthy training. Each
    probe now starts from the counter as the first found it, and a note names it."""
    from conftest import diagnose_ci

    report = diagnose_ci(ROOT / "tests" / "training_files" / "accumulation_counter_global.py").report()
    assert report["verdict"] == "healthy" and report["symptoms"] == []
    losses = {
        s["name"]: s["details"]["final_loss"]
        for s in report["stages"]
        if s["name"] in ("fp32 baseline", "amp as configured")
    }
    assert abs(losses["amp as configured"] - losses["fp32 baseline"]) < 1e-2 * losses["fp32 baseline"], losses
    assert any("module-level _micro changed" in note for note in report["notes"])
