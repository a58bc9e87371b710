"""Mistake: growth_interval 4, set "so the scale recovers quickly after a backoff".

The scale doubles after every 4 clean steps, overflows, halves, and doubles
again: a skipped step every few steps for the whole run.
"""

import torch
from torch import nn

CONFIG = {"steps": 40, "scaler": {"init_scale": 1048576.0, "growth_interval": 4}}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def data():
    g = torch.Generator().manual_seed(16)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(40):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + 0.5 * torch.randn(64, 32, generator=g), y
