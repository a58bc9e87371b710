"""A small LLaMA-style language model trained with FSDP2 in pure fp16 (``param_dtype=torch.float16``, no autocast),
for torchrun (gloo on CPU): a hand-written RMSNorm with ``eps=1e-8`` right after a padding-aware embedding.

Padding tokens embed to zero vectors, so their rows reach the norm as zeros: ``rsqrt(mean(x**2) + eps)``. With fp32
parameters (autocast, or ``--param-dtype float32``) the epsilon keeps that finite; FSDP2's ``param_dtype`` casts the
parameters themselves, every op runs in fp16, where ``1e-8`` is 0, and ``0 * rsqrt(0)`` is NaN.

``--pad-step K``: from step K on, every rank's batches carry padded sequences (before it, full length ones).
``--checkpoint-mlp``: the MLP under activation checkpointing (``checkpoint_wrapper``, as torchtitan applies it before
``fully_shard``), which adds ``_checkpoint_wrapped_module`` to its parameters' names.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

VOCAB, PAD = 50, 0


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class TinyLM(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.norm = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        return self.lm_head(h + self.mlp(h))


def batch(generator, padded):
    tokens = torch.randint(1, VOCAB, (8, 12), generator=generator)
    if padded:
        tokens[:, 8:] = PAD  # shorter sequences, right-padded
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = PAD
    return tokens, targets


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--param-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--pad-step", type=int, default=3)
    parser.add_argument("--checkpoint-mlp", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    if args.checkpoint_mlp:
        model.mlp = checkpoint_wrapper(model.mlp)
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype), reduce_dtype=torch.float32)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler("cpu", enabled=args.param_dtype == "float16")

    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        tokens, targets = batch(g, padded=step >= args.pad_step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1), ignore_index=PAD)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"rank {rank} step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
