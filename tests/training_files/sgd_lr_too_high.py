"""A regression MLP trained with momentum SGD at a constant learning rate of 0.5: too high for it, so FP32 diverges
as well (its outputs reach 1e19 and the squared error leaves fp32's range, with every gradient still finite the
step before). No schedule event to blame: the rate itself is the fault, and a tenth of it trains in both
precisions."""

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 30}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))


def data():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 1, generator=g)
    for _ in range(30):
        x = torch.randn(128, 16, generator=g)
        yield x, x @ w + 0.1 * torch.randn(128, 1, generator=g)


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)
