"""Gradient accumulation over 8 micro-batches counted in a module-level dict (as scripts keep a step counter),
over 21 steps: not a multiple of 8, so a probe that began where the last one stopped counting would step at other
micro-batches than the first, and train another training.
The recipe is correct (healthy): unscale_, clip, step and update once per 8 micro-batches."""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 21, "lr": 1e-3}
ACC = 8


def model():
    return nn.Sequential(nn.Linear(48, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 6))


def data():
    g = torch.Generator().manual_seed(11)
    c = 3 * torch.randn(6, 48, generator=g)
    for _ in range(24):
        y = torch.randint(0, 6, (16,), generator=g)
        yield c[y] + torch.randn(16, 48, generator=g), y


_micro = {"i": 0}


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    with autocast():
        out = F.cross_entropy(model(x), y, reduction="sum") / (ACC * x.shape[0])
    scaler.scale(out).backward()
    _micro["i"] += 1
    if _micro["i"] % ACC == 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return out * ACC
