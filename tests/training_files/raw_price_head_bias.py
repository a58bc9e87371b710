"""House price regression (Kaggle-style), predicting the sale price in dollars.

Features are standardised with the train-set statistics; the target is the raw
SalePrice (~ $100k-$400k). MSE loss, sum over the batch like our old Keras code.
"""
import torch
from torch import nn

CONFIG = {"steps": 30, "lr": 1e-2}

N_FEATURES = 24


class PriceMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(N_FEATURES, 128), nn.SiLU(),
            nn.Linear(128, 128), nn.SiLU(),
        )
        self.head = nn.Linear(128, 1)
        # start the head at the median price so the first steps are not wasted
        nn.init.constant_(self.head.bias, 160_000.0)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def make_dataset(n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, generator=g)
    price = 180_000 + 40_000 * torch.tanh(x @ w / 3) + 8_000 * torch.randn(n, generator=g)
    return x, price


X, Y = make_dataset()


def model():
    return PriceMLP()


def data():
    g = torch.Generator().manual_seed(1)
    for _ in range(CONFIG["steps"]):
        idx = torch.randint(0, len(X), (64,), generator=g)
        yield X[idx], Y[idx]


def loss(model, batch):
    x, price = batch
    pred = model(x)
    return torch.nn.functional.mse_loss(pred, price, reduction="sum") / 1e6   # scaled so the logs are readable


def optimizer(params):
    return torch.optim.Adam(params, lr=CONFIG["lr"])
