"""What the paired benchmarks share: the spread they report, and the residual-MLP workload the watch benchmarks
train (so that their numbers are of one model)."""

from __future__ import annotations

import statistics
from typing import Any


def iqr(values: list[float]) -> float:
    """Interquartile range (inclusive quartiles: defined from two values on)."""
    if len(values) < 2:
        return float("inf")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def residual_mlp(blocks: int = 4) -> Any:
    """A pre-norm residual MLP: 64 inputs, width 256, hidden 1024, 10 classes; the blocks at ``model[1:-1]``."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(256)
            self.mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(self.norm(x))

    return nn.Sequential(nn.Linear(64, 256), *[Block() for _ in range(blocks)], nn.Linear(256, 10))
