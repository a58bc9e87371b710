"""Mistake: a warm-up that jumps straight to a peak learning rate 1000x higher.

The schedule holds 1e-4 for 8 steps, then a misplaced factor makes the
"peak" 1e-1 at step 8 (meant: reach 1e-3 gradually). The update at the jump
pushes the hidden activations past 65504: fp32 carries them (the loss just
jumps), fp16 turns them into inf.
"""

import torch
from torch import nn

CONFIG = {"steps": 16}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def data():
    g = torch.Generator().manual_seed(17)
    centers = 4 * torch.randn(10, 64, generator=g)
    for _ in range(16):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + torch.randn(64, 64, generator=g), y


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-4)


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 8 else 1000.0)
