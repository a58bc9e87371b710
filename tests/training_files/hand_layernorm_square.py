"""Post-LN transformer-style residual MLP for a tabular/time-series regressor, with the
LayerNorm written out by hand (ported from a JAX codebase: "mean, centre, variance").

The residual stream is not normalised before it is added to (post-norm on the branch only,
ReZero-style gain of 1) and the inputs are sensor readings in raw units (hundreds), so the
stream reaches a few hundred.  fp32 trains normally; under AMP the loss curve is visibly off.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16, "lr": 1e-3}


class MyLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.g, self.b, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        d = x - mu
        var = (d * d).mean(-1, keepdim=True)
        return d / torch.sqrt(var + self.eps) * self.g + self.b


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = MyLayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self, d_in=12, d=48):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(3)])
        self.norm = MyLayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.norm(self.blocks(self.inp(x)))).squeeze(-1)


def model():
    return Net()


def data():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, generator=g)
    for _ in range(16):
        raw = 300 + 150 * torch.randn(64, 12, generator=g)          # raw sensor units
        y = torch.tanh((raw - 300) / 150 @ w / 3)
        yield raw, y


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)
