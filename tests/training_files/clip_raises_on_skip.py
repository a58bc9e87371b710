"""Accumulation over 4 micro-batches, clipping with error_if_nonfinite=True (as some repos do to fail fast), and a
GradScaler starting at 2^24: its first overflow, a step the scaler exists to skip, raises in the clip."""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12, "lr": 3e-4, "scaler": {"init_scale": 2.0 ** 24}}
ACCUM = 4


def model():
    return nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 5))


def data():
    g = torch.Generator().manual_seed(3)
    for _ in range(12):
        yield torch.randn(32, 16, generator=g), torch.randint(0, 5, (32,), generator=g)


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.05)


def scheduler(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=12)


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    total = 0.0
    for xs, ys in zip(x.chunk(ACCUM), y.chunk(ACCUM)):
        with autocast():
            loss = F.cross_entropy(model(xs), ys) / ACCUM
        scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total
