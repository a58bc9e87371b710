"""A linear warm-up and decay (transformers' get_linear_schedule_with_warmup) to a peak LR 30x too high.

A small regression MLP with momentum SGD, peak lr 3.0 where about 0.1 trains. The
loss grows from the second warm-up step on and FP32 overflows two steps after the
peak; AMP's scaler skips from the third step. Capping the peak low enough trains.
"""

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 20}
WARMUP_STEPS, TRAINING_STEPS = 6, 20


def model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, generator=g) / 4
    for _ in range(20):
        x = torch.randn(64, 16, generator=g)
        yield x, torch.tanh(x @ w) + 0.1 * torch.randn(64, generator=g)


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=3.0, momentum=0.9)


def scheduler(opt):
    def lr_lambda(current_step):
        if current_step < WARMUP_STEPS:
            return float(current_step) / float(max(1, WARMUP_STEPS))
        return max(0.0, float(TRAINING_STEPS - current_step) / float(max(1, TRAINING_STEPS - WARMUP_STEPS)))

    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
