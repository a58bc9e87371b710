"""A hand-written loop that logs a float (`return out.item()`), over a DataLoader whose last batch is short."""
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 8}
def model(): return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
def data():
    g = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(torch.randn(70, 10, generator=g), torch.randint(0, 2, (70,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False)   # last batch has 6 rows
def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad()
    with autocast():
        out = F.cross_entropy(model(x), y)
    scaler.scale(out).backward()
    scaler.step(optimizer)
    scaler.update()
    return out.item()                         # people log a float
