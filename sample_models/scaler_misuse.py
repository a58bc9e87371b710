"""GradScaler misuse: unscale_ and clipping on every micro-batch of gradient accumulation.

The loop accumulates 4 micro-batches per optimizer step and, to "keep the
gradients in check", unscales and clips after every backward. unscale_ may run
once per optimizer step, before update(): the second micro-batch raises
"unscale_() has already been called on this optimizer since the last update()".
In FP32 the scaler is disabled and the mistake stays hidden. PyTorch's AMP
examples give the recipe: unscale_, clip, step and update once, at the last
micro-batch.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16}
ACCUMULATE = 4


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))


def data():
    g = torch.Generator().manual_seed(13)
    for _ in range(16):
        x = torch.randn(32, 12, generator=g)
        yield x, (x[:, :3].argmax(dim=1))


def train_step(model, batch, optimizer, scaler, autocast):
    micro = getattr(optimizer, "micro_steps", 0) + 1
    optimizer.micro_steps = micro
    x, y = batch
    with autocast():
        loss = F.cross_entropy(model(x), y) / ACCUMULATE
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                                   # wrong: on every micro-batch
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if micro % ACCUMULATE == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return loss * ACCUMULATE
