"""A gradient penalty by PyTorch's AMP recipe: the gradients of the scaled loss are divided by the scale."""
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 10}
def model(): return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
def data():
    g = torch.Generator().manual_seed(61)
    for _ in range(10):
        yield torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    x.requires_grad_(True)
    optimizer.zero_grad()
    with autocast():
        out = model(x)
        loss = F.mse_loss(out, y)
    grads = torch.autograd.grad(scaler.scale(loss), x, create_graph=True)[0] / scaler.get_scale()
    with autocast():
        penalty = grads.pow(2).sum(-1).mean()
        total = loss + 10 * penalty
    scaler.scale(total).backward()
    scaler.step(optimizer)
    scaler.update()
    return total
