"""A small GAN trained the way people write one: two models, two optimizers, one GradScaler, and a
discriminator that joins only after a generator warm-up (its optimizer is created, and first stepped,
at step ``--d-starts``). It knows nothing of fp16doctor.

``--nan-at K`` puts one NaN into the real batch of step K (a broken sample reaching the discriminator).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Generator(nn.Module):
    def __init__(self, noise: int = 8, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(noise, width), nn.ReLU(), nn.Linear(width, 4))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.LeakyReLU(0.2), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--d-starts", type=int, default=3)
    parser.add_argument("--nan-at", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    real = torch.randn(args.steps * 16, 4, generator=g) * 0.5 + 2.0
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = None
    scaler = torch.amp.GradScaler("cpu")
    for step in range(args.steps):
        batch = real[step * 16:(step + 1) * 16].clone()
        if step == args.nan_at:
            batch[5, 1] = float("nan")  # a broken sample
        z = torch.randn(16, 8)
        if step >= args.d_starts:
            if opt_d is None:
                opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
            opt_d.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                real_logit, fake_logit = D(batch), D(G(z).detach())
            loss_d = (F.binary_cross_entropy_with_logits(real_logit.float(), torch.ones_like(real_logit.float()))
                      + F.binary_cross_entropy_with_logits(fake_logit.float(), torch.zeros_like(fake_logit.float())))
            scaler.scale(loss_d).backward()
            scaler.step(opt_d)
        opt_g.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            if step >= args.d_starts:
                out = D(fake)
                loss_g = F.binary_cross_entropy_with_logits(out.float(), torch.ones_like(out.float()))
            else:  # warm-up: match the data's mean and spread
                loss_g = (fake.float().mean(0) - batch.mean(0)).pow(2).sum() + (fake.float().std(0) - batch.std(0)).pow(2).sum()
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
        d_text = f" loss_d {loss_d.item()!r}" if step >= args.d_starts else ""
        print(f"step {step} loss_g {loss_g.item()!r}{d_text} scale {scaler.get_scale()!r}", flush=True)


if __name__ == "__main__":
    main()
