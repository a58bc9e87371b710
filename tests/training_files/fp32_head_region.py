"""Tabular regressor whose quantile head is wrapped in an autocast-disabled
region ("keep the head in fp32 for stability", as GPU code commonly does)."""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20}
QUANTILES = torch.tensor([0.1, 0.5, 0.9])


class QuantileHead(nn.Module):
    def __init__(self, d, nq):
        super().__init__()
        self.proj = nn.Linear(d, nq)

    def forward(self, h):
        with torch.autocast("cuda", enabled=False):
            return self.proj(h)


class TabNetLite(nn.Module):
    def __init__(self, d_in=24, d=96):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d_in, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
        self.head = QuantileHead(d, len(QUANTILES))

    def forward(self, x):
        return self.head(self.enc(x))


def model():
    torch.manual_seed(0)
    return TabNetLite()


def data():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(24, generator=g)
    for _ in range(20):
        x = torch.randn(128, 24, generator=g)
        yield x, (x @ w) + 0.3 * torch.randn(128, generator=g)


def pinball(pred, y):
    diff = y[:, None] - pred
    return torch.maximum(QUANTILES * diff, (QUANTILES - 1) * diff).mean()


def loss(model, batch):
    x, y = batch
    return pinball(model(x), y)


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-2)


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
