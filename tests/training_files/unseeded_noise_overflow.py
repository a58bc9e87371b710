"""A model whose forward draws noise from its own generator, seeded once at import.

Every run (and every replay the doctor makes) continues the generator where the
last one stopped, so no two runs are the same: the way a module-level
`torch.Generator()` or `numpy.random.default_rng()` inside a model behaves.
From step 3 the inputs are scaled past what fp16 can carry in the first
layer's output: AMP turns that step non-finite in every run, with different
losses on the way.
"""

import torch
from torch import nn

CONFIG = {"steps": 8}

NOISE = torch.Generator().manual_seed(1234)


class NoisyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        jitter = 1 + 0.01 * torch.rand(h.shape[-1], generator=NOISE)  # not reset by any seed
        return self.out(h * jitter.to(h.dtype))


def model():
    return NoisyMLP()


def data():
    g = torch.Generator().manual_seed(5)
    for step in range(8):
        x = torch.randn(32, 16, generator=g)
        yield x * (5e4 if step >= 3 else 1.0), torch.randint(0, 4, (32,), generator=g)
