"""Mistake: a short warm-up stepped on every iteration while the GradScaler is still settling.

init_scale is set to 2^22 "for safety against underflow"; the first steps
overflow and are skipped while the scale backs off, but the scheduler steps
regardless: the optimizer's first real steps happen half-way up a warm-up it
never took.
"""

import torch
from torch import nn

CONFIG = {"steps": 40, "lr": 2e-3, "scaler": {"init_scale": 4194304.0}}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def data():
    g = torch.Generator().manual_seed(18)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(40):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + 0.5 * torch.randn(64, 32, generator=g), y


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
