"""A constant fp16 cannot hold: an attention mask filled with -1e9.

A small self-attention classifier over padded sequences, written the way older
code writes the mask: `scores.masked_fill(~mask, -1e9)`. In fp32 that is fine.
Under AMP the scores come out of a matmul in fp16, whose largest finite value is
65504, and masked_fill raises "value cannot be converted to type at::Half
without overflow". The fix is `torch.finfo(scores.dtype).min`, a boolean mask
in `scaled_dot_product_attention`, or the attention scores in fp32.
"""

import math

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "lr": 2e-3}
WIDTH, LENGTH, CLASSES = 32, 16, 4


class MaskedSelfAttention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~mask[:, None, :], -1e9)   # padding never attended to
        return self.proj(scores.softmax(dim=-1) @ v)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.attn = MaskedSelfAttention(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.attn(h, mask)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def model() -> nn.Module:
    return Classifier()


def data():
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        x = torch.randn(16, LENGTH, 8, generator=g)
        lengths = torch.randint(4, LENGTH + 1, (16,), generator=g)
        mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
        yield x, mask, (x[:, 0, 0] > 0).long() + 2 * (lengths > LENGTH // 2).long()


def loss(model, batch):
    x, mask, y = batch
    return F.cross_entropy(model(x, mask), y)
