"""data() returns a DataLoader with two worker processes over a Dataset class defined here.

The workers receive the dataset by pickling: the class must be importable by its module name.
Set DATALOADER_START=spawn to use spawned workers (they import this file afresh).
"""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

CONFIG = {"steps": 8}


class SyntheticPairs(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, 12, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def model():
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 2))


def data():
    start = os.environ.get("DATALOADER_START") or None
    return DataLoader(SyntheticPairs(256), batch_size=32, shuffle=False, num_workers=2,
                      multiprocessing_context=start, persistent_workers=False)
