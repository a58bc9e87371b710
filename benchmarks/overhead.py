"""Overhead of fp16doctor's instruments, and the speed of CPU AMP probes.

Prints three ratios of median step times, all measured in this one process on
the same model (benchmarks/bert_like.py: 4-layer BERT-like encoder, batch
16 x 128, AdamW), with the variants interleaved step by step so that machine
noise hits them alike:

1. instrumented / plain          (target <= 1.15): AMP probe with forward, activation-gradient,
                                  parameter-gradient and update statistics on, every step
2. naive .item() detector / plain: a per-module detector that syncs with the host per statistic,
                                  like Hugging Face's DebugUnderflowOverflow
3. fp16 AMP probe / fp32 probe    (target <= 2.0): the CPU emulation of tensor-core GEMMs

Usage: python benchmarks/overhead.py [--steps N] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp16doctor.config import build_config  # noqa: E402
from fp16doctor.engine.probe import Workbench  # noqa: E402
from fp16doctor.userfile.spec import load_training_file  # noqa: E402


class NaiveDetector:
    """The baseline: per module, inputs/outputs/weights abs min/max and NaN/inf checks, each with .item()."""

    def __init__(self, model: torch.nn.Module):
        self.handles = [m.register_forward_hook(self.hook) for m in model.modules()]

    @staticmethod
    def describe(t: torch.Tensor) -> None:
        a = t.detach().abs()
        a.min().item(), a.max().item()
        torch.isnan(t).any().item(), torch.isinf(t).any().item()

    def hook(self, module: torch.nn.Module, args, output) -> None:
        for t in [*args, output, *module.parameters(recurse=False)]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.describe(t)
            elif isinstance(t, tuple):
                for x in t:
                    if isinstance(x, torch.Tensor) and x.is_floating_point():
                        self.describe(x)


def timed_step(probe) -> float:
    start = time.perf_counter()
    probe.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per variant (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = load_training_file(ROOT / "benchmarks" / "bert_like.py")
    bench = Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": args.steps + 2}))
    probes = {
        "plain": bench.probe("amp", instruments=None),
        "instrumented": bench.probe("amp", instruments=None),
        "naive": bench.probe("amp", instruments=None),
        "fp32": bench.probe("fp32", instruments=None),
    }
    probes["instrumented"].instrument()  # the others carry none: instruments=None below
    NaiveDetector(probes["naive"].model)

    times: dict[str, list[float]] = {name: [] for name in probes}
    for i in range(args.steps + 2):
        for name, probe in probes.items():
            elapsed = timed_step(probe)
            if i >= 2:
                times[name].append(elapsed)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.steps} steps per variant")
    for name, value in median.items():
        print(f"  median step {name:13s} {value * 1000:8.1f} ms")
    inst = median["instrumented"] / median["plain"]
    naive = median["naive"] / median["plain"]
    amp = median["plain"] / median["fp32"]
    print(f"instrumented / plain        = {inst:.3f}  (target <= 1.15: {'met' if inst <= 1.15 else 'NOT met'})")
    print(f"naive .item() detector / plain = {naive:.3f}")
    print(f"fp16 AMP probe / fp32 probe = {amp:.3f}  (target <= 2.0: {'met' if amp <= 2.0 else 'NOT met'})")


if __name__ == "__main__":
    main()
