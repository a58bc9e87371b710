"""Fixes said the way a sharded training makes them: a sharded run's capsule replays its ranks emulated
(``config.sharding``), and a fix the doctor tries as a config key has an FSDP2 form the user writes instead.

Keeping a module in fp32 (``overrides.fp32_modules``) is, under FSDP2, a ``fully_shard`` of that module with a
policy of its own, made before its parent's: its parameters gathered in fp32, its inputs cast up
(``cast_forward_inputs``) and its outputs back to the parents' dtype (``output_dtype``), as the emulation computes
it (:mod:`fp16doctor.engine.emulated_ranks`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import ShardingConfig, config_patch, merge, scaler_patch, sharding_patch
from .findings import Finding


def bf16_patch(sharding: ShardingConfig) -> dict[str, Any]:
    """Training in bf16: autocast's dtype, no loss scaling; with emulated ranks, the policy's fp16 dtypes made bf16
    too. FSDP's policy casts the parameters themselves, so with ``param_dtype`` fp16 kept every op would still run in
    fp16 and "bf16" would be tried as a change that changes nothing."""
    patch = config_patch(scaler_patch(enabled=False), dtype="bfloat16")
    if not sharding.emulated:
        return patch
    halves = {key: "bfloat16" for key in ("param_dtype", "reduce_dtype") if getattr(sharding, key) == "float16"}
    return merge(patch, sharding_patch(**halves)) if halves else patch


def as_sharded(finding: Finding, sharding: ShardingConfig) -> Finding:
    """``finding`` with its fix's code in FSDP2's terms where the replay emulated sharded ranks; else itself."""
    if not sharding.emulated:
        return finding
    policy = finding.fix.config_patch.get("sharding", {})
    if finding.fix.config_patch.get("dtype") == "bfloat16" and "param_dtype" in policy:
        dtypes = ", ".join(f"{key}=torch.{policy[key]}" for key in ("param_dtype", "reduce_dtype") if key in policy)
        code = f"fully_shard(model, mp_policy=MixedPrecisionPolicy({dtypes}))  # and no GradScaler: bf16 needs none"
        return replace(finding, fix=replace(finding.fix, code=code))
    modules = finding.fix.config_patch.get("overrides", {}).get("fp32_modules")
    if not modules:
        return finding
    back = f", output_dtype=torch.{sharding.param_dtype}" if sharding.param_dtype else ""
    lines = [
        f"fully_shard(model.get_submodule({path!r}), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32{back}))"
        for path in modules
    ]
    code = "# under FSDP2: each module its own fp32 policy, sharded before its parent\n" + "\n".join(lines)
    code += "\n" + "fully_shard(model, mp_policy=policy)  # the rest as before"
    fix = replace(finding.fix, code=f"{finding.fix.code}\n{code}" if finding.fix.code else code)
    return replace(finding, fix=fix)


def rank_of(batch: int, sharding: ShardingConfig) -> tuple[int, int]:
    """Which rank's micro-batch a replay's batch is (rank, its micro-batch): a step takes ``world`` runs of
    ``micro_batches`` batches, rank by rank."""
    within = batch % (sharding.world * sharding.micro_batches)
    return within // sharding.micro_batches, within % sharding.micro_batches


def batch_place(batch: int | None, sharding: ShardingConfig) -> str:
    """``batch 1``, and with emulated ranks ``batch 1 (rank 1's micro-batch 0)``."""
    if batch is None or not sharding.emulated:
        return f"batch {batch}"
    rank, micro = rank_of(batch, sharding)
    return f"batch {batch} (rank {rank}'s micro-batch {micro})"


def ranks_of(batches: list[int], sharding: ShardingConfig) -> list[int] | None:
    """The ranks whose micro-batches ``batches`` are (None without emulated ranks)."""
    return sorted({rank_of(b, sharding)[0] for b in batches}) if sharding.emulated else None
