"""Mistake: raw, unnormalised features (incomes in dollars, areas in square feet).

A credit-default classifier fed the columns as they come: annual income
30,000-120,000, loan amount 5,000-40,000, account age in days. fp32 copes (the
numbers are merely large); in fp16 an income beyond 65504 is already inf when
autocast casts the input of the first linear layer.
"""

import torch
from torch import nn

CONFIG = {"steps": 20}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))


def data():
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        income = 30_000 + 90_000 * torch.rand(64, generator=g)
        loan = 5_000 + 35_000 * torch.rand(64, generator=g)
        age_days = 3650 * torch.rand(64, generator=g)
        score = 300 + 550 * torch.rand(64, generator=g)
        x = torch.stack([income, loan, age_days, score], 1)
        y = (loan / income > 0.25).long()
        yield x, y
