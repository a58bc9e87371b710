"""Hand-rolled static loss scaling: the loss multiplied by a fixed 2**24, no GradScaler.

Copied from an old recipe: scale the loss, backward, divide the gradients, step. At 2**24
the fp16 gradients overflow, the division turns inf into inf/NaN, and the optimizer writes
NaN into the weights: from the second step the AMP loss is NaN, while FP32 is fine.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12}
STATIC_SCALE = 2.0 ** 24


def model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def data():
    g = torch.Generator().manual_seed(5)
    return [(3 * torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)) for _ in range(12)]


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = F.cross_entropy(model(x), y)
    (loss * STATIC_SCALE).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(STATIC_SCALE)
    optimizer.step()
    return loss
