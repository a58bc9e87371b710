"""What watching costs a compiled training: the observer behind ``fp16doctor watch`` on a ``torch.compile``'d model
(inductor on CPU), against the same run unwatched.

The workload: a 4-block pre-norm MLP model (width 256, hidden 1024, batch 64) compiled with ``torch.compile``,
fp16 autocast with a GradScaler and AdamW, one process.

Paired and interleaved at the step: within one training run, after ``--warmup`` steps (the compilation, and one
watched step, so that the graph compiled while the watch's global hooks were on is in dynamo's cache too), the steps
alternate ``plain, watched`` (ABAB); the observer is entered and left between steps (it keeps what it found, so a
watched step is one of a long watch). Each watched step is divided by the mean of the plain steps on either side of
it, so the noise of a shared machine that lasts longer than a step cancels. It prints the median of the paired
ratios and their interquartile range, on CPU time and on wall time, against the target (watched <= 1.05 x plain),
and the counts dynamo keeps, which are deterministic: the graphs compiled and the graph breaks during the measured
steps (both must be 0).

Beside them, and interleaved the same way, a third setting: the plain step plus one read of the gradients, the
per-layer L2 norms the watch reads every ``norms_every`` steps and on trouble (``torch._foreach_norm``, one sync),
unwatched, at every step. Its ratio is what a check that read them at every step would pay for them; the watch
pays a fifth of it (by default), plus its own Python per step.

    python benchmarks/watch_compiled_overhead.py [--rounds 40] [--warmup 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import iqr, residual_mlp  # noqa: E402

TARGET = 1.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40, help="(plain, watched) pairs")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (the last one watched)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from torch._dynamo.utils import counters

    from fp16doctor.live.observe import TrainingObserver
    from fp16doctor.live.watch import WatchOptions

    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = residual_mlp()
    compiled = torch.compile(model, dynamic=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    settings = (
        ["plain"] * (args.warmup - 1)
        + ["watched"]
        + ["plain", "watched", "plain", "gradient read"] * args.rounds
        + ["plain"]
    )
    params = list(model.parameters())
    print(
        f"torch {torch.__version__}, torch.compile (inductor, CPU), fp16 autocast + GradScaler, {args.threads} "
        f"thread(s); {args.warmup} warm-up steps, then {args.rounds} x (plain, watched), plain",
        flush=True,
    )
    g = torch.Generator().manual_seed(0)
    wall: list[float] = []
    cpu: list[float] = []
    measured_from = (0, 0)
    with tempfile.TemporaryDirectory() as capsules:
        observer = TrainingObserver(WatchOptions(capsule_dir=Path(capsules)))
        for step, setting in enumerate(settings):
            if step == args.warmup:
                measured_from = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
            if setting == "watched":
                observer.__enter__()
            x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(compiled(x).float(), y)
            scaler.scale(loss).backward()
            if setting == "gradient read":  # what the watch's measurement reads, without the watch
                scaler.unscale_(optimizer)
                grads = [p.grad for p in params if p.grad is not None]
                torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).tolist()
            scaler.step(optimizer)
            scaler.update()
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
            if setting == "watched":
                observer.__exit__(None, None, None)
        assert observer.watches and observer.failure is None, "the watch did not watch"
    graphs = counters["stats"]["unique_graphs"] - measured_from[0]
    breaks = sum(counters["graph_break"].values()) - measured_from[1]

    def ratios(times: list[float], setting: str = "watched") -> list[float]:
        return [
            times[i] / ((times[i - 1] + times[i + 1]) / 2)
            for i in range(args.warmup, len(settings) - 1)
            if settings[i] == setting and settings[i - 1] == settings[i + 1] == "plain"
        ]

    plain_cpu = statistics.median(t for t, s in zip(cpu[args.warmup :], settings[args.warmup :]) if s == "plain")
    print(f"plain compiled step (median): CPU {plain_cpu * 1e3:.1f} ms", flush=True)
    for label, times in (("CPU", cpu), ("wall", wall)):
        values = ratios(times)
        ratio = statistics.median(values)
        verdict = "met" if ratio <= TARGET else "NOT met"
        print(
            f"fp16doctor watch / plain, {label:4s}: median {ratio:.3f}, IQR {iqr(values):.3f}, {len(values)} pairs "
            f"(target <= {TARGET}: {verdict})",
            flush=True,
        )
    read = ratios(cpu, "gradient read")
    print(
        f"one read of the gradients (their per-layer norms, unwatched) / plain, CPU: median {statistics.median(read):.3f}, "
        f"IQR {iqr(read):.3f}: what reading them at every step would cost (the watch reads them every "
        f"{WatchOptions().norms_every} steps and on trouble)",
        flush=True,
    )
    print(f"during the measured steps: {graphs} graph(s) compiled, {breaks} graph break(s) (both must be 0)")


if __name__ == "__main__":
    main()
