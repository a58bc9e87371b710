"""A schedule whose main phase starts far above its warm-up: FP32 diverges at the jump too.

SGD warms up at 1e-3 for 6 steps, then a misplaced factor sets the main phase to 300.
The first update at the new rate blows the weights up, in FP32 as in AMP. The
vague answer would be "FP32 fails: data, LR or model"; the precise one is the jump.
"""

import torch
from torch import nn

CONFIG = {"steps": 14}


def model():
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 6))


def data():
    g = torch.Generator().manual_seed(21)
    centers = 3 * torch.randn(6, 32, generator=g)
    for _ in range(14):
        y = torch.randint(0, 6, (48,), generator=g)
        yield centers[y] + torch.randn(48, 32, generator=g), y


def optimizer(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 6 else 3e5)
