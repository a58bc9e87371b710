"""pH probes (~7.5, a spread of a few tenths) through an input LayerNorm and two pre-norm MLP blocks, trained
through a team's custom torch.compile backend whose graph pass swaps LayerNorm for a "fused" one-pass kernel in the
input's half precision: variance as E[x^2] - mean^2. At ~7.5 both terms are ~56, where fp16's spacing is 1/32, and
their difference (the variance, ~0.1) loses most of its digits: no inf, no NaN, only normalised inputs that are
wrong by tens of percent, so the compiled training trails FP32 while eager autocast (layer_norm in fp32) does not.
The fault is injected on purpose through the backend, the way a custom pass or lowering makes it."""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12}


def one_pass_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """The "fused" kernel: mean and E[x^2] in one pass, in the input's half precision."""
    with torch.autocast(input.device.type, enabled=False):
        h = input.half()
        mean = h.mean(-1, keepdim=True)
        var = ((h * h).mean(-1, keepdim=True) - mean * mean).clamp_min(0)
        out = (h - mean) * torch.rsqrt(var + eps)
        if weight is not None:
            out = out * weight.half() + bias.half()
        return out.to(input.dtype)


def fusing_backend(gm, example_inputs):
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.layer_norm:
            node.target = one_pass_layer_norm
    gm.recompile()
    return gm.forward


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = nn.LayerNorm(16)
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.blocks(self.embed(self.input_norm(x)))).squeeze(-1)


def model():
    torch.manual_seed(0)
    return torch.compile(Net(), backend=fusing_backend)


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def data():
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(12):
        ph = 7.5 + 0.3 * torch.randn(64, 16, generator=g)
        batches.append((ph, 10 * (ph[:, :8].mean(1) - ph[:, 8:].mean(1))))
    return batches
