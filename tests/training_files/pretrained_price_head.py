"""Price regression in raw currency units: targets of tens of thousands. From initialisation the head outputs
numbers near 0 and fp16 is fine; a trained head outputs the prices themselves, and past 65504 its fp16 output is
inf. Only a trained state shows the fault: diagnose it --from-checkpoint."""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 10}
SCALE = 1e5


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def data(start_step=0):
    g = torch.Generator().manual_seed(1000 + start_step)
    for _ in range(10):
        x = torch.randn(64, 8, generator=g)
        yield x, SCALE * (0.9 + 0.1 * x[:, :1].tanh())   # prices around 90,000


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float() / SCALE, y / SCALE)   # the loss on normalised prices


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4)
