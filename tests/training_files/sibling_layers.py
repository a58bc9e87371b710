"""A helper module beside uses_sibling.py (imported as a sibling, not installed)."""

from torch import nn


def mlp(width_in, width_out):
    return nn.Sequential(nn.Linear(width_in, 24), nn.SiLU(), nn.Linear(24, width_out))
