"""T5-style encoder as from a bf16-pretrained checkpoint (a user trial's file): no scaling of the residual
stream, a ReLU FFN whose output projection `wo` has large weights. Every layer's FFN output passes 65504 in
fp16 (fine in fp32): keeping the first `wo` in fp32 moves the overflow to the next layer's, and the set to keep
is every FFN's `wo` (Hugging Face's T5 `_keep_in_fp32_modules = ["wo"]`), not every Linear of the model."""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 6, "lr": 1e-4}
D, FF, T, B, V = 64, 128, 16, 16, 50

class T5RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__(); self.w = nn.Parameter(torch.ones(d)); self.eps = eps
    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (self.w * (x.float() * torch.rsqrt(var + self.eps))).to(x.dtype)

class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(D, FF, bias=False); self.wo = nn.Linear(FF, D, bias=False)
    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = T5RMSNorm(D); self.att = nn.MultiheadAttention(D, 4, batch_first=True)
        self.n2 = T5RMSNorm(D); self.ffn = FFN()
    def forward(self, x):
        h = self.n1(x)
        x = x + self.att(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.n2(x))

class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer() for _ in range(2)])
        self.norm = T5RMSNorm(D); self.cls = nn.Linear(D, 4)
    def forward(self, ids):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x)
        return self.cls(self.norm(x).mean(1))

def model():
    torch.manual_seed(0)
    m = Enc()
    with torch.no_grad():          # emulate the pretrained checkpoint's large FFN weights
        for l in m.layers:
            l.ffn.wi.weight.mul_(60.0)
            l.ffn.wo.weight.mul_(2000.0)
    return m

def data():
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        yield torch.randint(0, V, (B, T), generator=g), torch.randint(0, 4, (B,), generator=g)

def optimizer(params):
    return torch.optim.Adam(params, lr=1e-4)
