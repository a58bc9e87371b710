"""Mistake: the whole model cast to fp16 with .half(), then trained with GradScaler.

"Mixed precision" done by casting the model: there are no fp32 master weights
any more, Adam's state is fp16, and GradScaler refuses the fp16 gradients
("Attempting to unscale FP16 gradients").
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 10}


def model() -> nn.Module:
    net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    return net.half()


def data():
    g = torch.Generator().manual_seed(9)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(10):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + 0.5 * torch.randn(64, 32, generator=g), y


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x.half()).float(), y)
