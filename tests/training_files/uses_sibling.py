"""A training file that imports a helper module from its own folder."""

import torch

from sibling_layers import mlp

CONFIG = {"steps": 8}


def model():
    return mlp(6, 3)


def data():
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(8)]
