"""Mistake: missing values from a CSV arrive as NaN in the features.

A tabular regression (house prices, standardised) where a few rows had empty
cells: pandas reads them as NaN and nobody dropped or imputed them. The NaN
poisons the loss in fp32 as well as in AMP; under AMP the GradScaler skips the
steps silently and halves its scale each time, which looks like a loss-scale
problem but is not.
"""

import torch
from torch import nn

CONFIG = {"steps": 20}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(12, generator=g)
    batches = []
    for index in range(20):
        x = torch.randn(32, 12, generator=g)
        y = x @ w + 0.1 * torch.randn(32, generator=g)
        if index in (3, 11):
            x[5, 7] = float("nan")  # an empty "lot_size" cell
        batches.append((x, y))
    return batches


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)
