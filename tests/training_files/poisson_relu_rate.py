"""Model bug: a Poisson rate from a ReLU head, scored with torch.distributions: log(0) in fp32, whatever is tried.

Calls per hour at a support desk: the head keeps the rate non-negative with a ReLU,
and the likelihood comes from torch.distributions.Poisson. Every rate the ReLU
clamps to 0 makes log_prob -inf (or NaN where the count is 0 too), in fp32, fp64 and
AMP alike. No setting repairs it; softplus or exp on the head would.
"""

import torch
from torch import nn

CONFIG = {"steps": 10}


class CallVolume(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 32), nn.ReLU())
        self.rate = nn.Linear(32, 1)

    def forward(self, x):
        return torch.relu(self.rate(self.encoder(x))).squeeze(-1)


def model():
    return CallVolume()


def data():
    g = torch.Generator().manual_seed(4)
    for _ in range(10):
        x = torch.randn(64, 6, generator=g)
        yield x, torch.poisson(torch.full((64,), 2.0), generator=g)


def loss(model, batch):
    x, calls = batch
    return -torch.distributions.Poisson(model(x), validate_args=False).log_prob(calls).mean()
