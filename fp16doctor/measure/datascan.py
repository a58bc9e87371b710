"""Stage 1: scanning the batches the probes use.

Per tensor field (``"0"``, ``"input_ids"``, ``"x.pixels"``): NaN and inf counts
with the first batch and position, the abs max, the share of values beyond
the fp16 maximum, the share of *extreme* values (raw, unnormalised features
in the thousands and up: one layer multiplies them through to beyond 65504),
and non-zero values below fp16's smallest subnormal. Integer fields (token
ids, labels) are counted but never called extreme: they are not features.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..tensors import FP16_MAX, FP16_MIN_SUBNORMAL, dtype_name
from ..userfile.batches import iter_tensors
from .thresholds import EXTREME_INPUT, IGNORE_INDEX


@dataclass
class FieldScan:
    """What one batch field holds, over all scanned batches."""

    field: str
    dtype: str
    floating: bool
    numel: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    abs_max: float = 0.0
    over_fp16_max: int = 0
    extreme: int = 0
    below_fp16_subnormal: int = 0
    nonzero: int = 0
    first_nonfinite: dict[str, Any] | None = None
    """{"batch": i, "position": [...], "value": "nan"} of the first non-finite value."""
    nonfinite_batches: list[int] = dataclasses.field(default_factory=list)
    ignored_only_batches: list[int] = dataclasses.field(default_factory=list)
    """Integer fields: batches in which every value equals IGNORE_INDEX (no valid target at all)."""
    valid_counts: list[int] = dataclasses.field(default_factory=list)
    """Integer fields: per scanned batch, the values that are not IGNORE_INDEX (valid targets, for label fields)."""

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def extreme_share(self) -> float:
        return self.extreme / self.numel if self.numel else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["extreme_share"] = self.extreme_share
        out["abs_max"] = self.abs_max if math.isfinite(self.abs_max) else None
        return out


def scan_batches(batches: list[Any]) -> list[FieldScan]:
    """Scan every tensor field of every batch (each distinct batch once)."""
    fields: dict[str, FieldScan] = {}
    seen: set[int] = set()
    for index, batch in enumerate(batches):
        if id(batch) in seen:  # a short dataset is cycled: the same batch object again
            continue
        seen.add(id(batch))
        for name, tensor in iter_tensors(batch):
            scan = fields.setdefault(name, FieldScan(name, dtype_name(tensor.dtype), tensor.is_floating_point()))
            _scan_tensor(scan, tensor.detach(), index)
    return list(fields.values())


def _count_targets(scan: FieldScan, t: torch.Tensor, batch: int) -> None:
    """Valid targets per batch of an integer field (values other than IGNORE_INDEX, the loss's padding)."""
    ignored = t == IGNORE_INDEX
    scan.valid_counts.append(int((~ignored).sum()))
    if bool(ignored.all()):
        scan.ignored_only_batches.append(batch)


def _scan_tensor(scan: FieldScan, t: torch.Tensor, batch: int) -> None:
    scan.numel += t.numel()
    if not t.is_floating_point() or not t.numel():
        if t.numel() and not t.is_complex() and t.dtype != torch.bool:
            scan.abs_max = max(scan.abs_max, float(t.abs().max()))
            _count_targets(scan, t, batch)
        return
    x = t.double()
    nan, pos, neg = torch.isnan(x), x == math.inf, x == -math.inf
    bad = nan | pos | neg
    scan.nan += int(nan.sum())
    scan.posinf += int(pos.sum())
    scan.neginf += int(neg.sum())
    if bad.any():
        scan.nonfinite_batches.append(batch)
        if scan.first_nonfinite is None:
            position = [int(i) for i in torch.nonzero(bad)[0]]
            value = "nan" if bool(nan.reshape(-1)[bad.reshape(-1).nonzero()[0]]) else "inf"
            scan.first_nonfinite = {"batch": batch, "position": position, "value": value}
    a = x.abs()[~bad]
    if a.numel():
        scan.abs_max = max(scan.abs_max, float(a.max()))
        scan.over_fp16_max += int((a > FP16_MAX).sum())
        scan.extreme += int((a >= EXTREME_INPUT).sum())
        scan.below_fp16_subnormal += int(((a > 0) & (a < FP16_MIN_SUBNORMAL)).sum())
        scan.nonzero += int((a > 0).sum())
