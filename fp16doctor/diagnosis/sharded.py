"""Fixes said the way a sharded training makes them: a sharded run's capsule replays its ranks emulated
(``config.sharding``), and a fix the doctor tries as a config key has an FSDP2 form the user writes instead.

Keeping a module in fp32 (``overrides.fp32_modules``) is, under FSDP2, a ``fully_shard`` of that module with a
policy of its own, made before its parent's: its parameters gathered in fp32, its inputs cast up
(``cast_forward_inputs``) and its outputs back to the parents' dtype (``output_dtype``), as the emulation computes
it (:mod:`fp16doctor.engine.emulated_ranks`).
"""

from __future__ import annotations

from dataclasses import replace

from ..config import ShardingConfig
from .findings import Finding


def as_sharded(finding: Finding, sharding: ShardingConfig) -> Finding:
    """``finding`` with its fix's code in FSDP2's terms where the replay emulated sharded ranks; else itself."""
    modules = finding.fix.config_patch.get("overrides", {}).get("fp32_modules")
    if not sharding.emulated or not modules:
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
