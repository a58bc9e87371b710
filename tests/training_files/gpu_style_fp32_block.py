"""GPU code that keeps a sensitive block in fp32 with `torch.autocast("cuda", enabled=False)`.

On the GPU it was written for, the block runs in fp32 and its values (past 65504) are safe. A CPU
probe must honour it too: there CUDA autocast does not exist, and ignoring the block would run it
under the probe's fp16 autocast and overflow. The head's gradients are also large for the default
scale: the GradScaler skips its first 3 steps while the scale settles, which on a 10-step run leaves
the AMP curve 3 updates behind FP32's; compared on the steps taken, the two agree.
"""
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 10}
class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)
    def forward(self, h):
        with torch.autocast(device_type="cuda", enabled=False):
            z = self.proj(h.float()) * 3000.0          # > 65504 in fp16 after proj: fine in fp32
            z = z - z.mean(-1, keepdim=True)
            z = z / 3000.0
        return self.out(z)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
        self.head = Head()
        with torch.no_grad():
            self.head.proj.weight.mul_(20)
    def forward(self, x):
        return self.head(self.body(x))
def model(): return Net()
def data():
    g = torch.Generator().manual_seed(7)
    for _ in range(10):
        yield torch.randn(32, 32, generator=g) * 3, torch.randint(0, 8, (32,), generator=g)
