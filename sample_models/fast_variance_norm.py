"""Mistake: a hand-rolled normalisation computing the variance as E[x^2] - E[x]^2.

The "one pass" variance is cheap but cancels catastrophically when the mean
is large against the spread. The features here carry a large offset (a
sensor reading around 40 with small variations), the first linear layer keeps
it, and under autocast ``x * x`` and ``mean`` run in fp16, whose spacing at
100 is 0.06: the variance of the small variations is lost in rounding. No NaN
(the variance is clamped), but AMP quietly trails FP32.
"""

import torch
from torch import nn

CONFIG = {"steps": 30, "lr": 2e-3}


class FastNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x * x).mean(-1, keepdim=True) - mean * mean).clamp(min=self.eps)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.norm = FastNorm(64)
        self.out = nn.Sequential(nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x))).squeeze(-1)


def model() -> nn.Module:
    torch.manual_seed(0)
    net = Regressor()
    with torch.no_grad():
        net.inp.bias.fill_(10.0)  # the reading's offset flows through the first layer
    return net


def data():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, generator=g)
    for _ in range(30):
        x = torch.randn(64, 16, generator=g)
        yield x, (x @ w).sin()


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
