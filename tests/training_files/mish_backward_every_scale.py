"""A memory-saving Mish with its backward written out (the paper's closed form), so that autograd keeps
only x. Under autocast the backward runs on the fp16 x its forward saved: ``exp(x) ** 3`` passes 65504
for x above ~3.7 at any loss scale, and every step is skipped. At step 0 the default scale of 2^16 also
overflows the output layer's bias gradient: that skip is calibration, and the one to localise is a later
one, where the scale has come down and the custom backward still overflows."""
import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 12, "lr": 1e-3}


class MishFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.tanh(F.softplus(x))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        e = torch.exp(x)
        omega = 4 * (x + 1) + 4 * e * e + e * e * e + e * (4 * x + 6)
        delta = 2 * e + e * e + 2
        return grad * e * omega / (delta * delta)


class Mish(nn.Module):
    def forward(self, x):
        return MishFunction.apply(x)


def model():
    return nn.Sequential(nn.Linear(16, 96), Mish(), nn.Linear(96, 96), Mish(), nn.Linear(96, 1))


def data():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 1, generator=g)
    batches = []
    for _ in range(12):
        x = torch.randn(64, 16, generator=g) * 2.0
        batches.append((x, x @ w + 0.1 * torch.randn(64, 1, generator=g)))
    return batches


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)
