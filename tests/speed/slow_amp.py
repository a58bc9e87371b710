"""A small language model whose AMP step is slower than it could be, in four ways at once: a vocabulary of 1001
(the head's products cannot use tensor cores whole), a host synchronisation in the loss (a NaN guard that reads the
loss back), a hand-written tanh-GELU (a swarm of element-wise kernels) and an unfused AdamW."""

import math

import torch
from torch import nn

VOCAB = 1001


class TanhGelu(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


class TinyLM(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.up = nn.Linear(width, 4 * width)
        self.act = TanhGelu()
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.down(self.act(self.up(h))))


def model():
    torch.manual_seed(0)
    return TinyLM()


def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (8, 16), generator=g) for _ in range(8)]


def loss(model, tokens):
    logits = model(tokens[:, :-1])
    value = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    if torch.isnan(value):  # a NaN guard: reads the loss back to the host every step
        raise RuntimeError("loss is NaN")
    return value


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)
