"""Mistake: an RMS norm's epsilon of 1e-8, which is 0 in fp16, on rows that are exactly zero.

A token tagger on padded sequences: the padding embedding is zero (``padding_idx``) and the
projection after it has no bias, so padded positions reach the norm as rows of zeros. The
hand-written RMS norm computes ``sqrt(mean(x * x) + 1e-8)``; in FP32 that is 1e-4 and the row
stays 0, but under autocast the mean is fp16, where 1e-8 (below the smallest subnormal, 6e-8)
rounds to 0: the padded rows divide 0 by 0. Their logits are NaN; the loss ignores padded
targets (``ignore_index``) and stays finite, but the gradients are NaN and the GradScaler skips
every step. Nothing overflows: the fix is an epsilon fp16 holds, or the norm in fp32.
"""

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {"steps": 10, "lr": 2e-3}
VOCAB, WIDTH, TAGS, PAD, LENGTH, BATCH = 300, 64, 7, 0, 24, 16


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return self.weight * x / rms


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm = RMSNorm(WIDTH)
        self.ff = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, TAGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(self.embed(tokens)))
        return self.head(h + self.ff(h))


def model() -> nn.Module:
    return Tagger()


def data():
    g = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(10):
        lengths = torch.randint(LENGTH // 3, LENGTH + 1, (BATCH,), generator=g)
        tokens = torch.full((BATCH, LENGTH), PAD, dtype=torch.long)
        tags = torch.full((BATCH, LENGTH), -100, dtype=torch.long)
        for row, length in enumerate(lengths.tolist()):
            words = torch.randint(1, VOCAB, (length,), generator=g)
            tokens[row, :length], tags[row, :length] = words, words % TAGS
        batches.append({"tokens": tokens, "tags": tags})
    return batches


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.reshape(-1, TAGS), batch["tags"].reshape(-1), ignore_index=-100)
