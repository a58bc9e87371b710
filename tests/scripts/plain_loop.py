"""A training script without a GradScaler (bf16 autocast, plain optimizer.step()): the watch observes it through
PyTorch's optimizer hooks. ``--inf-lr-at K`` sets a huge learning rate at step K so the weights blow up."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(steps):
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    if step == 5 and "--poison" in sys.argv:
        x[0, 0] = float("inf")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {loss.item()!r}", flush=True)
