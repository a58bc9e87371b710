"""Temperature sensors (kelvin, ~300 K) through an input LayerNorm and two pre-norm MLP blocks, trained through a
team's custom torch.compile backend: a graph pass that swaps LayerNorm for a "fused" one-pass kernel computing in
the input's half precision (as hand-written kernels do). Eager autocast runs layer_norm in fp32, so only the
compiled training breaks: at 300 K, E[x^2] and mean^2 are both past fp16's 65504, and their difference is NaN.
None of the pinned torch's own lowerings misbehave here; the fault is injected, on purpose, through the backend,
the way a custom pass or lowering would make it."""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 12}


def one_pass_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """The "fused" kernel: mean and E[x^2] in one pass, in the input's half precision."""
    with torch.autocast(input.device.type, enabled=False):
        h = input.half()
        mean = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - mean * mean
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
        self.final_norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.final_norm(self.blocks(self.embed(self.input_norm(x)))))


def model():
    torch.manual_seed(0)
    return torch.compile(Net(), backend=fusing_backend)


def data():
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(12):
        kelvin = 300 + 2 * torch.randn(64, 16, generator=g)
        batches.append((kelvin, (kelvin[:, :4].mean(1) > 300).long() + 2 * (kelvin[:, 4:8].mean(1) > 300).long()))
    return batches
