"""Mistake: fp16 autocast with loss scaling switched off (a config copied from a bf16 run).

A deep tanh network for a smooth regression: its gradients shrink layer by
layer, and the early layers' gradients sit below fp16's smallest subnormal
(2^-24): in fp16 they flush to zero and those layers stop learning, so the
AMP loss curve falls behind FP32's.
"""

import torch
from torch import nn

CONFIG = {"steps": 20, "lr": 3e-3, "scaler": {"enabled": False}}


def model() -> nn.Module:
    layers = []
    for _ in range(16):
        linear = nn.Linear(64, 64)
        nn.init.normal_(linear.weight, std=0.4 / 64 ** 0.5)
        layers += [linear, nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(15)
    w = torch.randn(64, generator=g) / 8
    for _ in range(20):
        x = torch.randn(256, 64, generator=g)
        yield x, torch.tanh(x @ w)


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)
