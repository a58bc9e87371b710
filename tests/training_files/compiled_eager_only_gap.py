"""A weather-station classifier whose hand-written input RMS norm casts raw readings (temperature in kelvin, ~300)
to fp16 to save memory, compiled with inductor. Eager fp16 squares 300 K to 9e4: inf, and the normalised inputs
are zeros, a quiet loss gap on the same weights (no NaN, no skip). Inductor keeps ``x * x / d`` in fp32 registers
and stores only the sum, so the compiled training, as it runs, computes what FP32 does: healthy as compiled."""

import torch
from torch import nn

CONFIG = {"steps": 20, "lr": 1e-3}


class HalfRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x = x.to(torch.float16)
        ms = (x * x / x.shape[-1]).sum(-1, keepdim=True)  # x*x is 9e4 for 300 K in eager fp16
        return x * torch.rsqrt(ms + 1e-5) * self.weight


class StationNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = HalfRMSNorm(6)
        self.body = nn.Sequential(nn.Linear(6, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.body(self.input_norm(x)))


def model():
    torch.manual_seed(0)
    return torch.compile(StationNet())


def data():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        kelvin = 285 + 20 * torch.rand(64, 1, generator=g)
        others = torch.randn(64, 5, generator=g)  # the other sensors, already normalised
        yield torch.cat([kelvin, others], 1), (kelvin.squeeze(1) > 295).long() + (others[:, 0] > 0.5).long()
