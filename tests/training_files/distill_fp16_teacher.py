"""Knowledge distillation with the teacher kept in fp16 to save memory.

The teacher is frozen (requires_grad off, eval mode) and cast to half on purpose: it is
only ever run forward, under no_grad. The student trains in fp32 master weights under
autocast with a GradScaler. The teacher's half-precision weights are not the training's
weights: nothing here is half-weights.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16, "lr": 2e-3}
TEMPERATURE = 2.0


def mlp(width):
    return nn.Sequential(nn.Linear(24, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 6))


class Distiller(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher = mlp(128).half()
        self.teacher.requires_grad_(False)
        self.student = mlp(32)

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()  # the teacher never trains, not even its dropout or norm statistics
        return self

    def forward(self, x):
        with torch.no_grad():
            soft = self.teacher(x.half()).float()
        return self.student(x), soft


def model():
    return Distiller()


def data():
    g = torch.Generator().manual_seed(21)
    w = torch.randn(24, 6, generator=g)
    for _ in range(16):
        x = torch.randn(48, 24, generator=g)
        yield x, (x @ w).argmax(dim=1)


def loss(model, batch):
    x, y = batch
    logits, teacher_logits = model(x)
    kd = F.kl_div(F.log_softmax(logits.float() / TEMPERATURE, -1), F.softmax(teacher_logits / TEMPERATURE, -1),
                  reduction="batchmean") * TEMPERATURE ** 2
    return 0.5 * kd + 0.5 * F.cross_entropy(logits, y)


def optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=CONFIG["lr"])
