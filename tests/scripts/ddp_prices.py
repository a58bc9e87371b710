"""House prices in dollars under DistributedDataParallel for torchrun (gloo on CPU): an fp16 trunk under autocast and
a regression head kept in fp32 (autocast off around it), a GradScaler, and PyTorch's fp16 gradient-compression hook
to halve the all-reduce's bytes. The head's gradients (a price error of ~1e5 dollars) are finite in fp32 on every
rank; the hook casts them to fp16, where they are not: the reduction, not any rank, skips every step.

``--no-hook``: DDP's default all-reduce (in fp32): the same training steps.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel


class PriceModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.trunk(x)
        with torch.autocast(x.device.type, enabled=False):  # prices in dollars: the head in fp32
            return self.head(h.float())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--no-hook", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(PriceModel())
    if not args.no_hook:
        model.register_comm_hook(None, fp16_compress_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 12, generator=g)
        price = 350_000 + 90_000 * x[:, :2].sum(dim=1, keepdim=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), price)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"rank {rank} step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
