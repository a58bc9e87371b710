"""The watch's comparison of the ranks, and its guard, in one process: the stories it reads from the ranks' rows,
the checksum that tells replicated weights apart, and a failure of its own measurement that never reaches the
training (reported once, the numbers unchanged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fp16doctor
from fp16doctor.engine.rank_launcher import let_gloo_threads_finish
from fp16doctor.live.observe import TrainingObserver
from fp16doctor.live.ranks import (
    RankRow,
    failed_row,
    first_divergent,
    misuse_hint,
    parameter_checksums,
    rank_story,
    total_checksum,
)
from fp16doctor.live.sharding import Topology
from fp16doctor.live.watch import Watch, WatchOptions

OWN = ["body.0.weight", "body.2.weight", "body.2.bias"]
PARAMS = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]
DDP_HALF = Topology("DistributedDataParallel", 2, False, "fp16_compress_hook")
FSDP2 = Topology("fully_shard", 2, True, None)


def row(own=0, own_first=-1, reduced_first=-1, skipped=False, micro_batch=0):
    return RankRow(65536.0, skipped, False, False, False, own, micro_batch, own_first, reduced_first, 0.0, 0)


def test_a_ranks_own_non_finite_gradient_is_its_batch_not_the_reduction():
    story = rank_story([row(), row(own=1, own_first=1, reduced_first=2, micro_batch=1)], OWN, PARAMS, DDP_HALF)
    assert story == (
        "rank 1's own gradients were non-finite before the ranks reduced them (micro-batch 1, first module body.2 "
        "(body.2.weight)); rank 0's were finite: a batch of rank 1's, not the reduction"
    )


def test_finite_own_gradients_with_non_finite_reduced_ones_are_the_reduction_named_by_its_half_precision():
    table = [row(reduced_first=0), row(reduced_first=0)]
    assert rank_story(table, OWN, PARAMS, DDP_HALF) == (
        "every rank's own gradients were finite before the reduction and the reduced ones are not: the reduction "
        "overflowed (fp16_compress_hook, world size 2; first in body.0.weight)"
    )
    assert "(in fp32, world size 2" in str(rank_story(table, OWN, PARAMS, Topology("fully_shard", 2, True, None)))


def test_no_story_without_a_non_finite_gradient_or_without_the_own_gradients_measured():
    assert rank_story([row(), row()], OWN, PARAMS, DDP_HALF) is None
    assert rank_story([row(own=-1, reduced_first=0), row(own=-1, reduced_first=0)], OWN, PARAMS, DDP_HALF) is None


def test_an_inf_in_one_shard_says_whether_the_ranks_skipped_together():
    table = [row(reduced_first=2, skipped=True), row(own=1, own_first=1, skipped=True)]
    assert rank_story(table, OWN, PARAMS, FSDP2).endswith(
        "the reduced gradients are non-finite in rank 0's shard only (first in body.2.weight), and every rank "
        "skipped: the skip decision was global"
    )
    table = [row(reduced_first=2, skipped=True), row(own=1, own_first=1, skipped=False)]
    assert rank_story(table, OWN, PARAMS, FSDP2).endswith("and only rank 0 skipped")


def test_the_misuse_hint_names_shardedgradscaler_for_fsdp1_with_a_plain_gradscaler():
    fsdp1 = Topology("FullyShardedDataParallel", 2, True, None)
    assert "use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler" in misuse_hint(
        fsdp1, torch.amp.GradScaler("cpu")
    )
    assert "cause scaler-misuse" in misuse_hint(FSDP2, torch.amp.GradScaler("cpu"))


def test_a_rank_row_travels_as_one_float64_tensor_and_reads_back():
    tensor = RankRow.tensor(torch.tensor(1024.0), torch.tensor(1.0), torch.tensor(12345.0), [1, 0, 1, 1, 2, 3, 4, 5])
    assert tensor.dtype == torch.float64 and tensor.numel() == RankRow.FIELDS
    assert RankRow.of(tensor.tolist()) == RankRow(1024.0, True, True, False, True, 1, 2, 3, 4, 12345.0, 5)
    failed = RankRow.of(failed_row(torch.device("cpu")).tolist())
    assert failed.failed and failed.own == -1 and not failed.stop


def test_a_checksum_tells_apart_weights_that_differ_by_one_bit():
    weights = [torch.randn(4, 3), torch.randn(3, dtype=torch.float16)]
    nudged = [weights[0].clone(), weights[1].clone()]
    nudged[1][2] = torch.nextafter(nudged[1][2], torch.tensor(10.0, dtype=torch.float16))
    same, other = parameter_checksums(weights), parameter_checksums(nudged)
    assert torch.equal(same, parameter_checksums([w.clone() for w in weights]))
    assert first_divergent([same.tolist(), other.tolist()]) == 1
    assert total_checksum(same).item() != total_checksum(other).item()
    assert first_divergent([same.tolist(), same.tolist()]) is None


def train(steps=6, observer=None):
    """A small AMP loop; its losses and final weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("broken", "what"),
    [
        (Watch, "_measure"),  # inside scaler.step
        (TrainingObserver, "_record_forward"),  # inside the model's forward hook
    ],
)
def test_a_failure_inside_the_watch_is_reported_once_and_the_training_goes_on_unchanged(
    tmp_path, monkeypatch, broken, what
):
    expected_losses, expected_weights = train()
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise ValueError("inside the watch\nand more")

    monkeypatch.setattr(broken, what, fail)
    notes: list[str] = []
    observer = TrainingObserver(WatchOptions(capsule_dir=tmp_path), on_note=notes.append)
    with observer:
        losses, weights = train()
    assert losses == expected_losses and all(torch.equal(a, b) for a, b in zip(weights, expected_weights))
    assert len(calls) == 1 and len(notes) == 1 and observer.failure is not None  # measured nothing after it
    assert notes[0] == (
        f"the watch's {observer.failure} failed (ValueError: inside the watch); the training goes on unwatched"
    )
    assert not any(tmp_path.iterdir())


def test_the_api_watch_reports_its_own_failure_as_a_warning(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("broken measurement")

    monkeypatch.setattr(Watch, "_measure", fail)
    with pytest.warns(RuntimeWarning, match="the watch's per-step measurement failed .RuntimeError: broken"):
        with fp16doctor.watch(capsule_dir=tmp_path) as watching:
            train(steps=3)
    assert watching.alarms == []


@pytest.fixture
def one_rank():
    """A process group of one rank in this process (gloo): the wrappers run, the reduction is the identity."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    let_gloo_threads_finish()  # the test's models are gone: destroying the group must not wait on gloo's thread
    dist.destroy_process_group()


def wrapped(kind):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if kind == "DDP":
        return DistributedDataParallel(model)
    if kind == "DDP, gradients as bucket views":
        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    if kind == "FSDP1":
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    fully_shard(model)
    return model


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
@pytest.mark.parametrize("kind", ["DDP", "DDP, gradients as bucket views", "FSDP1", "FSDP2"])
def test_each_wrappers_own_gradients_are_checked_before_the_reduction_and_name_the_first_module(
    tmp_path, one_rank, kind
):
    """A NaN in the batch of step 2's second micro-batch: the own gradients are non-finite from there on, named by
    the module the backward reached first (the last layer); the steps before are finite, and the numbers are the
    unwatched run's."""

    def run(observer=None):
        model = wrapped(kind)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(3)
        seen = []
        for step in range(3):
            optimizer.zero_grad()
            for micro_batch in range(2):
                x = torch.randn(4, 8, generator=g)
                if step == 2 and micro_batch == 1:
                    x[0, 0] = float("nan")
                model(x).square().mean().backward()
            optimizer.step()
            if observer is not None:
                seen.append(next(iter(observer.watches.values())).history[-1].own_nonfinite)
        return seen, [p.detach().clone() for p in model.parameters()]

    _, unwatched = run()
    alarms = []
    observer = TrainingObserver(WatchOptions(capsule_dir=tmp_path, stop_on_alarm=False), on_alarm=alarms.append)
    with observer:
        seen, weights = run(observer)
    assert seen == [False, False, True]
    for mine, theirs in zip(weights, unwatched):  # bit for bit (the NaN step made some NaN)
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
    assert [a.kind for a in alarms] == ["nonfinite"]
    assert alarms[0].message.endswith(
        "; this rank's own gradients were non-finite before the ranks reduced them (micro-batch 1, first module 2 "
        "(2.bias))"
    )


@pytest.mark.parametrize(
    ("head_policy", "own"),
    [
        ({"param_dtype": torch.float32}, ("float32", "float32", None)),  # reduced in its param_dtype
        ({"param_dtype": torch.float16, "reduce_dtype": torch.float16}, ("float16", "float16", None)),
        (
            {"param_dtype": torch.float16, "reduce_dtype": torch.float32, "output_dtype": torch.float32},
            ("float16", "float32", "float32"),
        ),
        ({"param_dtype": torch.float16, "reduce_dtype": torch.float32}, None),  # the root's own, given again
    ],
)
def test_a_modules_own_fsdp2_policy_is_recorded_as_it_takes_effect_for_the_replay(one_rank, head_policy, own):
    """A module's own policy that differs from the root's, once no reduce_dtype is read as param_dtype, is recorded
    for the replay (which applies it to that module's parameters, reduction and outputs), not said as left out; a
    user's attribute named mixed_precision is no policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fp16doctor.live.sharded_capsule import module_policies, not_emulated

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model[0].mixed_precision = "bf16"
    fully_shard(model[2], mp_policy=MixedPrecisionPolicy(**head_policy))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    keys = ("param_dtype", "reduce_dtype", "output_dtype")
    expected = {"2": {**dict(zip(keys, own)), "cast_forward_inputs": True}} if own else {}
    assert module_policies(model) == expected and not_emulated(model) == []
