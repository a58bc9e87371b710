"""A regression written the way a user wrote it: the loss function is called `loss_fn`, not the contract's
`loss(model, batch)`. The doctor cannot read it under that name and trains with its default loss,
cross_entropy(model(x), y): over the model's single output that is exactly 0 at every step, and the
diagnosis, without a warning, would call a training that trains nothing healthy."""

import torch
from torch import nn
import torch.nn.functional as F


def model():
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))  # one output: a regression head


def data():
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        x = torch.randn(32, 6, generator=g)
        y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(32, 1, generator=g)  # a target per row, shape (32, 1)
        batches.append((x, y))
    return batches


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)


CONFIG = {"steps": 20}
