"""Temperature sensors in kelvin (~300 K) through a hand-written input normalisation: the mean of x * x, then the
variance. Trained with AMP the features arrive in fp32 and autocast leaves these element-wise ops in fp32; served in
pure fp16 the inputs are fp16, 300 * 300 is past 65504, and the normalised features are NaN."""

import torch
from torch import nn


class InputNorm(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(0) + self.eps)


class Forecaster(nn.Module):
    def __init__(self, sensors=16, width=64):
        super().__init__()
        self.norm = InputNorm()
        self.mlp = nn.Sequential(nn.Linear(sensors, width), nn.GELU(), nn.Linear(width, 1))

    def forward(self, x):
        return self.mlp(self.norm(x)).squeeze(-1)


def model():
    torch.manual_seed(0)
    return Forecaster()


def data():
    g = torch.Generator().manual_seed(1)
    return [(290 + 20 * torch.rand(32, 16, generator=g), torch.randn(32, generator=g)) for _ in range(8)]


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)
