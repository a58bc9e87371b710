"""Healthy: a small CNN with BatchNorm on synthetic 16x16 images, SGD with momentum and a step LR schedule.

Shows the optional optimizer() and scheduler() hooks of the contract.
"""

import torch
from torch import nn

CONFIG = {"steps": 30}


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4),
    )


def data():
    g = torch.Generator().manual_seed(2)
    patterns = torch.randn(4, 3, 16, 16, generator=g)
    batches = []
    for _ in range(30):
        y = torch.randint(0, 4, (32,), generator=g)
        x = patterns[y] + 0.8 * torch.randn(32, 3, 16, 16, generator=g)
        batches.append((x, y))
    return batches


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
