"""A post-norm attention block whose value path was trained to a large scale: the projection's output (about 2e5)
is added to the block's input and normalised straight away, so the model's output is small. With AMP the residual
sum is fp32 (the projection's output is fp32 under autocast's fp32 ops) and fine; served in fp16 it is inf. The sum
is an operation of the block's own forward, not of a module that could be kept alone."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.gamma = nn.Parameter(torch.ones(width))  # a layer scale: the block holds a parameter of its own

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.norm(x + self.gamma * self.proj(weights @ v))


class Tagger(nn.Module):
    def __init__(self, features=8, width=32, tags=3):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.block = Block(width)
        self.head = nn.Linear(width, tags)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


def model():
    torch.manual_seed(0)
    net = Tagger()
    with torch.no_grad():
        net.block.qkv.weight[64:].mul_(300.0)  # the value rows
        net.block.proj.weight.mul_(3000.0)
    return net


def data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 10, 8, generator=g), torch.randint(0, 3, (4, 10), generator=g)) for _ in range(4)]


def loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
