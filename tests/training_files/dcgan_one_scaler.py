"""PyTorch's DCGAN example (examples/dcgan/main.py), shrunk to 16x16 images and run under AMP.

The loop is the example's: a discriminator step on real and fake, then a generator step on the fake
labelled real, each with its own Adam (lr 2e-4, beta1 0.5), created here as the example creates them.
Mixed precision follows PyTorch's recipe for several models and optimizers: one GradScaler, each loss
scaled and backpropagated, scaler.step() for each optimizer, one scaler.update() at the end.
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "dtype": "float16"}
nz, ngf, ndf, nc = 16, 16, 16, 1


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),  # 1x1: a logit, for BCEWithLogits under autocast
        )

    def forward(self, x):
        return self.main(x).view(-1)


class DCGAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.netG = Generator()
        self.netD = Discriminator()
        self.apply(weights_init)


def model():
    return DCGAN()


def data():
    # blurry blobs in [-1, 1] stand in for the image folder, with the noise drawn for each batch
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        centre = torch.rand(32, 2, 1, 1, generator=g) * 10 + 3
        ys, xs = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
        d2 = (ys - centre[:, :1]) ** 2 + (xs - centre[:, 1:]) ** 2
        real = torch.exp(-d2 / 8.0) * 2 - 1
        yield real, torch.randn(32, nz, 1, 1, generator=g)


criterion = nn.BCEWithLogitsLoss()
real_label, fake_label = 1.0, 0.0
optimizerD = optimizerG = None


def train_step(model, batch, optimizer, scaler, autocast):
    global optimizerD, optimizerG
    netG, netD = model.netG, model.netD
    if optimizerD is None or optimizerD.param_groups[0]["params"][0] is not next(netD.parameters()):
        # setup optimizer (the example's), for the model being trained
        optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
        optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    real, noise = batch
    b_size = real.size(0)

    # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
    netD.zero_grad()
    label = torch.full((b_size,), real_label)
    with autocast():
        errD_real = criterion(netD(real), label)
    scaler.scale(errD_real).backward()
    with autocast():
        fake = netG(noise)
        label.fill_(fake_label)
        errD_fake = criterion(netD(fake.detach()), label)
    scaler.scale(errD_fake).backward()
    errD = errD_real + errD_fake
    scaler.step(optimizerD)

    # (2) Update G network: maximize log(D(G(z)))
    netG.zero_grad()
    with autocast():
        label.fill_(real_label)  # fake labels are real for generator cost
        errG = criterion(netD(fake), label)
    scaler.scale(errG).backward()
    scaler.step(optimizerG)

    scaler.update()
    return errD + errG
