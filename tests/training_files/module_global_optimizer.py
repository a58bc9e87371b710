"""A script turned training file: the optimizer lives in a module-level global, made on first use.

Run as a script it trains one model. The doctor builds a fresh model for every probe, so from the
second probe on this optimizer steps the first probe's parameters, not the model it is given.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12}
OPTIMIZER = None


def model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 3))


def data():
    g = torch.Generator().manual_seed(4)
    for _ in range(12):
        yield torch.randn(24, 16, generator=g), torch.randint(0, 3, (24,), generator=g)


def train_step(model, batch, optimizer, scaler, autocast):
    global OPTIMIZER
    if OPTIMIZER is None:
        OPTIMIZER = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = batch
    OPTIMIZER.zero_grad(set_to_none=True)
    with autocast():
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(OPTIMIZER)
    scaler.update()
    return loss
