"""bf16 training whose LR jumps 300x after its warm-up: FP32 and AMP grow for six steps, then go NaN.

The same classifier trained under bf16 autocast (no scaler: bf16 has fp32's range),
warmed up to 0.015; the main phase multiplies it by 300. Nothing is inf at first:
the gradient norm grows step after step, a thousandfold and more, and both FP32 and
bf16 reach NaN six steps after the jump, past any few-step window after the event.
"""

import torch
from torch import nn

CONFIG = {"steps": 16, "dtype": "bfloat16"}


def model():
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 6))


def data():
    g = torch.Generator().manual_seed(21)
    centers = torch.randn(6, 32, generator=g)
    for _ in range(16):
        y = torch.randint(0, 6, (48,), generator=g)
        yield centers[y] + 1.5 * torch.randn(48, 32, generator=g), y


def optimizer(params):
    return torch.optim.SGD(params, lr=0.015, momentum=0.9)


def scheduler(opt):
    warmup = 6
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / warmup if step < warmup else 300.0)
