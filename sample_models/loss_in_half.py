"""Mistake: a hand-written label-smoothed cross-entropy computed outside autocast on fp16 logits.

A cosine-similarity classifier (scale s=30, as in CosFace/ArcFace) produces
logits up to +-30. The forward pass runs under autocast, so the logits come
out in fp16; the custom loss then runs *after* the autocast block, where
``exp`` is no longer promoted to fp32, and exp(30) = 1.07e13 overflows fp16
(max 65504). FP32 training is fine.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "lr": 1e-3}
SCALE, SMOOTHING, CLASSES = 30.0, 0.1, 8


class CosineClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 32))
        self.prototypes = nn.Parameter(torch.randn(CLASSES, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.normalize(self.body(x), dim=-1)
        return SCALE * features @ F.normalize(self.prototypes, dim=-1).t()


def model() -> nn.Module:
    return CosineClassifier()


def data():
    g = torch.Generator().manual_seed(4)
    centers = torch.randn(CLASSES, 24, generator=g)
    for _ in range(20):
        y = torch.randint(0, CLASSES, (32,), generator=g)
        yield centers[y] + 0.3 * torch.randn(32, 24, generator=g), y


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    log_probs = logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))
    nll = -log_probs.gather(-1, target[:, None]).squeeze(-1)
    return ((1 - SMOOTHING) * nll - SMOOTHING * log_probs.mean(-1)).mean()


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        logits = model(x)
    loss = smoothed_cross_entropy(logits, y)  # outside autocast: runs in the logits' dtype
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
