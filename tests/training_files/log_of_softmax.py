"""A classifier whose loss is the log of a softmax, taken inside the autocast block.

Safe on a GPU: CUDA autocast runs softmax and log in fp32, so a confident prediction's tiny
probabilities (below e^-17, 2^-24) are representable and their log finite. CPU autocast runs both in
fp16, where those probabilities flush to zero and the log is -inf. The doctor's CPU probes follow
CUDA's op lists, so `diagnose` calls this file healthy, and `train` on CPU must run it the same way.
"""
import torch
from torch import nn

CONFIG = {"steps": 24}


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))
        with torch.no_grad():
            self.body[2].weight.mul_(6.0)  # confident from the start: logits spread over tens of units

    def forward(self, x):
        return self.body(x)


def model():
    return Classifier()


def loss(model, batch):
    x, y = batch
    probs = torch.softmax(model(x), dim=-1)
    return nn.functional.nll_loss(torch.log(probs), y)


def data():
    g = torch.Generator().manual_seed(3)
    for _ in range(24):
        yield torch.randn(32, 16, generator=g) * 2, torch.randint(0, 10, (32,), generator=g)
