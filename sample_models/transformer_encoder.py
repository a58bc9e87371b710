"""Healthy: a small sequence classifier built from library layers (nn.TransformerEncoder).

Batches are Hugging Face style dicts; loss() says how to compute the loss
from them, and a linear warm-up schedule is stepped once per step.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 30, "lr": 5e-4}
VOCAB, CLASSES, LENGTH, WIDTH = 64, 4, 32, 64


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(input_ids) + self.position, src_key_padding_mask=attention_mask == 0)
        pooled = (h * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        return self.head(self.norm(pooled))


def model() -> nn.Module:
    return Classifier()


def data():
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        labels = torch.randint(0, CLASSES, (16,), generator=g)
        ids = torch.randint(4, VOCAB, (16, LENGTH), generator=g)
        ids[:, 0] = labels  # the class token is the first token: learnable
        mask = torch.ones(16, LENGTH, dtype=torch.long)
        mask[:, LENGTH - 4:] = (torch.rand(16, 4, generator=g) > 0.5).long()
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return F.cross_entropy(logits, batch["labels"])


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
