"""A small language model trained by hand with argparse, AdamW and fp16 autocast + GradScaler.

At a sane --lr it trains; at --lr 0.3 (no warm-up) its first update breaks the model in FP32 as in AMP: the loss
jumps from ~5 to the hundreds, and the scaler then skips step after step on the broken model's gradients.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True)
args = parser.parse_args()

VOCAB, WIDTH, CONTEXT = 128, 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        return self.head(self.blocks(self.embed(idx)))


torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
corpus = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(1))
g = torch.Generator().manual_seed(2)
for step in range(args.steps):
    starts = torch.randint(0, len(corpus) - CONTEXT - 1, (16,), generator=g)
    x = torch.stack([corpus[s : s + CONTEXT] for s in starts])
    y = torch.stack([corpus[s + 1 : s + CONTEXT + 1] for s in starts])
    with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print(f"step {step} loss {loss.item():.4f}")
