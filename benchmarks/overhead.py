"""Overhead of fp16doctor's instruments, measured so that 5% shows; and the speed of CPU AMP probes.

One AMP probe of benchmarks/bert_like.py (4-layer BERT-like encoder, batch 16 x 128, AdamW) steps
through rounds of ``plain, instrumented, plain, report, plain`` on one batch per round (with ``--also every
naive fp32``: ``plain, instrumented, plain, report, plain, every, plain, naive, plain, fp32, plain``):

* plain:        the probe with no instrument attached;
* instrumented: the same probe, the same model and the same batch, with the instruments every probe of a
                diagnosis carries (``probe.DEFAULT_INSTRUMENTS``: what the rules read, forward outputs' exact
                ranges and update health) attached (target <= 1.05 x plain);
* report:       the same with what the AMP probe of ``diagnose --report`` carries for the plots too
                (``probe.PLOT_INSTRUMENTS``: activation-gradient ranges, parameter-gradient statistics;
                target <= 1.05 x plain);
* every:        every statistic the instruments can take (``InstrumentOptions()``: the module rows' sampled
                shares too, which no rule or plot reads; for the API's callers, no target);
* naive:        the same probe with a per-module detector that syncs with the host per statistic, like
                Hugging Face's DebugUnderflowOverflow (for scale);
* fp32:         an FP32 probe on the same batch (the CPU emulation of tensor-core GEMMs: AMP / FP32 <= 2.0).

Hooks are attached and removed between steps, outside the timed region. Each timed step is divided by
the mean of the two plain steps around it (a paired ratio: machine noise that lasts longer than a step
cancels). A block of ``--pairs`` rounds gives each variant the median of its paired ratios; blocks are
repeated until the interquartile range of the blocks' medians (the spread of the estimate) is under
``--spread`` (2%), from ``--min-blocks`` up to ``--max-blocks``. It prints the median over all paired
ratios, the IQR of the paired ratios (step-to-step noise) and the IQR of the block medians.

It also counts, on one plain and one instrumented step of the same batch, the aten operators dispatched
and the host synchronisations (``aten::_local_scalar_dense``: ``.item()``, ``float(t)``, ``if t:``; and
device-to-host copies) with a ``TorchDispatchMode``: deterministic numbers (checked on a second step)
that predict the cost on a GPU, where launches and syncs dominate.

Steps are timed on the process's CPU time on CPU and on elapsed time on CUDA, where the host waits for
the device (``--clock`` chooses).

Usage: python benchmarks/overhead.py [--pairs N] [--also every naive fp32] [--threads T] [--device cpu|cuda] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import iqr  # noqa: E402

from fp16doctor.config import build_config
from fp16doctor.engine.instruments import InstrumentOptions, Instruments
from fp16doctor.engine.probe import DEFAULT_INSTRUMENTS, PLOT_INSTRUMENTS, Probe, Workbench
from fp16doctor.userfile.spec import load_training_file

WARMUP_ROUNDS = 2
"""Rounds run and thrown away first: optimizer state, allocator pools and the thread pool settle."""
TARGET = {"instrumented": 1.05, "report": 1.05, "fp32": 2.0}
"""The targets of the ratios to plain (fp32's is AMP / FP32, plain over fp32)."""

aten = torch.ops.aten

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
"""``cpu``: the process's CPU time, all its threads (a neighbour on a shared machine delays a step's wall time
but adds nothing to its CPU time); ``wall``: elapsed time, what a user waits (on a quiet machine, or a GPU)."""
CLOCK = CLOCKS["cpu"]


class NaiveDetector:
    """The baseline: per module, inputs/outputs/weights abs min/max and NaN/inf checks, each with .item()."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list[Any] = []

    def attach(self) -> None:
        self.handles = [m.register_forward_hook(self.hook) for m in self.model.modules()]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @staticmethod
    def describe(t: torch.Tensor) -> None:
        a = t.detach().abs()
        a.min().item(), a.max().item()
        torch.isnan(t).any().item(), torch.isinf(t).any().item()

    def hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for t in [*args, output, *module.parameters(recurse=False)]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.describe(t)
            elif isinstance(t, tuple):
                for x in t:
                    if isinstance(x, torch.Tensor) and x.is_floating_point():
                        self.describe(x)


def detached(probe: Probe, options: InstrumentOptions) -> Instruments:
    """Instruments built for ``probe`` and taken off it again: :func:`instrumented` attaches them per step."""
    instruments = probe.instrument(options)
    instruments.detach()
    probe.instruments = None
    return instruments


@contextlib.contextmanager
def instrumented(probe: Probe, instruments: Instruments, on: bool) -> Iterator[None]:
    """The probe with its instruments attached (``on``) or with no hook at all: the same model either way."""
    if on:
        instruments.attach()
        probe.instruments = instruments
    try:
        yield
    finally:
        instruments.detach(release=False)  # its buffers stay, as they do between the steps of a diagnosis's probe
        probe.instruments = None


@contextlib.contextmanager
def detecting(detector: NaiveDetector) -> Iterator[None]:
    detector.attach()
    try:
        yield
    finally:
        detector.detach()


@dataclass
class Variant:
    """One way of taking the round's step: ``wrap`` sets it up around the timed step (untimed)."""

    name: str
    probe: Probe
    wrap: Callable[[], contextlib.AbstractContextManager[None]]

    def timed_step(self, batch: Any, index: int) -> float:
        with self.wrap():
            start = CLOCK()
            self.probe.step(batch, index)
            return CLOCK() - start


@dataclass
class Samples:
    """Paired ratios to plain, per variant, in blocks."""

    blocks: dict[str, list[list[float]]] = field(default_factory=dict)

    def add_block(self, ratios: dict[str, list[float]]) -> None:
        for name, values in ratios.items():
            self.blocks.setdefault(name, []).append(values)

    def pooled(self, name: str) -> list[float]:
        return [r for block in self.blocks[name] for r in block]

    def block_medians(self, name: str) -> list[float]:
        return [statistics.median(block) for block in self.blocks[name]]


def run_block(
    plain: Variant, others: list[Variant], batches: list[Any], rounds: int, first: int
) -> dict[str, list[float]]:
    """``rounds`` rounds ``P X1 P X2 ... P``, each on one batch; each X's time over the mean of its neighbours."""
    ratios: dict[str, list[float]] = {v.name: [] for v in others}
    for r in range(first, first + rounds):
        index = r % len(batches)
        before = plain.timed_step(batches[index], index)
        for variant in others:
            elapsed = variant.timed_step(batches[index], index)
            after = plain.timed_step(batches[index], index)
            ratios[variant.name].append(elapsed / ((before + after) / 2))
            before = after
    return ratios


class DispatchCounter(TorchDispatchMode):
    """Counts every aten operator dispatched, the host syncs (``_local_scalar_dense``) and device-to-host copies."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.scalar_syncs = 0
        self.device_to_host = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops[str(func.overloadpacket.__name__)] += 1
        if func is aten._local_scalar_dense.default:
            self.scalar_syncs += 1
        elif func in (aten._to_copy.default, aten.copy_.default) and args and isinstance(args[0], torch.Tensor):
            source, target = (args[1], args[0]) if func is aten.copy_.default else (args[0], out)
            if isinstance(source, torch.Tensor) and source.device.type != "cpu" and target.device.type == "cpu":
                self.device_to_host += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_step(variant: Variant, batch: Any, index: int) -> DispatchCounter:
    """What one step of ``variant`` dispatches (untimed)."""
    counter = DispatchCounter()
    with variant.wrap(), counter:
        variant.probe.step(batch, index)
    return counter


def dispatch_table(plain: Variant, others: list[Variant], batch: Any) -> list[str]:
    """Per step: operators, host syncs and device-to-host copies of each variant, and what it adds to plain;
    each counted twice, to show that the numbers are deterministic."""
    lines = [f"  {'per step':13s} {'aten ops':>9s} {'extra':>7s} {'syncs':>6s} {'extra':>6s} {'D2H':>4s} {'extra':>6s}"]
    base = [count_step(plain, batch, 0) for _ in range(2)]
    for variant in [plain, *others]:
        counts = base if variant is plain else [count_step(variant, batch, 0) for _ in range(2)]
        c = counts[0]
        same = all(
            (k.total, k.scalar_syncs, k.device_to_host) == (c.total, c.scalar_syncs, c.device_to_host) for k in counts
        )
        lines.append(
            f"  {variant.name:13s} {c.total:9d} {c.total - base[0].total:+7d} {c.scalar_syncs:6d} "
            f"{c.scalar_syncs - base[0].scalar_syncs:+6d} {c.device_to_host:4d} {c.device_to_host - base[0].device_to_host:+6d}"
            + ("" if same else f"  (a second step differed: {counts[1].total} ops, {counts[1].scalar_syncs} syncs)")
        )
    extra = count_step(others[0], batch, 0).ops - base[0].ops
    lines.append(
        "  the instruments' extra operators, most frequent: "
        + ", ".join(f"{name} {n}" for name, n in extra.most_common(8))
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="rounds per block (each: one paired ratio per variant)")
    parser.add_argument("--min-blocks", type=int, default=3, help="blocks before the spread is judged")
    parser.add_argument("--max-blocks", type=int, default=5, help="the cap on repeats")
    parser.add_argument(
        "--also",
        nargs="*",
        default=[],
        choices=["every", "naive", "fp32"],
        help="measure these variants too, the same way (each adds a step per round)",
    )
    parser.add_argument(
        "--spread", type=float, default=0.02, help="stop when the IQR of the block medians is under this"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--clock",
        default=None,
        choices=sorted(CLOCKS),
        help="cpu: process CPU time (robust on a shared machine; the default on CPU); "
        "wall: elapsed time (the default on CUDA, where the host waits for the device)",
    )
    args = parser.parse_args()
    global CLOCK
    args.clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    CLOCK = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = load_training_file(ROOT / "benchmarks" / "bert_like.py")
    bench = Workbench(spec, build_config(spec.config, {"device": args.device, "steps": 8}))
    probe = bench.probe("amp", instruments=None)
    instruments = detached(probe, DEFAULT_INSTRUMENTS)
    detector = NaiveDetector(probe.model)
    plain = Variant("plain", probe, lambda: instrumented(probe, instruments, on=False))
    others = [Variant("instrumented", probe, lambda: instrumented(probe, instruments, on=True))]
    report = detached(probe, PLOT_INSTRUMENTS)
    others.append(Variant("report", probe, lambda: instrumented(probe, report, on=True)))
    if "every" in args.also:
        every = detached(probe, InstrumentOptions())
        others.append(Variant("every", probe, lambda: instrumented(probe, every, on=True)))
    if "naive" in args.also:
        others.append(Variant("naive", probe, lambda: detecting(detector)))
    if "fp32" in args.also:
        others.append(Variant("fp32", bench.probe("fp32", instruments=None), contextlib.nullcontext))
    batches = bench.batches
    run_block(plain, others, batches, WARMUP_ROUNDS, 0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {bench.device.type}, {args.clock} clock; "
        f"after {WARMUP_ROUNDS} warm-up rounds:",
        flush=True,
    )
    # counted first: deterministic, and printed even if a slow machine stops the timing early
    print("\n".join(dispatch_table(plain, [v for v in others if v.probe is probe], batches[0])))
    if bench.device.type == "cpu":
        print(
            "  (on CPU every tensor is in host memory: D2H copies count on CUDA, where the instruments' one stacked"
            " transfer per step is one)"
        )
    samples = measure_blocks(plain, others, batches, args)
    for line in summary(samples, others, args):
        print(line)


def measure_blocks(plain: Variant, others: list[Variant], batches: list[Any], args: argparse.Namespace) -> Samples:
    """Blocks of paired steps until the instrumented estimate's spread is under ``args.spread`` (or the cap);
    each block's medians printed as it ends."""
    samples = Samples()
    while len(samples.blocks.get("instrumented", [])) < args.max_blocks:
        block = len(samples.blocks.get("instrumented", []))
        samples.add_block(run_block(plain, others, batches, args.pairs, WARMUP_ROUNDS + block * args.pairs))
        print(
            f"  block {block + 1}: median paired ratio "
            + ", ".join(f"{name} {statistics.median(values[-1]):.3f}" for name, values in samples.blocks.items()),
            flush=True,
        )
        if block + 1 >= args.min_blocks and iqr(samples.block_medians("instrumented")) < args.spread:
            break
    return samples


def summary(samples: Samples, others: list[Variant], args: argparse.Namespace) -> list[str]:
    """Per variant: the median of all paired ratios, their IQR and the IQR of the block medians; the targets."""
    blocks = len(samples.blocks["instrumented"])
    lines = [f"{blocks} blocks of {args.pairs} paired steps per variant:"]
    for variant in others:
        pooled, medians = samples.pooled(variant.name), samples.block_medians(variant.name)
        ratio = statistics.median(pooled)
        shown = 1 / ratio if variant.name == "fp32" else ratio
        label = "fp16 AMP probe / fp32 probe" if variant.name == "fp32" else f"{variant.name} / plain"
        verdict = ""
        if variant.name in TARGET:
            verdict = f"  (target <= {TARGET[variant.name]}: {'met' if shown <= TARGET[variant.name] else 'NOT met'})"
        lines.append(
            f"{label:28s} = {shown:.3f}  IQR of paired ratios {iqr(pooled):.3f}, of block medians "
            f"{iqr(medians):.3f}{verdict}"
        )
    converged = iqr(samples.block_medians("instrumented")) < args.spread
    lines.append(
        f"spread of the instrumented estimate {'under' if converged else 'NOT under'} {args.spread:.0%}"
        + ("" if converged else f" after the cap of {args.max_blocks} blocks")
    )
    return lines


if __name__ == "__main__":
    main()
