"""Model bug: a Poisson rate from a ReLU, then log(rate): log(0) = -inf.

A count regression (events per hour) whose output layer uses ReLU to keep the
rate non-negative; the Poisson negative log-likelihood then takes log(rate)
and every rate the ReLU clamps to 0 gives -inf. It fails in fp32 exactly as
in AMP: not a mixed-precision problem (softplus or exp would be the fix).
"""

import torch
from torch import nn

CONFIG = {"steps": 10}


class RateModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x)).squeeze(-1)


def model() -> nn.Module:
    return RateModel()


def data():
    g = torch.Generator().manual_seed(8)
    for _ in range(10):
        x = torch.randn(64, 8, generator=g)
        yield x, torch.poisson(torch.full((64,), 3.0), generator=g)


def loss(model, batch):
    x, counts = batch
    rate = model(x)
    return (rate - counts * torch.log(rate)).mean()
