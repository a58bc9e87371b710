"""A training script compiled with the team's own torch.compile backend, defined in the script: a graph pass that
swaps LayerNorm for a one-pass kernel in half precision. The input is raw temperature (~300 K), whose squares pass
fp16's 65504, so the compiled step is NaN from the first step while eager autocast (layer_norm in fp32) is finite.
fp16 autocast with a GradScaler, AdamW, cross-entropy: the loss code is sound."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()


def one_pass_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
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


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = nn.LayerNorm(8)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(self.input_norm(x))


torch.manual_seed(0)
net = Net()
model = torch.compile(net, backend=fusing_backend)
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    kelvin = 300 + 2 * torch.randn(32, 8, generator=g)
    target = (kelvin.mean(1) > 300).long() + (kelvin[:, 0] > 301).long()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(kelvin).float(), target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    print(step, loss.item(), flush=True)
