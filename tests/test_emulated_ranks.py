"""The ranks of a sharded training emulated in one process (``config.sharding``): FSDP2's arithmetic, checked
against the same step computed by hand, and what the reduction reading records."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from fp16doctor.config import ShardingConfig, build_config
from fp16doctor.engine.emulated_ranks import ReductionReading, divide_factors, emulated_ranks_step
from fp16doctor.errors import ConfigError


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _step(model, batches, sharding, policy=True, reading=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return emulated_ranks_step(
        model, batches, optimizer, scaler, contextlib.nullcontext, mse, sharding, reading=reading, policy_dtypes=policy
    )


@pytest.mark.parametrize(
    ("world", "dtype", "factors"),
    [(2, torch.float16, (2.0, 1.0)), (4, torch.float16, (2.0, 2.0)), (8, torch.float16, (4.0, 2.0))]
    + [(4, torch.float32, (1.0, 4.0)), (4, torch.bfloat16, (1.0, 4.0))],
)
def test_fp16_divides_before_and_after_the_sum_as_fsdp2_does_the_others_average(world, dtype, factors):
    assert divide_factors(world, dtype) == factors


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fsdp1_divides_before_and_after_the_sum_in_every_dtype_as_its_default_state_does(world, dtype):
    from torch.distributed.algorithms._comm_hooks import default_hooks

    pre = default_hooks.DefaultState._get_gradient_predivide_factor(world)  # what FSDP1 sets on its state
    assert divide_factors(world, dtype, "fsdp1") == (pre, world / pre)


def test_a_ddp_compression_hook_divides_by_the_world_size_before_the_sum():
    assert divide_factors(4, torch.float16, "ddp") == (4.0, 1.0)


def test_two_ranks_in_fp32_step_on_the_mean_of_their_own_gradients():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    by_hand = nn.Linear(3, 1)
    by_hand.load_state_dict(model.state_dict())
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(2)]
    with torch.no_grad():
        mean_loss = sum(float(mse(by_hand, b)) for b in batches) / 2  # the global batch's, before the step
    loss = _step(model, batches, ShardingConfig(world=2))
    grads = []
    for batch in batches:
        by_hand.zero_grad()
        mse(by_hand, batch).backward()
        grads.append([p.grad.clone() for p in by_hand.parameters()])
    with torch.no_grad():
        for p, g0, g1 in zip(by_hand.parameters(), *grads):
            p -= 0.1 * (g0 + g1) / 2
    for ours, theirs in zip(model.parameters(), by_hand.parameters()):
        torch.testing.assert_close(ours, theirs)
    assert float(loss) == pytest.approx(mean_loss)


def test_an_fp16_reduction_breaks_a_gradient_every_rank_held_finite_and_the_reading_says_which():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    big = (torch.full((4, 2), 300.0), torch.full((4, 1), -300.0))  # d loss / d w = 2 * 900 * 300: past 65504
    reading = ReductionReading()
    _step(model, [big, big], ShardingConfig(world=2, reduce_dtype="float16"), reading=reading)
    assert reading.worst() == "weight" and reading.nonfinite_steps["weight"] == [0]
    assert reading.local_max["weight"] > 65504 and not reading.local_nonfinite_steps
    assert not torch.isfinite(model.weight).all()  # no scaler: the step applied what the reduction made

    fp32 = nn.Linear(2, 1)
    fp32.load_state_dict({"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
    _step(fp32, [big, big], ShardingConfig(world=2, reduce_dtype="float16"), policy=False)
    assert torch.isfinite(fp32.weight).all()  # the FP32 baseline: the same ranks, no policy


def test_param_dtype_casts_the_parameters_so_every_op_runs_in_it():
    seen = []
    model = nn.Linear(2, 2)
    model.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
    batch = (torch.randn(3, 2).half(), torch.randn(3, 2))
    _step(model, [batch, batch], ShardingConfig(world=2, param_dtype="float16"))
    assert seen == [(torch.float16, torch.float16)] * 2 and model.weight.dtype == torch.float32  # master stays fp32


def test_the_sharding_keys_are_checked():
    assert build_config({"sharding": {"world": 2, "param_dtype": "bfloat16"}}).sharding.emulated
    with pytest.raises(ConfigError, match="sharding.reduce_dtype"):
        build_config({"sharding": {"reduce_dtype": "half"}})
    with pytest.raises(ConfigError, match="sharding.world"):
        build_config({"sharding": {"world": 0}})


def test_a_tied_head_runs_in_param_dtype_with_its_embedding_and_both_uses_reach_the_gradient():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens)).float()

    seen = []
    model = Tied()
    model.head.register_forward_hook(lambda m, args, out: seen.append(m.weight.dtype))
    batch = (torch.tensor([[1, 2]]), torch.zeros(1, 2, 5))
    _step(model, [batch, batch], ShardingConfig(world=2, param_dtype="bfloat16"))
    assert seen == [torch.bfloat16] * 2


def test_a_capsules_recorded_streak_lengthens_the_leading_skips_and_nothing_else():
    import pandas as pd

    from fp16doctor.measure.symptoms import skip_profile

    records = pd.DataFrame(
        {
            "step": range(6),
            "skipped": [True, False, False, True, False, False],
            "exception_type": [None] * 6,
            "micro_step": [False] * 6,
            "optimizer_stepped": [False, True, True, False, True, True],
        }
    )
    alone, resumed = skip_profile(records), skip_profile(records, skipped_before=3)
    assert (alone["leading"], resumed["leading"]) == (1, 4)
    assert resumed["after_settling"] == alone["after_settling"] == 1 and resumed["settled"]


def test_bf16_tried_on_emulated_ranks_makes_the_policys_fp16_dtypes_bf16_so_the_ops_run_in_bf16():
    """Under FSDP the policy casts the parameters: bf16 autocast over fp16 parameters still overflows, so the bf16
    candidate changes the policy too, and its fix is said as an FSDP2 policy."""
    from fp16doctor.config import merge
    from fp16doctor.diagnosis.findings import Finding, Fix
    from fp16doctor.diagnosis.sharded import as_sharded, bf16_patch

    sharded = {"sharding": {"world": 2, "param_dtype": "float16", "reduce_dtype": "float16"}}
    patch = bf16_patch(build_config(sharded).sharding)
    assert patch["dtype"] == "bfloat16" and patch["scaler"] == {"enabled": False}
    assert patch["sharding"] == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    assert "sharding" not in bf16_patch(ShardingConfig())  # one process: autocast's dtype is the whole change
    patched = build_config(merge(sharded, patch)).sharding

    def overflowing_step(sharding):
        model = nn.Linear(4, 4, bias=False)
        nn.init.constant_(model.weight, 300.0)
        batch = (torch.full((2, 4), 300.0), torch.zeros(2, 4))
        _step(model, [batch, batch], sharding)
        return model.weight

    assert not torch.isfinite(overflowing_step(build_config(sharded).sharding)).all()  # 4 * 300 * 300 > 65504
    assert torch.isfinite(overflowing_step(patched)).all()
    finding = Finding("activation-overflow", "error", "overflow", None, Fix("Train in bf16.", config_patch=patch))
    code = as_sharded(finding, build_config(sharded).sharding).fix.code
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)" in code


def test_the_models_inputs_are_cast_to_param_dtype_and_a_kept_modules_to_fp32_as_fsdp2_casts_forward_inputs():
    seen = {}
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, args[0].dtype))
    batch = (torch.randn(3, 2), torch.randn(3, 2))  # fp32, as a DataLoader hands it
    sharding = ShardingConfig(world=2, param_dtype="float16", autocast=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    emulated_ranks_step(
        model, [batch, batch], optimizer, scaler, contextlib.nullcontext, mse, sharding, fp32_modules=("1",)
    )
    assert seen == {"0": torch.float16, "1": torch.float32}
    off = ShardingConfig(world=2, param_dtype="float16", autocast=False, cast_forward_inputs=False)
    with pytest.raises(RuntimeError, match="dtype"):  # as FSDP2 without the cast: an fp32 input to fp16 weights
        _step(nn.Linear(2, 2), [batch, batch], off)


@pytest.mark.parametrize(
    "sync_each, reduce_dtype, finite", [(True, None, True), (False, None, False), (False, "float32", True)]
)
def test_micro_batches_are_reduced_one_by_one_into_fp32_unless_sync_waits_for_the_last(sync_each, reduce_dtype, finite):
    """Two micro-batches of gradient 4e4 each: reduced after each backward (FSDP2's default), each result lands in
    the fp32 sharded gradient (8e4, finite); with sync off they first add up on the rank, in fp16 past 65504, but in
    an fp32 reduce_dtype (FSDP2's unsharded accumulated gradient) within range."""
    model = nn.Linear(1, 1, bias=False)
    batch = torch.full((1, 1), 4e4)
    sharding = ShardingConfig(
        world=2,
        micro_batches=2,
        param_dtype="float16",
        reduce_dtype=reduce_dtype,
        sync_each_micro_batch=sync_each,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    reading = ReductionReading()
    emulated_ranks_step(
        model,
        [batch] * 4,
        optimizer,
        scaler,
        contextlib.nullcontext,
        lambda m, b: m(b).sum(),
        sharding,
        reading=reading,
    )
    assert bool(torch.isfinite(model.weight.grad).all()) is finite
    if finite:
        assert model.weight.grad.item() == pytest.approx(
            8e4, rel=1e-3
        )  # the mean over ranks, summed over micro-batches
    else:
        assert reading.local_nonfinite_steps == {"weight": [0]}  # the rank's own accumulation overflowed


@pytest.mark.parametrize("wrapper, finite", [("ddp", True), ("fully_shard", False)])
def test_with_sync_off_ddp_adds_micro_batches_up_in_fp32_and_its_hook_compresses_the_sum(wrapper, finite):
    """Micro-batch gradients +7e4 and -7e4 with an fp16 reduction and sync off until the last: DDP adds them up in
    .grad (fp32: 0) and its compression hook casts the sum; FSDP2 keeps them unsharded in its fp16 reduce_dtype,
    where 7e4 is already inf."""
    model = nn.Linear(1, 1, bias=False)
    plus, minus = torch.full((1, 1), 7e4), torch.full((1, 1), -7e4)
    sharding = ShardingConfig(
        world=2, micro_batches=2, wrapper=wrapper, reduce_dtype="float16", sync_each_micro_batch=False, autocast=False
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    emulated_ranks_step(
        model, [plus, minus] * 2, optimizer, scaler, contextlib.nullcontext, lambda m, b: m(b).sum(), sharding
    )
    assert bool(torch.isfinite(model.weight.grad).all()) is finite


def test_each_step_of_emulated_ranks_takes_batches_of_its_own(training_file):
    """world x micro_batches batches a step, drawn for every step: the ranks never see a batch twice in a run."""
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.userfile.spec import load_training_file

    path = training_file(
        """
        import torch
        def model():
            return torch.nn.Linear(2, 1)
        def data():
            for i in range(100):
                yield torch.full((1, 2), float(i)), torch.zeros(1, 1)
        """
    )
    config = build_config({"steps": 3, "device": "cpu", "sharding": {"world": 2, "micro_batches": 2}})
    bench = Workbench(load_training_file(path), config)
    probe = bench.probe("fp32", config, instruments=None)
    seen = []
    for _ in range(3):
        index, batches = probe.batch_at_cursor()
        seen += [int(x[0, 0]) for x, _ in batches]
        probe.step()
    probe.close()
    assert seen == list(range(12))


def test_a_modules_own_policy_casts_its_parameters_inputs_outputs_and_reduction_as_fsdp2_does():
    """fully_shard(model[1], mp_policy=MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=..., output_dtype=fp16))
    under a root policy of fp16: its parameters and inputs run in fp32, its outputs leave in fp16, and its
    gradients are reduced in its own reduce_dtype, the rest in the root's."""
    seen = {}
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for name, module in model.named_children():
        module.register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (m.weight.dtype, args[0].dtype, out.dtype))
        )
    batch = (torch.randn(3, 2), torch.randn(3, 2))
    own = {"param_dtype": "float32", "reduce_dtype": "float32", "output_dtype": "float16"}
    root = {"param_dtype": "float16", "reduce_dtype": "float16", "autocast": False}
    outputs = []

    def loss(model, batch):
        out = model(batch[0])
        outputs.append(out.dtype)
        return ((out.float() - batch[1]) ** 2).mean()

    sharding = ShardingConfig(world=2, **root, module_policies={"1": own})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    emulated_ranks_step(
        model, [batch, batch], optimizer, torch.amp.GradScaler("cpu", enabled=False), contextlib.nullcontext, loss,
        sharding,
    )  # fmt: skip
    # the hooks see a module's output before its policy's cast, which the loss then receives
    assert seen == {"0": (torch.float16,) * 3, "1": (torch.float32,) * 3} and outputs == [torch.float16] * 2

    def reduced(policy):  # a gradient of about 2e5 on the second layer's weight: past fp16, within fp32
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        with torch.no_grad():
            net[0].weight.fill_(10.0)
            net[1].weight.fill_(10.0)
        big = (torch.full((3, 2), 3.0), torch.full((3, 2), -1e3))
        reading = ReductionReading()
        sharding = ShardingConfig(world=2, param_dtype="float32", reduce_dtype="float16", module_policies=policy)
        _step(net, [big, big], sharding, reading=reading)
        return reading

    fp16_everywhere = reduced({})
    assert "1.weight" in fp16_everywhere.nonfinite_steps and fp16_everywhere.local_max["1.weight"] > 65504
    own_fp32 = reduced({"1": {"param_dtype": "float32", "reduce_dtype": "float32"}})
    assert "1.weight" not in own_fp32.nonfinite_steps and "0.weight" in own_fp32.nonfinite_steps
