"""Mistake: a loss-scale config "hardened" against underflow: init_scale 2^32, gentle backoff 0.9.

Meant to keep small gradients alive, it makes every backward overflow: with a
backoff of 0.9 the scale needs over a hundred skipped steps to come down, and
the optimizer does not move in the meantime.
"""

import torch
from torch import nn

CONFIG = {"steps": 20, "scaler": {"init_scale": 4294967296.0, "backoff_factor": 0.9}}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def data():
    g = torch.Generator().manual_seed(14)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(20):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + 0.5 * torch.randn(64, 32, generator=g), y
