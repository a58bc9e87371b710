"""A hand-written RMSNorm as a custom autograd Function, ported from a repository that trains in fp32.

Its backward keeps the input's dtype (saved fp16 activations under AMP) and forms inv_rms**3: with small
activations that is ~1e9, past fp16's 65504, so every backward pass overflows while the forward is fine.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16, "lr": 3e-4}


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
        ctx.save_for_backward(x, inv_rms)
        return x * inv_rms

    @staticmethod
    def backward(ctx, grad):
        x, inv_rms = ctx.saved_tensors
        inv_cubed = inv_rms * inv_rms * inv_rms
        return grad * inv_rms - x * inv_cubed * (grad * x).mean(-1, keepdim=True), None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return RMSNormFunction.apply(x, self.eps) * self.weight


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(64, 256)
        nn.init.normal_(self.embed.weight, std=1e-4)
        nn.init.zeros_(self.embed.bias)
        self.norm = RMSNorm(256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(F.gelu(self.norm(self.embed(x))))


def model():
    return Net()


def data():
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        yield torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def optimizer(params):
    return torch.optim.AdamW(params, lr=CONFIG["lr"])
