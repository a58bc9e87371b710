"""The ranks of a torchrun run, compared at the one point every rank reaches each step: ``GradScaler.update()``.

Each rank says, in one all-gather of a row of numbers: its loss scale; whether it skipped the step (the found-inf
its scaler used); whether it raised an alarm and stops; whether its watch failed; whether its own gradients were
non-finite before the ranks reduced them, and where first; where its reduced gradients first were; and every
``checksum_every`` steps a checksum of the parameters every rank holds whole. From the rows every rank reads the
same verdicts:

* ranks that disagree on the scale or the skip (a scaler deciding on each rank's own shard);
* replicated parameters that differ across ranks (``rank-divergence``), the first named from a second all-gather
  of each parameter's checksum, made only then;
* each rank's story of a non-finite step: a rank's own non-finite gradient (its micro-batch and first parameter),
  told apart from a reduction that overflowed although every rank's own gradients were finite.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

from .sharding import Topology

CHECKSUM_MODULUS = 1 << 52
"""Checksums travel as float64, exact below 2^53."""

_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RankRow:
    """What one rank said at one ``update()``."""

    scale: float
    skipped: bool
    stop: bool
    """It raised an alarm and stops (every rank stops with it)."""
    failed: bool
    """Its watch failed: the ranks are compared no more."""
    alarmed: bool
    """It raised an alarm at this step (stopping or not)."""
    own: int
    """Its own gradients before the reduction: 1 non-finite, 0 finite, -1 not measured."""
    own_micro_batch: int
    own_first: int
    """Index of the first non-finite own gradient in the rank's list of measured parameters; -1: none."""
    reduced_first: int
    """Index of the first non-finite reduced gradient among the optimizer's parameters; -1: none."""
    checksum: float
    checksummed: int
    """How many replicated parameters the checksum covers (0: none taken this step)."""

    FIELDS = 11

    @staticmethod
    def tensor(scale: torch.Tensor, skipped: torch.Tensor, checksum: torch.Tensor, rest: list[float]) -> torch.Tensor:
        """This rank's row (float64, on the scale's device): the device values need no synchronisation here."""
        device = scale.device
        head = [t.detach().to(device=device, dtype=torch.float64).reshape(1) for t in (scale, skipped)]
        flags = torch.tensor(rest[:7], dtype=torch.float64, device=device)  # stop ... reduced_first
        tail = torch.tensor(rest[7:], dtype=torch.float64, device=device)  # checksummed
        return torch.cat([*head, flags, checksum.to(device=device, dtype=torch.float64).reshape(1), tail])

    @classmethod
    def of(cls, values: list[float]) -> RankRow:
        return cls(
            scale=values[0],
            skipped=values[1] > 0,
            stop=values[2] > 0,
            failed=values[3] > 0,
            alarmed=values[4] > 0,
            own=int(values[5]),
            own_micro_batch=int(values[6]),
            own_first=int(values[7]),
            reduced_first=int(values[8]),
            checksum=values[9],
            checksummed=int(values[10]),
        )


def failed_row(device: torch.device) -> torch.Tensor:
    """The row of a rank whose watch failed before it could say anything else."""
    zero = torch.zeros((), device=device)
    return RankRow.tensor(zero, zero, zero, [0, 1, 0, -1, 0, -1, -1, 0])


def gather(tensor: torch.Tensor, timeout_s: float | None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (an all-gather), waiting at most ``timeout_s`` (None: the process group's own
    timeout). A wait that times out or fails raises ``RuntimeError``, as the process group does."""
    import torch.distributed as dist

    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    work = dist.all_gather(rows, tensor, async_op=True)
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    return rows


def parameter_checksums(params: list[torch.Tensor]) -> torch.Tensor:
    """Each parameter's checksum: the sum of its values' bits read as integers (int64; any changed bit changes it,
    bar a compensating change elsewhere). On the device: no synchronisation."""
    if not params:
        return torch.zeros(0, dtype=torch.int64)
    sums = []
    for p in params:
        flat = p.detach().reshape(-1)
        sums.append(flat.view(_INT_VIEWS[flat.element_size()]).sum(dtype=torch.int64))
    return torch.stack(sums)


def total_checksum(checksums: torch.Tensor) -> torch.Tensor:
    """One number for all of them, exact in float64."""
    return torch.remainder(checksums.sum(), CHECKSUM_MODULUS).double()


def first_divergent(per_rank: list[list[int]]) -> int | None:
    """The first parameter whose checksum differs across the ranks."""
    for index, values in enumerate(zip(*per_rank)):
        if len(set(values)) > 1:
            return index
    return None


def first_module(parameter: str) -> str:
    """``first module head (head.bias)``: where a parameter's gradient is, by its module and its own name."""
    module = parameter.rpartition(".")[0]
    return f"first module {module} ({parameter})" if module else f"first parameter {parameter}"


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def disagreement_text(table: list[RankRow]) -> str:
    """What each rank decided, for a disagreement."""
    return ", ".join(
        f"rank {r}: scale {row.scale:g}, {'found inf, skipped' if row.skipped else 'stepped'}"
        for r, row in enumerate(table)
    )


def misuse_hint(topology: Topology | None, scaler: Any) -> str:
    """Why ranks disagree on a skip, and the fix that makes the decision global."""
    if (
        topology is not None
        and topology.wrapper == "FullyShardedDataParallel"
        and type(scaler).__name__ == "GradScaler"
    ):
        fix = (
            "use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which all-reduces the found-inf so "
            "that every rank skips together"
        )
    else:
        fix = "make the decision global: all-reduce the found-inf across the ranks before stepping (ShardedGradScaler)"
    return (
        f"a {type(scaler).__name__} that decides on each rank's own gradients lets the ranks' weights drift apart "
        f"(cause scaler-misuse): {fix}"
    )


def rank_story(
    table: list[RankRow], own_names: list[str], param_names: list[str], topology: Topology | None
) -> str | None:
    """Where a non-finite step's gradients went non-finite: a rank's own (before the reduction) or the reduction's.

    None where nothing was non-finite, or the ranks' own gradients were not measured."""
    own_bad = [r for r, row in enumerate(table) if row.own == 1]
    reduced_bad = [r for r, row in enumerate(table) if row.reduced_first >= 0]
    finite = [r for r, row in enumerate(table) if row.own == 0]

    def own_name(row: RankRow) -> str:
        return own_names[row.own_first] if 0 <= row.own_first < len(own_names) else "?"

    def param_name(row: RankRow) -> str:
        return param_names[row.reduced_first] if 0 <= row.reduced_first < len(param_names) else "?"

    parts: list[str] = []
    if own_bad:
        told = [
            f"rank {r}'s own gradients were non-finite before the ranks reduced them (micro-batch "
            f"{table[r].own_micro_batch}, {first_module(own_name(table[r]))})"
            for r in own_bad
        ]
        parts.append("; ".join(told))
        if finite:
            parts.append(f"{ranks_text(finite)}'s were finite: a batch of {ranks_text(own_bad)}'s, not the reduction")
    elif reduced_bad and len(finite) == len(table):
        how = topology.half_reduction if topology is not None and topology.half_reduction else "in fp32"
        parts.append(
            f"every rank's own gradients were finite before the reduction and the reduced ones are not: the "
            f"reduction overflowed ({how}, world size {len(table)}; first in {param_name(table[reduced_bad[0]])})"
        )
    if not parts:
        return None
    if topology is not None and topology.sharded and reduced_bad and len(reduced_bad) < len(table):
        skipped = [r for r, row in enumerate(table) if row.skipped]
        shards = f"the reduced gradients are non-finite in {ranks_text(reduced_bad)}'s shard only"
        decided = (
            "and every rank skipped: the skip decision was global"
            if len(skipped) == len(table)
            else f"and only {ranks_text(skipped) if skipped else 'no rank'} skipped"
        )
        parts.append(f"{shards} (first in {param_name(table[reduced_bad[0]])}), {decided}")
    return "; ".join(parts)
