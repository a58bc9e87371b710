"""Binary classification with the loss written out by hand, as in many tutorials:
-(y log p + (1-y) log(1-p)) with p = sigmoid(logits). The log runs in fp32 under autocast, but p was
computed in fp16 and rounded to exactly 1.0 for confident logits, so log(1 - p) = log(0) = -inf."""
import torch
from torch import nn

CONFIG = {"steps": 20, "lr": 2e-2}


def model():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20, 1, generator=g) * 4
    for _ in range(20):
        x = torch.randn(128, 20, generator=g)
        yield x, (x @ w > 0).float()


def loss(model, batch):
    x, y = batch
    p = torch.sigmoid(model(x))
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
