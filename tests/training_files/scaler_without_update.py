"""A hand-written AMP loop that forgets scaler.update(): the scale never adapts, and the second
scaler.step() refuses ("unscale_() is being called after step()")."""
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 12}
def model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
def data():
    g = torch.Generator().manual_seed(23)
    for _ in range(12):
        yield torch.randn(32, 16, generator=g) * 30, torch.randint(0, 4, (32,), generator=g)
def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad()
    with autocast():
        loss = F.cross_entropy(model(x), y) * 50
    scaler.scale(loss).backward()
    scaler.step(optimizer)          # forgot scaler.update()
    return loss
