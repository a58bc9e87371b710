"""Capsules of sharded runs, end to end: an FSDP2 script watched under torchrun (2 processes, gloo on CPU) alarms,
every rank captures the step together into one ``ranks_step_N`` capsule, and ``diagnose --capsule`` in a fresh
process replays that step with the ranks emulated in one process (the policy as FSDP2 applies it) and names the
fault each script was written to have, with its fix verified on the replay:

* one rank's bad batch (a NaN in rank 1's features): the data, in rank 1's part of the step;
* gradients reduce-scattered in fp16 that overflow although every rank's own gradients are finite: the reduction,
  repaired by ``reduce_dtype=float32``;
* ``param_dtype=torch.float16`` without autocast, where a hand-written RMSNorm's ``1e-8`` epsilon is 0: a fault only
  the cast parameters show (with fp32 parameters the same training is finite), repaired by keeping the norm in fp32
  as FSDP2 does it, a policy of its own.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli
from test_watch_sharded import FSDP2, SCRIPTS, outcome, torchrun

from fp16doctor.userfile.spec import load_training_file

pytestmark = pytest.mark.slow

RMSNORM = SCRIPTS / "fsdp2_rmsnorm.py"
FSDP_LM = SCRIPTS / "fsdp_lm.py"
DDP_PRICES = SCRIPTS / "ddp_prices.py"
DDP_LOOP = SCRIPTS / "ddp_loop.py"


def watched_capsule(tmp_path, script, *args, watch=()):
    """Run ``script`` watched (with ``watch``'s options too); the one capsule the ranks wrote together."""
    proc = torchrun(tmp_path, script, *args, watch=["--capsule-dir", "caps", *watch])
    assert proc.returncode == 1, outcome(proc)
    capsules = sorted((tmp_path / "caps").iterdir())
    assert len(capsules) == 1 and capsules[0].name.startswith("ranks_step_"), outcome(proc)
    assert proc.stderr.count(f"Capsule: caps/{capsules[0].name}.") == 2, outcome(proc)  # every rank's alarm line
    return capsules[0]


def diagnosed(capsule):
    proc = run_cli("diagnose", "--ci", "--json", "--capsule", capsule, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_one_ranks_bad_batch_is_replayed_from_the_ranks_capsule_and_its_data_named(tmp_path):
    capsule = watched_capsule(tmp_path, FSDP2, "--poison-rank", "1", "--poison-step", "2")
    config = json.loads((capsule / "config.json").read_text())
    assert config["sharding"] == {
        "world": 2,
        "micro_batches": 1,
        "wrapper": "fully_shard",
        "param_dtype": "float16",
        "reduce_dtype": "float32",
        "cast_forward_inputs": True,
        "autocast": False,
        "sync_each_micro_batch": True,
        "output_dtype": None,
        "module_policies": {},
    }
    top = diagnosed(capsule)["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["severity"] == "error", top
    assert top["evidence"]["ranks"] == [1], top["evidence"]  # rank 1's part of the step, not rank 0's
    assert "(rank 1's micro-batch 0)" in top["title"]
    assert top["verification"]["repaired"] is True


@pytest.mark.parametrize("step", ["0", "2"])  # while the watch is still finding the model, and after
def test_a_batch_is_captured_as_the_training_passed_it_not_as_the_policy_cast_it(tmp_path, step):
    """Rank 1's fp32 batch holds 1e6, past fp16 once FSDP2's cast_forward_inputs casts it to param_dtype: the
    capsule keeps the fp32 batch (the watch reads the inputs before FSDP's pre-forward hook), so the replay's FP32
    baseline is finite and the cause is the raw input's scale, cast by the replayed policy, not a non-finite batch."""
    capsule = watched_capsule(tmp_path, FSDP2, "--poison-rank", "1", "--poison-step", step, "--poison-value", "1e6")
    batches = torch.load(capsule / "capsule.pt", weights_only=False)["batches"]
    features = batches[1]["args"][0]
    assert features.dtype == torch.float32 and features.abs().max() == 1e6
    top = diagnosed(capsule)["findings"][0]
    assert top["cause"] == "extreme-data" and top["evidence"]["abs_max"] == 1e6, top
    assert top["verification"]["repaired"] is True


def test_an_fsdp1_ranks_bad_batch_is_captured_together_rebuilt_unwrapped_and_replayed(tmp_path):
    """FSDP1 (FullyShardedDataParallel with a MixedPrecision, each block its own unit, a ShardedGradScaler): no
    rank holds a whole flat parameter, so the ranks gather the state together; the capsule's model is the user's
    classes with the units unwrapped, and its replay divides as FSDP1 does."""
    capsule = watched_capsule(tmp_path, FSDP2, "--fsdp1", "--poison-rank", "1", "--poison-step", "2")
    sharding = json.loads((capsule / "config.json").read_text())["sharding"]
    assert sharding["wrapper"] == "fsdp1" and sharding["world"] == 2, sharding
    assert sharding["param_dtype"] == "float16" and sharding["cast_forward_inputs"] is True  # the root casts
    spec = load_training_file(capsule / "train_capsule.py")
    model = spec.model()
    names = [name for name, _ in model.named_parameters()]
    assert type(model).__name__ == "Net" and names == [n for n, _ in type(model)().named_parameters()]
    assert not any("flat_param" in n or "_fsdp_wrapped_module" in n for n, _ in model.named_modules()), names
    top = diagnosed(capsule)["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["evidence"]["ranks"] == [1], top
    assert "(rank 1's micro-batch 0)" in top["title"] and top["verification"]["repaired"] is True


TIED_LM = ["--tie", "--momentum", "0.9", "--nan-rank", "1", "--nan-step", "3"]  # one weight for both, moments


@pytest.mark.parametrize(
    ("script", "args", "unlike"),
    [
        (FSDP2, ["--poison-rank", "1", "--poison-step", "3", "--head-fp32"], []),  # its policy is replayed
        (FSDP2, ["--poison-rank", "1", "--poison-step", "3", "--fsdp1"], []),
        (FSDP2, ["--poison-rank", "1", "--poison-step", "3", "--fsdp1", "--orig-params"], []),
        (RMSNORM, ["--checkpoint-mlp"], []),  # the plain module keeps the checkpoint wrapper, whose segment DCP drops
        (FSDP_LM, [*TIED_LM, "--wrap", "fsdp2"], []),
        (FSDP_LM, [*TIED_LM, "--wrap", "fsdp1"], []),  # its buffer_dtype is said only where there are buffers
    ],
    ids=[
        "fsdp2-own-policy",
        "fsdp1",
        "fsdp1-orig-params",
        "fsdp2-activation-checkpointing",
        "fsdp2-tied",
        "fsdp1-tied",
    ],
)
def test_a_state_past_the_gather_limit_is_saved_in_shards_and_replays_as_the_gathered_one(
    tmp_path, script, args, unlike
):
    """``--gather-limit-mb 0``: no rank gathers the whole state. Each saves its own shards into the capsule
    (torch.distributed.checkpoint), whose model.pt holds the module on the meta device; read whole in another
    process, the weights and optimizer state are the gathered capsule's of the same run, bit for bit, and tied
    weights are one parameter in both, as in the run (its optimizer holds them once). The manifest says what the
    replay leaves out (``unlike``)."""
    (tmp_path / "gathered").mkdir()
    (tmp_path / "sharded").mkdir()
    gathered = watched_capsule(tmp_path / "gathered", script, *args)
    sharded = watched_capsule(tmp_path / "sharded", script, *args, watch=["--gather-limit-mb", "0"])
    assert (sharded / "sharded_state" / ".metadata").is_file() and not (gathered / "sharded_state").exists()
    assert not list((tmp_path / "sharded" / "caps").glob(".*"))  # the ranks' shards moved into the capsule
    saved = torch.load(sharded / "model.pt", weights_only=False)
    assert {p.device.type for p in saved.parameters()} == {"meta"}  # rank 0 never held the whole weights
    specs = [load_training_file(capsule / "train_capsule.py") for capsule in (gathered, sharded)]
    models = [spec.model() for spec in specs]
    states = [m.state_dict() for m in models]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    moments = [spec.optimizer(m.parameters()).state_dict() for spec, m in zip(specs, models)]
    assert moments[0]["param_groups"] == moments[1]["param_groups"]
    assert len(moments[0]["state"]) == len(moments[1]["state"]) == len(list(models[1].parameters()))  # all loaded
    for index, moment in moments[0]["state"].items():
        assert all(torch.equal(value, moments[1]["state"][index][k]) for k, value in moment.items())
    if "--tie" in args:
        assert all(m.lm_head.weight is m.embed.weight for m in models) and len(list(models[1].parameters())) == 4
    assert json.loads((sharded / "manifest.json").read_text())["not_emulated"] == unlike
    if "--head-fp32" in args:
        own = json.loads((sharded / "config.json").read_text())["sharding"]["module_policies"]
        assert own == {
            "head": {
                "param_dtype": "float32",
                "reduce_dtype": "float32",
                "output_dtype": None,
                "cast_forward_inputs": True,
            }
        }, own
        top = diagnosed(sharded)["findings"][0]  # the replay itself, once
        assert top["cause"] == "nonfinite-data" and top["evidence"]["ranks"] == [1], top


def test_micro_batches_accumulated_with_sync_off_are_recorded_so_and_one_ranks_bad_one_is_replayed(tmp_path):
    """Gradient sync off until the last micro-batch (set_requires_gradient_sync): the capsule says so itself, and
    its replay accumulates each rank's micro-batches before the one reduction, as the run did."""
    capsule = watched_capsule(
        tmp_path, FSDP2, "--poison-rank", "1", "--poison-step", "2", "--micro-batches", "2", "--sync-last-only"
    )
    sharding = json.loads((capsule / "config.json").read_text())["sharding"]
    assert sharding["micro_batches"] == 2 and sharding["sync_each_micro_batch"] is False, sharding
    top = diagnosed(capsule)["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["evidence"]["ranks"] == [1], top
    assert "(rank 1's micro-batch 0)" in top["title"] and top["verification"]["repaired"] is True


def test_ddp_micro_batches_under_no_sync_are_recorded_so(tmp_path):
    """DDP keeps its gradient-sync flag on the wrapper, not on the module the watch hooks: read there, a run that
    accumulates under no_sync() before its last micro-batch is captured as one."""
    capsule = watched_capsule(
        tmp_path, DDP_LOOP, "--fp16-compress", "--poison-rank", "1", "--poison-step", "2", "--micro-batches", "2",
        "--no-sync",
    )  # fmt: skip
    sharding = json.loads((capsule / "config.json").read_text())["sharding"]
    assert sharding["wrapper"] == "ddp" and sharding["micro_batches"] == 2, sharding
    assert sharding["sync_each_micro_batch"] is False


@pytest.mark.parametrize(
    ("wrapping", "fix_code"),
    [([], "fully_shard(module, mp_policy=MixedPrecisionPolicy("), (["--fsdp1"], "mixed_precision=MixedPrecision(")],
    ids=["fsdp2", "fsdp1"],
)
def test_an_fp16_reduce_scatter_that_overflows_is_replayed_and_reduce_dtype_fp32_repairs_it(
    tmp_path, wrapping, fix_code
):
    capsule = watched_capsule(
        tmp_path, FSDP2, *wrapping, "--param-dtype", "float32", "--reduce-dtype", "float16", "--feature-scale", "1e4",
        "--steps", "12",
    )  # fmt: skip
    manifest = json.loads((capsule / "manifest.json").read_text())
    assert manifest["skipped_before"] >= 1 and manifest["sharding"]["reduce_dtype"] == "float16"
    report = diagnosed(capsule)
    top = report["findings"][0]
    assert top["cause"] == "half-precision-reduce" and top["severity"] == "error", top
    evidence = top["evidence"]
    assert evidence["world"] == 2 and evidence["reduce_dtype"] == "float16" and evidence["nonfinite_steps"]
    assert evidence["local_max"] > 65504  # a gradient every rank held finite, past fp16's range as reduced
    assert top["fix"]["config_patch"] == {"sharding": {"reduce_dtype": "float32"}}
    assert "reduce_dtype=torch.float32" in top["fix"]["code"] and fix_code in top["fix"]["code"]
    assert top["verification"]["repaired"] is True
    localisation = next(s for s in report["stages"] if s["name"] == "localisation")
    assert "the ranks' gradient reduction" in localisation["summary"]


def test_an_epsilon_fp16_param_dtype_flushes_is_replayed_from_the_capsule_and_the_norm_kept_in_fp32(tmp_path):
    """The MLP is activation-checkpointed, as torchtitan does before fully_shard: the checkpoint's keys leave the
    wrapper's name out, and the rebuilt model keeps the wrapper."""
    fp32 = torchrun(tmp_path, RMSNORM, "--param-dtype", "float32", "--steps", "8", "--checkpoint-mlp")
    assert fp32.returncode == 0 and "nan" not in fp32.stdout, outcome(fp32)  # the same training, fp32 parameters
    capsule = watched_capsule(tmp_path, RMSNORM, "--checkpoint-mlp")
    rebuilt = load_training_file(capsule / "train_capsule.py").model()
    assert "mlp._checkpoint_wrapped_module.0.weight" in dict(rebuilt.named_parameters())
    report = diagnosed(capsule)
    top = report["findings"][0]
    assert top["cause"] == "constant-out-of-range" and top["severity"] == "error", top
    assert top["evidence"]["module"] == "norm" and top["evidence"]["constant"] == 1e-8
    assert top["evidence"]["constant_in_dtype"] == 0 and top["evidence"]["dtype"] == "float16"
    assert top["evidence"]["location"].startswith(str(RMSNORM))  # the script's line, not the capsule's own file
    assert top["verification"]["repaired"] is True
    assert (
        "fully_shard(model.get_submodule('norm'), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, "
        "output_dtype=torch.float16))" in top["fix"]["code"]
    )
    fp32_stage = next(s for s in report["stages"] if s["name"] == "fp32 baseline")
    assert "non-finite" not in fp32_stage["summary"]  # the ranks without the policy: finite


def test_a_ddp_run_with_an_fp16_compression_hook_is_captured_by_every_rank_with_the_hooks_reduction(tmp_path):
    """Replicated weights, but a reduction only the ranks make together: one capsule of every rank's batch, whose
    replay reduces as the hook does (cast to fp16, divided by the world size, summed)."""
    capsule = watched_capsule(tmp_path, DDP_PRICES)
    sharding = json.loads((capsule / "config.json").read_text())["sharding"]
    assert sharding == {
        "world": 2,
        "micro_batches": 1,
        "wrapper": "ddp",
        "param_dtype": None,
        "reduce_dtype": "float16",
        "autocast": True,
        "sync_each_micro_batch": True,
    }
    report = diagnosed(capsule)
    localisation = next(s for s in report["stages"] if s["name"] == "localisation")
    assert localisation["status"] == "ran" and report["symptoms"]  # the replay fails as the run did


def test_the_capsules_loss_is_a_ranks_non_finite_one_else_the_ranks_mean():
    from fp16doctor.live.sharded_capsule import RankStep, ranks_loss

    assert math.isnan(ranks_loss([RankStep([], None, 2.0), RankStep([], None, float("nan"))]))
    assert ranks_loss([RankStep([], None, 2.0), RankStep([], None, 4.0)]) == 3.0
    assert ranks_loss([RankStep([], None, None)]) is None
