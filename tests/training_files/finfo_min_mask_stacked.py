"""A decoder stack whose every attention block builds its causal mask additively, as
`(1 - keep) * torch.finfo(torch.float32).min` cast to the scores' dtype: -inf in fp16 (-3.4e38 stays
finite in fp32). With left padding the first query rows see no key: a uniform softmax in FP32, NaN under
AMP, in the first block and, once that one is fixed, in the next (a user trial's file, shortened)."""
import math

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 6}
WIDTH, LENGTH, VOCAB = 32, 10, 50


class Attn(nn.Module):
    def __init__(self, d=WIDTH):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / math.sqrt(x.shape[-1])
        causal = torch.ones(x.shape[1], x.shape[1], device=x.device).tril()
        keep = causal[None] * (~pad)[:, None, :].float()
        scores = scores + ((1.0 - keep) * torch.finfo(torch.float32).min).to(scores.dtype)
        return self.out(scores.softmax(-1) @ v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = Attn()

    def forward(self, x, pad):
        return x + self.attn(self.norm(x), pad)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, pad):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, pad)
        return self.head(h)


def model():
    return Decoder()


def data():
    g = torch.Generator().manual_seed(5)
    for _ in range(CONFIG["steps"]):
        ids = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
        lengths = torch.randint(4, LENGTH + 1, (8,), generator=g)
        pad = torch.arange(LENGTH)[None] < (LENGTH - lengths)[:, None]  # left padding
        yield ids.masked_fill(pad, 0), pad


def loss(model, batch):
    ids, pad = batch
    logits = model(ids[:, :-1], pad[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01)
