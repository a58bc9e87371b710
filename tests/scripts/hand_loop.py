"""A hand-written AMP training script, written the way people write them (nanoGPT style): argparse, the model
class defined in the script itself, a DataLoader, its own GradScaler loop, the loss computed outside the model.

It knows nothing of fp16doctor. ``--nan-at K`` puts one NaN feature into the batch of step K (a broken sample in the data);
``--raw-at K`` gives step K a batch 10,000 times larger (measurements that skipped normalisation).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, 3))

    def forward(self, x):
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--raw-at", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * 16, 8, generator=g)
    y = torch.randint(0, 3, (args.steps * 16,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))

    model = Classifier(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")
    for step, (xb, yb) in enumerate(loader):
        if step == args.nan_at:
            xb[3, 2] = float("nan")  # a broken sample
        if step == args.raw_at:
            xb = xb * 1e4
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(xb)
        loss = F.cross_entropy(logits.float(), yb, label_smoothing=0.05)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)


if __name__ == "__main__":
    main()
