"""Mistake: a "memory saver" that stores the BatchNorm layers in fp16.

The training keeps the convolutions in fp32 under autocast, but a helper
casts every BatchNorm to half "because they run on half activations anyway".
Running statistics and affine weights now live in fp16 (3 significant digits),
and the optimizer keeps their state in fp16 too.
"""

import torch
from torch import nn

CONFIG = {"steps": 20}


def save_memory(net: nn.Module) -> nn.Module:
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.half()
    return net


def model() -> nn.Module:
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )
    return save_memory(net)


def data():
    g = torch.Generator().manual_seed(10)
    patterns = torch.randn(4, 3, 12, 12, generator=g)
    for _ in range(20):
        y = torch.randint(0, 4, (16,), generator=g)
        yield patterns[y] + 0.8 * torch.randn(16, 3, 12, 12, generator=g), y
