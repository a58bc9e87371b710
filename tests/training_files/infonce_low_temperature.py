"""SimCLR-style pretraining on tabular features (two noisy "views" per row).

Projection head ends in BatchNorm like SimCLR v2. NT-Xent with temperature 0.01
(we found lower temperatures work better for us). Runs in fp32; with AMP the
loss is inf from the very first step.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "lr": 1e-3}

IN_DIM, HID, PROJ = 64, 512, 1024
BATCH = 32
TEMPERATURE = 0.01


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_DIM, HID), nn.ReLU(), nn.Linear(HID, HID), nn.ReLU())

    def forward(self, x):
        return self.net(x)


class ProjectionHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HID, HID)
        self.bn1 = nn.BatchNorm1d(HID)
        self.fc2 = nn.Linear(HID, PROJ)
        self.bn2 = nn.BatchNorm1d(PROJ, affine=False)

    def forward(self, h):
        return self.bn2(self.fc2(F.relu(self.bn1(self.fc1(h)))))


class SimCLR(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = ProjectionHead()

    def forward(self, x1, x2):
        z1 = self.head(self.encoder(x1))
        z2 = self.head(self.encoder(x2))
        return z1, z2


def nt_xent(z1, z2, temperature=TEMPERATURE):
    # TODO: should these be L2-normalised? the BN already keeps them at unit scale
    n = z1.shape[0]
    z = torch.cat([z1, z2], dim=0)
    sim = torch.mm(z, z.t()) / temperature
    sim = sim - torch.eye(2 * n, device=z.device, dtype=sim.dtype) * 1e4   # remove self-similarity
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def model():
    return SimCLR()


def augment(x, g):
    return x + 0.3 * torch.randn(x.shape, generator=g)


def data():
    g = torch.Generator().manual_seed(1)
    for _ in range(CONFIG["steps"]):
        x = torch.randn(BATCH, IN_DIM, generator=g)
        yield augment(x, g), augment(x, g)


def loss(model, batch):
    x1, x2 = batch
    z1, z2 = model(x1, x2)
    return nt_xent(z1, z2)


def optimizer(params):
    return torch.optim.AdamW(params, lr=CONFIG["lr"], weight_decay=1e-6)


def scheduler(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=CONFIG["steps"])
