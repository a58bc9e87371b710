"""Mistake: a hand-written "lean" Adam that keeps its moments in fp16 to halve optimizer memory.

The model is fp32 under autocast with GradScaler, all by the book, but the
optimizer stores exp_avg and exp_avg_sq in fp16: squared gradients below
2^-24 flush to zero, eps=1e-8 is 0 in fp16, and m / (sqrt(v) + eps) divides
by zero.
"""

import math

import torch
from torch import nn

CONFIG = {"steps": 10}


class LeanAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float16)
                state["step"] += 1
                g = p.grad.to(torch.float16)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** state["step"])).add_(group["eps"])
                p.add_((m / denom).float(), alpha=-group["lr"] / (1 - b1 ** state["step"]))


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))


def data():
    g = torch.Generator().manual_seed(11)
    centers = torch.randn(10, 32, generator=g)
    for _ in range(10):
        y = torch.randint(0, 10, (64,), generator=g)
        yield centers[y] + 0.5 * torch.randn(64, 32, generator=g), y


def optimizer(params):
    return LeanAdam(params, lr=1e-3)
