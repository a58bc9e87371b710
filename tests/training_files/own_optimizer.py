"""A hand-written loop with its own optimizer, scheduler and train_step (clipping after unscale_)."""

import math

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16}


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def model():
    return nn.Sequential(nn.Linear(20, 48), Block(48), Block(48), nn.LayerNorm(48), nn.Linear(48, 5))


def data():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(20, 5, generator=g)
    for _ in range(16):
        x = torch.randn(32, 20, generator=g)
        yield x, (x @ w).argmax(dim=1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)


def scheduler(optimizer):
    warmup, total = 4, 16

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss
