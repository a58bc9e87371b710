"""A hand-written AMP training script, written the way people write them (nanoGPT style): argparse, the model
class defined in the script itself, a DataLoader, its own GradScaler loop, the loss computed outside the model.

It knows nothing of fp16doctor. ``--nan-at K`` puts one NaN feature into the batch of step K (a broken sample in the data);
``--raw-at K`` gives step K a batch 10,000 times larger (measurements that skipped normalisation).
``--groups`` trains in two parameter groups, listed head first (the head at 10x the rate, no weight decay on
biases); ``--own-optimizer`` uses an optimizer class defined in this script.
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


class MomentumSGD(torch.optim.Optimizer):
    """The script's own optimizer: SGD with momentum, written out."""

    def __init__(self, params, lr=1e-3, momentum=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad + group["weight_decay"] * p)
                p.add_(buf, alpha=-group["lr"])


def parameter_groups(model: Classifier, lr: float) -> list[dict]:
    head = model.body[3]
    body = [p for n, p in model.named_parameters() if not n.startswith("body.3")]
    return [
        {"params": list(head.parameters()), "lr": 10 * lr, "weight_decay": 0.0},
        {"params": body, "lr": lr, "weight_decay": 0.01},
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--raw-at", type=int, default=-1)
    parser.add_argument("--groups", action="store_true")
    parser.add_argument("--own-optimizer", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * 16, 8, generator=g)
    y = torch.randint(0, 3, (args.steps * 16,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))

    model = Classifier(args.width)
    params = parameter_groups(model, args.lr) if args.groups else model.parameters()
    optimizer = (MomentumSGD if args.own_optimizer else torch.optim.AdamW)(params, lr=args.lr)
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
