"""A norm-free residual MLP (Primer's squared-ReLU FFN), six blocks and no LayerNorm inside them: the residual
stream grows block by block, and only the deepest blocks' r * r passes 65504, the last at step 0 and the one
before it a few steps later. Keeping those two in fp32 repairs the training; keeping every block is not needed."""

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 20, "lr": 1e-3}
WIDTH, HIDDEN, BLOCKS = 64, 128, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        r = F.relu(self.up(x))
        return x + self.down(r * r)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def model():
    torch.manual_seed(0)
    return Net()


def data():
    g = torch.Generator().manual_seed(3)
    centers = 2 * torch.randn(10, 32, generator=g)
    for _ in range(20):
        y = torch.randint(0, 10, (64,), generator=g)
        yield 2.0 * (centers[y] + torch.randn(64, 32, generator=g)), y
