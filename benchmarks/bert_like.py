"""The benchmark model as a training file: a 4-layer BERT-like encoder from torch.nn layers.

Batch 16 x 128 tokens, AdamW (the contract's default optimizer), masked-LM
style loss over a 4096-token vocabulary.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, LENGTH, WIDTH, HEADS, LAYERS, BATCH = 4096, 128, 256, 4, 4, 16
CONFIG = {"steps": 8, "lr": 1e-4}


class BertLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(LENGTH, WIDTH)
        self.embed_norm = nn.LayerNorm(WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed_norm(self.tokens(input_ids) + self.positions(positions))
        return self.head(self.encoder(h))


def model() -> nn.Module:
    return BertLike()


def data():
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        yield {"input_ids": ids, "labels": ids.roll(1, dims=1)}


def loss(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
