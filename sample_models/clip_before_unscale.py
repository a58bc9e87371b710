"""Mistake: gradient clipping placed before scaler.unscale_ in a hand-written step.

The step clips right after backward, while the gradients are still multiplied
by the loss scale (65536): a max_norm of 1.0 then clips the true gradients to
1/65536 of it, and training crawls (plain SGD with momentum, whose step follows
the gradient's size; Adam would divide the clipping away).
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))


def data():
    g = torch.Generator().manual_seed(13)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(20):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + 0.5 * torch.randn(64, 32, generator=g), y


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # still scaled here
    scaler.step(optimizer)
    scaler.update()
    return loss
