"""A tabular regressor whose warm-up climbs to a peak rate typed three orders too high (3.0 for 3e-3), then decays
on a cosine. Momentum SGD diverges in FP32 within a few steps; a tenth or a hundredth of the rate still leaves AMP's
scaler skipping most steps, and only the rate that was meant trains cleanly in both."""

import math

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 30}
PEAK_LR = 3.0  # meant 3e-3
WARMUP_STEPS, TOTAL_STEPS = 8, 30


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 192), nn.GELU(), nn.Linear(192, 192), nn.GELU(), nn.Linear(192, 1))


def data():
    g = torch.Generator().manual_seed(3)
    true_weights = torch.randn(48, 1, generator=g)
    for _ in range(30):
        features = torch.randn(96, 48, generator=g)
        yield features, features @ true_weights + 0.1 * torch.randn(96, 1, generator=g)


def loss(net, batch):
    features, target = batch
    return F.mse_loss(net(features), target)


def optimizer(params):
    return torch.optim.SGD(params, lr=PEAK_LR, momentum=0.9)


def scheduler(opt):
    def factor(step):
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = (step - WARMUP_STEPS) / (TOTAL_STEPS - WARMUP_STEPS)
        return 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
