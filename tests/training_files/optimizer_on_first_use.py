"""A Lightning-style module that builds its own optimizer, on the first training step.

The model carries configure_optimizers(); train_step creates the optimizer the first time it runs
and keeps it on the model (the optimizer handed in is ignored), as code ported from a LightningModule
does. The doctor finds the optimizer when it first steps and treats it like any other.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 4))

    def forward(self, x):
        return self.body(x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def model():
    return Classifier()


def data():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(20, 4, generator=g)
    for _ in range(16):
        x = torch.randn(32, 20, generator=g)
        yield x, (x @ w).argmax(dim=1)


def train_step(model, batch, optimizer, scaler, autocast):
    if getattr(model, "_optimizer", None) is None:
        model._optimizer = model.configure_optimizers()
    opt = model._optimizer
    x, y = batch
    opt.zero_grad(set_to_none=True)
    with autocast():
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss
