"""The same GAN, with a stray discriminator step: scaler.step(opt_d) and then opt_d.step() as well.

The discriminator now steps twice per iteration, and on a step the scaler skips (inf/NaN in its
gradients while the scale settles) the plain opt_d.step() applies those gradients anyway.
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
    opt_d.step()  # left over from the FP32 version of the loop

    opt_g.zero_grad(set_to_none=True)
    with autocast():
        loss_g = F.binary_cross_entropy_with_logits(model.discriminator(fake), ones)
    scaler.scale(loss_g).backward()
    scaler.step(opt_g)

    scaler.update()
    return loss_d + loss_g
