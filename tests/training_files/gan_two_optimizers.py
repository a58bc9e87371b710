"""A small GAN with two optimizers, following PyTorch's AMP recipe for several optimizers.

One GradScaler serves both: each loss is scaled and backpropagated, each optimizer steps through
scaler.step() (it skips the step when its own gradients hold inf/NaN), and scaler.update() runs
once per iteration, after the last scaler.step(). Each optimizer has its own LR schedule. The scaler starts high (2^24), so the first steps
overflow and are skipped while the scale settles: that is the scaler at work, not a fault.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "scaler": {"init_scale": 2.0 ** 24}}
LATENT = 16


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(LATENT, 64), nn.LeakyReLU(0.2), nn.Linear(64, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))


def model():
    return GAN()


def data():
    g = torch.Generator().manual_seed(5)
    mean = torch.randn(8, generator=g)
    for _ in range(20):
        yield mean + 0.3 * torch.randn(64, 8, generator=g), torch.randn(64, LATENT, generator=g)


def optimizers(model):
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(model.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    return opt_g, opt_d


def scheduler(optimizer):
    # one schedule per optimizer, as a tuple matching optimizers()
    return tuple(torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5) for opt in optimizer)


def train_step(model, batch, optimizer, scaler, autocast):
    opt_g, opt_d = optimizer
    real, noise = batch
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

    opt_d.zero_grad(set_to_none=True)
    with autocast():
        fake = model.generator(noise)
        loss_d = (F.binary_cross_entropy_with_logits(model.discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(model.discriminator(fake.detach()), zeros))
    scaler.scale(loss_d).backward()
    scaler.step(opt_d)

    opt_g.zero_grad(set_to_none=True)
    with autocast():
        loss_g = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
    scaler.scale(loss_g).backward()
    scaler.step(opt_g)

    scaler.update()
    return loss_d + loss_g
