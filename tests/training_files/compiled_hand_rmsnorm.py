"""Regression on raw sensor readings (hundreds of units) through an RMSNorm written by hand, LLaMA's formula without
its `.float()`, and the model compiled, as the training runs it. Eager fp16 squares the activations into inf
(|h| > 256); inductor computes the square and its mean in fp32 registers and stores only the normalised result."""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.norm = RMSNorm(64)
        self.head = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x):
        return self.head(self.norm(self.embed(x)))


def model():
    torch.manual_seed(0)
    return torch.compile(SensorNet())


def data():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(12):
        x = 200 * torch.randn(64, 16, generator=g)
        y = (x[:, :4].sum(1, keepdim=True) / 400).tanh()
        batches.append((x, y))
    return batches


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)
