"""A model with a TorchScript submodule (a scripted activation): it refuses Python hooks, so the
instruments see it only through its parent's output."""
import torch
from torch import nn

CONFIG = {"steps": 4}


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def model():
    return nn.Sequential(nn.Linear(8, 32), torch.jit.script(Swish()), nn.Linear(32, 2))


def data():
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        yield torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
