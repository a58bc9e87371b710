"""A count model whose warm-up ends in a 300x jump: FP32 and AMP go non-finite one step after it.

Bike rentals per hour, regressed with a log link (Poisson NLL on the log-rate). The
warm-up ramps SGD to 1e-2 over five steps; the main phase's factor was meant to be
1.0 and reads 300.0. The first update at 3.0 pushes the log-rate past 88, whose exp
is inf in fp32 as in fp16: the next step's loss is inf in both.
"""

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 16}
WARMUP_STEPS = 5


def model():
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(3)
    w = 0.3 * torch.randn(10, generator=g)
    for _ in range(16):
        weather = torch.randn(64, 10, generator=g)
        rentals = torch.poisson(torch.exp(1.0 + weather @ w), generator=g)
        yield weather, rentals


def loss(model, batch):
    x, counts = batch
    log_rate = model(x).squeeze(-1)
    return F.poisson_nll_loss(log_rate, counts, log_input=True)


def optimizer(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def scheduler(opt):
    def factor(step):
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        return 300.0  # meant: 1.0

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
