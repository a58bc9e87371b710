"""Momentum SGD warmed up to 0.3, then a main phase 300x higher: FP32 blows up four steps after the jump.

A large-batch recipe warms SGD up linearly over six steps to 0.3; the main phase's
multiplier is 300 where 1 was meant. Each update at 90 multiplies the weights, the
gradient norm grows a billionfold a step, and FP32's gradients are NaN four steps
after the jump, 1.9e21 the step before (AMP's scaler starts skipping at once).
"""

import torch
from torch import nn

CONFIG = {"steps": 16}


def model():
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 6))


def data():
    g = torch.Generator().manual_seed(21)
    centers = torch.randn(6, 32, generator=g)
    for _ in range(16):
        y = torch.randint(0, 6, (48,), generator=g)
        yield centers[y] + 1.5 * torch.randn(48, 32, generator=g), y


def optimizer(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def scheduler(opt):
    warmup = 6
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / warmup if step < warmup else 300.0)
