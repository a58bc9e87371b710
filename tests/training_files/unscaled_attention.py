"""A hand-written attention block (no 1/sqrt(d) scaling) over embeddings initialised 20x too large.

The forward stays finite in fp16, but the head's weight gradient, a sum over 256 tokens of
activations near 100 times the scaled loss gradient, overflows at the default scale 2^16 and
keeps overflowing as the activations grow: a scale too high for this training's gradients.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12, "lr": 3e-4}

class Attn(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1)          # missing / sqrt(d)
        att = att.softmax(-1)
        return self.proj(att @ v)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 256)
        with torch.no_grad():
            self.emb.weight.mul_(20)
        self.attn = Attn()
        self.head = nn.Linear(256, 100)
    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.attn(h)
        return self.head(h)

def model():
    return Net()

def data():
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        ids = torch.randint(0, 100, (8, 32), generator=g)
        yield ids, ids.roll(1, dims=1)

def loss(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids).flatten(0, 1), y.flatten())
