"""Mistake: fine-tuning in fp16 a block pretrained in bf16, whose feed-forward activations pass 65504.

The known T5 case: weights learnt in bf16 (fp32's range) grew large, and the
feed-forward output reaches the hundred thousands. fp32 and bf16 carry it (the
residual's LayerNorm brings it back); fp16 turns it into inf.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 10, "lr": 1e-4}
WIDTH, HIDDEN, VOCAB, CLASSES = 64, 256, 100, 5


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.wo = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = FeedForward()
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.ff(x))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block = Block()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)).mean(1))


def model() -> nn.Module:
    net = Classifier()
    with torch.no_grad():  # "load the bf16-pretrained checkpoint": large feed-forward weights
        net.block.ff.wi.weight.normal_(0, 20.0)
        net.block.ff.wo.weight.normal_(0, 20.0)
    return net


def data():
    g = torch.Generator().manual_seed(12)
    for _ in range(10):
        ids = torch.randint(0, VOCAB, (16, 24), generator=g)
        yield ids, ids[:, 0] % CLASSES
