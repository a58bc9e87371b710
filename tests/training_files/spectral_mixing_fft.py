"""A Fourier-neural-operator-style spectral mixing layer (torch.fft.rfft over 48 positions).

Under AMP the layer's input comes out of a Linear in fp16, and the FFT refuses it: cuFFT computes in
half precision only for power-of-two sizes (the CPU not at all), so the training raises under AMP only.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 10, "lr": 1e-3}


class SpectralMixing(nn.Module):
    def __init__(self, channels, modes=12):
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(channels, modes, 2) * 0.02)   # real and imaginary parts

    def forward(self, h):                      # h: (batch, positions, channels)
        spectrum = torch.fft.rfft(h, dim=1)    # (batch, positions // 2 + 1, channels)
        mixed = torch.zeros_like(spectrum)
        mixed[:, : self.modes] = spectrum[:, : self.modes] * torch.view_as_complex(self.weight).T
        return torch.fft.irfft(mixed, n=h.shape[1], dim=1)


class FNO(nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = nn.Linear(2, 32)
        self.mix = SpectralMixing(32)
        self.project = nn.Linear(32, 1)

    def forward(self, x):
        h = self.lift(x)
        return self.project(F.gelu(h + self.mix(h)))


def model():
    return FNO()


def data():
    g = torch.Generator().manual_seed(9)
    grid = torch.linspace(0, 1, 48).expand(16, 48)
    for _ in range(10):
        u = torch.sin(6.28 * grid * torch.randint(1, 4, (16, 1), generator=g))
        yield torch.stack([u, grid], -1), torch.cumsum(u, 1).unsqueeze(-1) / 48


def loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)
