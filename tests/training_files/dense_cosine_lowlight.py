"""Dense self-supervised features for low-light microscopy (DenseCL / pixel-contrast style):
two augmented views of the same tile, per-pixel features L2-normalised by hand, loss =
1 - cosine similarity of matching pixels.

The tiles are mostly dark background (intensities ~1e-4 after scaling to [0, 1]) with a few
bright cells.  Fine in fp32; the AMP loss is NaN from the first step.
"""
import torch
from torch import nn

CONFIG = {"steps": 12, "lr": 1e-3}


def l2n(f):                                   # "faster than F.normalize"
    return f / torch.sqrt((f * f).sum(dim=1, keepdim=True))


class DenseEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        self.proj = nn.Conv2d(32, 32, 1)

    def forward(self, a, b):
        return l2n(self.proj(self.body(a))), l2n(self.proj(self.body(b)))


def model():
    m = DenseEncoder()
    with torch.no_grad():
        for c in m.modules():
            if isinstance(c, nn.Conv2d):
                c.bias.zero_()
    return m


def data():
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        img = torch.rand(4, 1, 24, 24, generator=g) * 2e-4            # dark background
        cells = torch.rand(4, 1, 24, 24, generator=g) > 0.97
        img = img + cells * (0.5 + 0.5 * torch.rand(4, 1, 24, 24, generator=g))
        a = img * (0.9 + 0.2 * torch.rand(4, 1, 1, 1, generator=g)) + 5e-5 * torch.rand(4, 1, 24, 24, generator=g)
        b = img * (0.9 + 0.2 * torch.rand(4, 1, 1, 1, generator=g)) + 5e-5 * torch.rand(4, 1, 24, 24, generator=g)
        yield a, b


def loss(model, batch):
    fa, fb = model(*batch)
    return (1 - (fa * fb).sum(1)).mean()
