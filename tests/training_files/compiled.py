"""model() returns torch.compile(net, backend="eager"), as people write it for speed."""

import torch
from torch import nn

CONFIG = {"steps": 10}


def model():
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    return torch.compile(net, backend="eager")


def data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(10)]
