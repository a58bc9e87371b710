"""Healthy: a small MLP classifier on synthetic, standardised features.

The minimal training file: model() and data() only. The default loss
(cross_entropy on (x, y) batches) and optimizer (AdamW, config lr) apply.
"""

import torch
from torch import nn

CONFIG = {"steps": 30, "lr": 1e-3}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def data():
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(30):
        y = torch.randint(0, 10, (64,), generator=g)
        x = centers[y] + 0.5 * torch.randn(64, 32, generator=g)
        yield x, y
