"""Long-tailed image-feature classifier: cosine classifier (CosFace-style scale s=30) trained with
a multi-class focal loss (gamma=2).  The focal loss follows the idiom of transformers' attention
code: softmax in float32, then back to the activations' dtype "to save memory".
About 10% of the labels are noisy (web-crawled data), so some true-class probabilities are tiny.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16, "lr": 1e-3}
S, GAMMA, CLASSES = 30.0, 2.0, 20


class CosineHead(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d))

    def forward(self, x):
        return S * F.linear(F.normalize(x, dim=-1), F.normalize(self.weight, dim=-1))


def model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), CosineHead(64, CLASSES))


def data():
    g = torch.Generator().manual_seed(11)
    centers = torch.randn(CLASSES, 64, generator=g) * 3
    for _ in range(16):
        y = torch.randint(0, CLASSES, (64,), generator=g)
        x = centers[y] + torch.randn(64, 64, generator=g)
        noisy = torch.rand(64, generator=g) < 0.1
        y = torch.where(noisy, torch.randint(0, CLASSES, (64,), generator=g), y)
        yield x, y


def focal_loss(logits, target, gamma=GAMMA):
    p = F.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
    pt = p.gather(1, target[:, None]).squeeze(1)
    return (-(1 - pt) ** gamma * torch.log(pt)).mean()


def loss(model, batch):
    x, y = batch
    return focal_loss(model(x), y)
