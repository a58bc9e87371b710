"""Missing readings exported as float32's largest value: a few rows carry 3.4e38 and FP32 itself overflows.

A tabular regression of standardised sensor features. The exporter wrote the
largest float32 (3.4028235e38) where a reading was missing, a common sentinel; the
data holds no NaN, so nothing looks wrong until the first Linear multiplies that
row: inf in fp32 as in AMP, from the first affected batch on.
"""

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 16}
MISSING = torch.finfo(torch.float32).max


def model():
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(12, generator=g)
    batches = []
    for index in range(16):
        x = torch.randn(32, 12, generator=g)
        y = x @ w + 0.1 * torch.randn(32, generator=g)
        if index in (4, 9):
            x[7, 3] = MISSING  # a dropped reading
        batches.append((x, y))
    return batches


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)
