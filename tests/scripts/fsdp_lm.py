"""A tiny language model trained with FSDP under torchrun (gloo on CPU), in fp16 with a loss scaler.

``--wrap fsdp1``: FullyShardedDataParallel(mixed_precision=MixedPrecision(...)) (FSDP1, on CPU with
device_id=cpu); ``--wrap fsdp2``: fully_shard with a MixedPrecisionPolicy. ``--scaler sharded``: FSDP's
ShardedGradScaler; ``--scaler plain``: torch.amp.GradScaler.
``--pad-rank R --pad-step K``: rank R's batch of step K is mostly padding (short documents padded to the
sequence length), and the loss does not ignore the pad token: the pad token's logit row gets a huge gradient.
``--tie``: the output projection's weight is the embedding's (tied, as most language models do).
``--nan-rank R --nan-step K``: rank R's loss of step K is NaN (what a broken sample's loss becomes).
``--momentum M``: SGD with momentum (state per parameter; none by default).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

PAD = 0
VOCAB = 64


class TinyLM(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.mix(self.embed(ids))) + self.embed(ids))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--wrap", default="fsdp1", choices=["fsdp1", "fsdp2"])
    parser.add_argument("--scaler", default="sharded", choices=["sharded", "plain"])
    parser.add_argument("--pad-rank", type=int, default=-1)
    parser.add_argument("--pad-step", type=int, default=-1)
    parser.add_argument("--tie", action="store_true")
    parser.add_argument("--nan-rank", type=int, default=-1)
    parser.add_argument("--nan-step", type=int, default=-1)
    parser.add_argument("--momentum", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    if args.tie:  # as GPT-2 does: one weight, initialised small (a unit-normal one would make huge logits)
        model.lm_head.weight = model.embed.weight
        nn.init.normal_(model.embed.weight, std=0.02)
    if args.wrap == "fsdp1":
        policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float16)
        model = FullyShardedDataParallel(model, mixed_precision=policy, device_id=torch.device("cpu"))
    else:
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=args.momentum)
    scaler = ShardedGradScaler("cpu") if args.scaler == "sharded" else torch.amp.GradScaler("cpu")

    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        ids = torch.randint(1, VOCAB, (8, 512), generator=g)
        if rank == args.pad_rank and step == args.pad_step:
            ids[:, 100:] = PAD
        optimizer.zero_grad()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        if rank == args.nan_rank and step == args.nan_step:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"rank {rank} step {step} loss {loss.item()!r} scale {scaler.get_scale()!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
