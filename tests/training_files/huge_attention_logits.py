"""Attention over "pretrained" embeddings with a huge norm: the scores q @ k^T pass 65504 in fp16.

The GradScaler first skips a few steps (gradients overflow: the scaler at work); from step 3 the
forward itself overflows in the attention's bmm and the loss is NaN: the fault the user sees.
"""
import math
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 8}
class SelfAttn(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.q = nn.Linear(d, d); self.k = nn.Linear(d, d); self.v = nn.Linear(d, d); self.o = nn.Linear(d, d)
    def forward(self, x):
        att = (self.q(x) @ self.k(x).transpose(1, 2)) / math.sqrt(x.shape[-1])
        return self.o(att.softmax(-1) @ self.v(x))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 128)
        nn.init.normal_(self.emb.weight, std=60.0)          # "pretrained" embeddings with a huge norm
        self.attn = SelfAttn(); self.head = nn.Linear(128, 64)
    def forward(self, ids):
        h = self.emb(ids)
        return self.head(F.layer_norm(h + self.attn(h), (128,)))
def model(): return Net()
def data():
    g = torch.Generator().manual_seed(21)
    for _ in range(8):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        yield ids, ids.roll(1, 1)
def loss(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids).flatten(0, 1), y.flatten())
