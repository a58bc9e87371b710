"""An FSDP2 training loop for torchrun (gloo on CPU): each block and the root wrapped with fully_shard under a
MixedPrecisionPolicy, AdamW over the sharded (DTensor) parameters, the model class in the script.

``--param-dtype float16`` (the default) trains with a ShardedGradScaler (``--scaler plain``: a plain GradScaler);
``--param-dtype bfloat16`` trains without a scaler. ``--param-dtype float32 --reduce-dtype float16``: fp32 compute,
gradients communicated in fp16 (with the scaler).
``--feature-scale S``: raw features S times larger (unnormalised measurements).
``--poison-rank R --poison-step K``: rank R's batch of step K carries a NaN feature (one broken shard of the data);
``--poison-value V``: that feature is V instead (1e6: finite in the fp32 batch, past fp16 once the policy casts it).
``--micro-batches M``: each step accumulates M micro-batches (the poisoned one is the first);
``--sync-last-only``: with gradient sync off until the last of them (``set_requires_gradient_sync``).
``--fsdp1``: FSDP1 instead, FullyShardedDataParallel with a MixedPrecision, each block its own unit
(``--orig-params``: with ``use_orig_params=True``).
``--head-fp32``: FSDP2's head sharded first with a policy of its own, its parameters in fp32.
``--device cuda``: each rank on its own GPU (LOCAL_RANK), NCCL; the batches drawn on the CPU as with ``cpu``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, dim=32, depth=2, classes=5):
        super().__init__()
        self.embed = nn.Linear(12, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--param-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--reduce-dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--feature-scale", type=float, default=1.0)
    parser.add_argument("--scaler", default="sharded", choices=["sharded", "plain"])
    parser.add_argument("--poison-rank", type=int, default=-1)
    parser.add_argument("--poison-step", type=int, default=-1)
    parser.add_argument("--poison-value", type=float, default=float("nan"))
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--sync-last-only", action="store_true")
    parser.add_argument("--fsdp1", action="store_true")
    parser.add_argument("--head-fp32", action="store_true")
    parser.add_argument("--orig-params", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net().to(device)
    param_dtype, reduce_dtype = getattr(torch, args.param_dtype), getattr(torch, args.reduce_dtype)
    if args.fsdp1:
        model = FullyShardedDataParallel(
            model,
            mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=device,
            use_orig_params=args.orig_params,
        )
    else:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        if args.head_fp32:
            fully_shard(
                model.head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
            )
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fp16 = "float16" in (args.param_dtype, args.reduce_dtype)
    if args.scaler == "sharded":
        scaler = ShardedGradScaler(args.device, enabled=fp16)
    else:
        scaler = torch.amp.GradScaler(args.device, enabled=fp16)

    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.micro_batches):
            x, y = torch.randn(16, 12, generator=g) * args.feature_scale, torch.randint(0, 5, (16,), generator=g)
            if rank == args.poison_rank and step == args.poison_step and micro == 0:
                x[3, 2] = args.poison_value
            x, y = x.to(device), y.to(device)
            if args.sync_last_only:
                model.set_requires_gradient_sync(micro == args.micro_batches - 1)
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y) / args.micro_batches
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"rank {rank} step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)

    weights = sum(getattr(p, "to_local", lambda p=p: p)().double().sum().item() for p in model.parameters())
    print(f"rank {rank} final weights {weights!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
