"""A DistributedDataParallel AMP loop for torchrun (gloo on CPU), its model class in the script.

``--poison-rank R --poison-step K``: rank R's batch of step K carries a NaN feature (one broken shard).
``--skew-scale-rank R``: rank R builds its GradScaler with another init_scale (ranks then disagree on the scale).
``--fp16-compress``: gradients all-reduced in fp16 (DDP's fp16_compress_hook).
``--feature-scale S``: raw features S times larger (unnormalised measurements).
``--save PATH``: rank 0 saves the model at the end. ``--resume PATH``: the model resumes from PATH, loaded on
rank 0 only after DDP wrapped it (DDP broadcast the weights when it was built, not after).
``--slow-rank R --slow-step K --slow-seconds T``: rank R takes T seconds between its step and the scaler's update
at step K (a slow disk under its checkpoint).
``--micro-batches M``: each step accumulates M micro-batches (the poisoned one is the first); ``--no-sync``: all
but the last under DDP's ``no_sync()``.
``--drift-rank R --drift-step K``: after step K rank R alone scales the last layer's bias by 0.9, outside DDP (a
fix-up one rank runs): from there the replicas differ.
``--device cuda``: each rank on its own GPU (LOCAL_RANK), NCCL; the batches drawn on the CPU as with ``cpu``.
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.body(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--poison-rank", type=int, default=-1)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--skew-scale-rank", type=int, default=-1)
    parser.add_argument("--fp16-compress", action="store_true")
    parser.add_argument("--feature-scale", type=float, default=1.0)
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-step", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--no-sync", action="store_true")
    parser.add_argument("--drift-rank", type=int, default=-1)
    parser.add_argument("--drift-step", type=int, default=-1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Net().to(device))
    if args.fp16_compress:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    if args.resume and rank == 0:
        model.module.load_state_dict(torch.load(args.resume, map_location=device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(args.device, init_scale=2.0**12 if rank == args.skew_scale_rank else 2.0**16)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.micro_batches):
            x, y = torch.randn(16, 8, generator=g) * args.feature_scale, torch.randint(0, 3, (16,), generator=g)
            if rank == args.poison_rank and step == args.poison_step and micro == 0:
                x[1, 1] = float("nan")
            x, y = x.to(device), y.to(device)
            unsynced = args.no_sync and micro < args.micro_batches - 1
            with model.no_sync() if unsynced else contextlib.nullcontext():
                with torch.autocast(args.device, dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y) / args.micro_batches
                scaler.scale(loss).backward()
        scaler.step(optimizer)
        if rank == args.slow_rank and step == args.slow_step:
            time.sleep(args.slow_seconds)
        scaler.update()
        if rank == args.drift_rank and step >= args.drift_step >= 0:
            with torch.no_grad():
                model.module.body[2].bias.mul_(0.9)
        print(f"rank {rank} step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)
    if args.save and rank == 0:
        torch.save(model.module.state_dict(), args.save)
    weights = sum(p.double().sum().item() for p in model.parameters())
    print(f"rank {rank} final weights {weights!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
