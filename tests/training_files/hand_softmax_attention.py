"""Reformer-style shared-QK attention, written out by hand so we can later swap in
a chunked version (normalise once at the end instead of a softmax per chunk).

Cosine similarity between the shared query/key projections with a fixed temperature
(like Swin-V2 cosine attention). fp32 trains fine; AMP gives NaN at step 0.
"""
import math
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "lr": 5e-4}

VOCAB, D, HEADS, SEQ, BATCH, LAYERS = 200, 64, 4, 32, 16, 2


class SharedQKAttention(nn.Module):
    def __init__(self, d, heads, tau=0.05):
        super().__init__()
        self.h = heads
        self.qk = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d)
        self.tau = tau

    def forward(self, x):
        b, t, d = x.shape
        qk = self.qk(x).view(b, t, self.h, d // self.h).transpose(1, 2)
        v = self.v(x).view(b, t, self.h, d // self.h).transpose(1, 2)
        qk = F.normalize(qk, dim=-1)
        scores = qk @ qk.transpose(-1, -2) / self.tau          # cosine / tau, in [-20, 20]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(scores) * causal                   # unnormalised
        out = weights @ v                                      # sum_j w_ij v_j
        out = out / weights.sum(-1, keepdim=True)              # normalise once at the end
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = SharedQKAttention(D, HEADS)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.zeros(SEQ, D))
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def model():
    return TinyLM()


def data():
    g = torch.Generator().manual_seed(0)
    # a toy "copy with offset" language: next token = (token + 3) % VOCAB with noise
    for _ in range(CONFIG["steps"]):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        seq = (start + 3 * torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def loss(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def optimizer(params):
    return torch.optim.AdamW(params, lr=CONFIG["lr"], betas=(0.9, 0.95), weight_decay=0.1)


def scheduler(opt):
    warmup = 5
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
