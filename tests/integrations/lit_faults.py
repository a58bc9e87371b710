"""A Lightning module and dataset with faults injected at a known optimizer step (importable: capsules rebuild it)."""

import torch
from torch import nn
from torch.utils.data import Dataset

import lightning as L

BATCH = 16


class Pairs(Dataset):
    """Classification pairs; with ``nan_at`` the batch of that step carries a NaN feature."""

    def __init__(self, nan_at=None, size=BATCH * 24):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 16, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.nan_at = nan_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index].clone()
        if self.nan_at is not None and index // BATCH == self.nan_at:
            x[3] = float("nan")
        return x, self.y[index]


class Block(nn.Module):
    """An expansion and a projection back, like a transformer's feed-forward block."""

    def __init__(self, width):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Classifier(L.LightningModule):
    """With ``overflow_at``, that step scales the block's expansion up and its projection down by the same factor:
    the block's output (and FP32) stay the same, its inner activations pass fp16's 65504 (a checkpoint
    pretrained in bf16, fine-tuned in fp16)."""

    def __init__(self, overflow_at=None):
        super().__init__()
        self.inp, self.block, self.norm, self.head = nn.Linear(16, 64), Block(64), nn.LayerNorm(64), nn.Linear(64, 2)
        self.overflow_at = overflow_at

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.norm(h + self.block(h)))

    def training_step(self, batch, batch_idx):
        if self.overflow_at is not None and self._trainer is not None and self.global_step == self.overflow_at:
            with torch.no_grad():
                self.block.up.weight.mul_(1e5)
                self.block.up.bias.mul_(1e5)
                self.block.down.weight.mul_(1e-5)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
