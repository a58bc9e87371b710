"""What watching costs a sharded run: ``fp16doctor watch`` on an FSDP2 training under torchrun, 2 CPU processes
with gloo, against the same run unwatched.

The workload: a 4-block MLP-mixer-style model (width 256, hidden 1024, batch 64), each block and the root wrapped
with ``fully_shard`` under ``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)``, AdamW
over the sharded (DTensor) parameters and a ``ShardedGradScaler``: the watch's sharded path (each rank's shard
measured, its own unsharded gradients checked before each reduce-scatter, the ranks compared in one all-gather
per step).

Paired and interleaved at the step: within one training run, after ``--warmup`` steps, the steps alternate
``plain, watched`` (ABAB); the observer is entered and left between steps on every rank at the same steps (it keeps
what it found, so a watched step is one of a long watch). Each watched step is divided by the mean of the plain
steps on either side of it, so the noise of a shared machine that lasts longer than a step cancels. Both ranks'
ratios are pooled. It prints the median of the paired ratios and their interquartile range, on the process's CPU
time and on wall time, against the target (watched <= 1.05 x plain). With two processes on two cores, wall time
includes each rank's wait for the other in the collectives; CPU time is a rank's own work.

    python benchmarks/watch_sharded_overhead.py [--rounds 30] [--warmup 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import iqr, residual_mlp  # noqa: E402

TARGET = 1.05


def worker(args: argparse.Namespace) -> None:
    """One rank: train, switching the watch on and off between steps; send the paired ratios to rank 0."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fp16doctor.live.observe import TrainingObserver, torchrun_rank
    from fp16doctor.live.watch import WatchOptions

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = residual_mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model[1:5]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = ShardedGradScaler("cpu")
    steps = args.warmup + 2 * args.rounds + 1
    settings = ["plain"] * args.warmup + ["plain", "watched"] * args.rounds + ["plain"]
    g = torch.Generator().manual_seed(rank)
    wall: list[float] = []
    cpu: list[float] = []
    with tempfile.TemporaryDirectory() as capsules:
        observer = TrainingObserver(WatchOptions(capsule_dir=Path(capsules)), rank=torchrun_rank())
        for step in range(steps):
            watched = settings[step] == "watched"
            if watched:
                observer.__enter__()
            x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
            if watched:
                observer.__exit__(None, None, None)
        assert observer.watches and observer.failure is None, "the watch did not watch"

    def ratios(times: list[float]) -> list[float]:
        return [
            times[i] / ((times[i - 1] + times[i + 1]) / 2)
            for i in range(1, steps - 1)
            if settings[i] == "watched" and settings[i - 1] == settings[i + 1] == "plain"
        ]

    mine = torch.tensor([ratios(cpu), ratios(wall)], dtype=torch.float64)
    plain = torch.tensor(
        [
            statistics.median(t for t, s in zip(cpu, settings) if s == "plain"),
            statistics.median(t for t, s in zip(wall, settings) if s == "plain"),
        ],
        dtype=torch.float64,
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    plains = [torch.empty_like(plain) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    dist.all_gather(plains, plain)
    if rank == 0:
        cpu_ratios = [v for t in everyone for v in t[0].tolist()]
        wall_ratios = [v for t in everyone for v in t[1].tolist()]
        steps_ms = ", ".join(
            f"rank {r}: CPU {p[0] * 1e3:.1f} ms, wall {p[1] * 1e3:.1f} ms" for r, p in enumerate(plains)
        )
        print(f"plain step (median): {steps_ms}", flush=True)
        for label, values in (("CPU", cpu_ratios), ("wall", wall_ratios)):
            ratio = statistics.median(values)
            verdict = "met" if ratio <= TARGET else "NOT met"
            print(
                f"fp16doctor watch / plain, {label:4s}: median {ratio:.3f}, IQR {iqr(values):.3f}, "
                f"{len(values)} pairs over {dist.get_world_size()} ranks (target <= {TARGET}: {verdict})",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="(plain, watched) pairs per rank")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    print(
        f"torch {torch.__version__}, FSDP2 fp16 + ShardedGradScaler, torchrun 2 processes (gloo, CPU), "
        f"{args.threads} thread(s) each; {args.warmup} warm-up steps, then {args.rounds} x (plain, watched), plain",
        flush=True,
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    command += ["--worker", "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    raise SystemExit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
