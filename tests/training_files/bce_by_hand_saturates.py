"""A binary cross-entropy written by hand on sigmoid probabilities: FP32's sigmoid saturates to exactly 1.0.

A click-through model with confident logits (a score head scaled by 10, as some
ranking code does). The loss is written out as -(y log p + (1 - y) log(1 - p)) on
p = sigmoid(logit): past a logit of about 17, fp32 rounds p to 1.0 and log(1 - p) is
-inf. FP32 fails at the first step, AMP too. binary_cross_entropy_with_logits (or the
same formula in float64) stays finite.
"""

import torch
from torch import nn

CONFIG = {"steps": 12}


class ClickModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        return 10.0 * self.body(x).squeeze(-1)


def model():
    return ClickModel()


def data():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(20, generator=g)
    for _ in range(12):
        x = 2.0 * torch.randn(128, 20, generator=g)
        yield x, (x @ w > 0).float()


def loss(model, batch):
    x, clicked = batch
    p = torch.sigmoid(model(x))
    return -(clicked * torch.log(p) + (1 - clicked) * torch.log(1 - p)).mean()
