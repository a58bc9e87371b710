"""House prices predicted in dollars: the regression head predicts in units of 100,000 and scales back itself (a
buffer), so the model's output is about 2e5. Under AMP the scale is an fp32 buffer and the product is fp32; served
in pure fp16 the buffer is fp16 too and every price is inf."""

import torch
from torch import nn


class PriceHead(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, 1)
        self.register_buffer("unit", torch.tensor([1e5]))

    def forward(self, h):
        return self.linear(h).squeeze(-1) * self.unit


class Valuer(nn.Module):
    def __init__(self, features=8, width=32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = PriceHead(width)

    def forward(self, x):
        return self.head(self.body(x))


def model():
    torch.manual_seed(0)
    net = Valuer()
    with torch.no_grad():
        net.head.linear.bias.fill_(2.0)  # trained: the typical house costs about 200,000
    return net


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), 2e5 + 5e4 * torch.randn(32, generator=g)) for _ in range(8)]


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).float() / 1e5, y / 1e5)
