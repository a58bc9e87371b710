"""A small attention classifier, compiled: its features come in large and its scores skip the 1/sqrt(d) scale, so
the batched product q @ k^T reaches ~1.5e5. On a GPU that product is a cuBLAS kernel writing fp16: inf, compiled or
not. (Inductor keeps the product an external kernel; only the element-wise chains around it are fused in fp32.)"""

import torch
from torch import nn

CONFIG = {"steps": 8, "lr": 1e-3}


class RawAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2)  # no 1/sqrt(d)
        return torch.softmax(scores, dim=-1) @ v


class Classifier(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.attn = RawAttention(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = self.embed(x) * 60.0  # features come in large
        return self.head(self.attn(h).mean(1))


def model():
    torch.manual_seed(0)
    return torch.compile(Classifier(), dynamic=False)


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, 8, generator=g) * 4, torch.randint(0, 4, (8,), generator=g)) for _ in range(8)]
