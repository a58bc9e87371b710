"""A recommender with sparse embedding gradients (`nn.Embedding(sparse=True)`), trained with SGD,
which takes sparse gradients: the instruments read a sparse gradient's values."""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 6}


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(1000, 32, sparse=True)
        self.items = nn.Embedding(1000, 32, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, users, items):
        return self.mlp(torch.cat([self.users(users), self.items(items)], -1)).squeeze(-1)


def model():
    return Recommender()


def data():
    g = torch.Generator().manual_seed(13)
    for _ in range(6):
        yield torch.randint(0, 1000, (256,), generator=g), torch.randint(0, 1000, (256,), generator=g), torch.rand(256, generator=g)


def loss(model, batch):
    users, items, clicked = batch
    return F.binary_cross_entropy_with_logits(model(users, items), clicked)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
