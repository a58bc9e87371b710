"""What the operator-level precision attribution costs against one probe step on the same state.

The attribution (:func:`fp16doctor.measure.attribution.attribute_operators`) takes one shadowed AMP step (every
half-precision torch call computed again in fp32, a gradient hook on each output) and one FP32 step with the calls
matched and hooked. Its budget is 3x a probe step. Per workload, from the same state each time:

* plain:       one AMP probe step (the probe built beforehand, restored to the state: only the step is timed);
* attribution: the attribution on an AMP and an FP32 probe built beforehand and restored to the same state (the
               two passes, the matching and the ranking are timed; building probes is the stage's cost either way,
               one probe per same-state step).

Paired and interleaved: rounds of ``plain, attribution, plain``; each attribution's time is divided by the mean of
the plain steps on either side of it, so machine noise that lasts longer than a step cancels. A block of ``--pairs``
rounds gives the median of its ratios; blocks are repeated until the interquartile range of the block medians (the
spread of the estimate) is under ``--spread`` (5%), from ``--min-blocks`` to ``--max-blocks``. It prints the median
of every paired ratio, their IQR (step-to-step noise) and the IQR of the block medians. Times are the process's
CPU time (a neighbour on a shared machine stretches the wall time, not the work), on one torch thread by default.

Workloads: ``tests/training_files/zone_load_bf16.py`` (an MLP regression in bf16 whose gap the attribution
explains) and ``benchmarks/bert_like.py`` (a 4-layer BERT-like encoder, batch 16 x 128, fp16 with a GradScaler:
many more operators per step).

    python benchmarks/attribution_cost.py [--pairs 5] [--min-blocks 3] [--max-blocks 8] [--threads 1] [--only zone bert]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from overhead import iqr  # noqa: E402

from fp16doctor.config import build_config  # noqa: E402
from fp16doctor.engine.microbatch import UNSPLIT  # noqa: E402
from fp16doctor.engine.probe import Probe, Workbench  # noqa: E402
from fp16doctor.measure.attribution import attribute_operators  # noqa: E402
from fp16doctor.userfile.spec import load_training_file  # noqa: E402

WORKLOADS = {
    "zone": ROOT / "tests" / "training_files" / "zone_load_bf16.py",
    "bert": ROOT / "benchmarks" / "bert_like.py",
}
TARGET = 3.0
CLOCK = time.process_time


class Restored:
    """A probe built once, put back to the same state before every use; the attribution may not close it."""

    def __init__(self, bench: Workbench, mode: str):
        self.probe: Probe = bench.probe(mode, instruments=None, batch_plan=UNSPLIT)
        self.probe.close = lambda: None  # type: ignore[method-assign]  # reused: the benchmark closes nothing
        self.snapshot = self.probe.snapshot()

    def fresh(self) -> Probe:
        self.probe.restore(self.snapshot)
        torch.manual_seed(0)
        return self.probe


def timed(job: Callable[[], object]) -> float:
    start = CLOCK()
    job()
    return CLOCK() - start


def measure(path: Path, args: argparse.Namespace) -> None:
    spec = load_training_file(path)
    bench = Workbench(spec, build_config(spec.config, {"device": "cpu"}))
    amp, fp32 = Restored(bench, "amp"), Restored(bench, "fp32")
    probes = {"amp": amp, "fp32": fp32}

    def plain() -> float:
        probe = amp.fresh()
        return timed(probe.step)

    def attribution() -> float:
        return timed(lambda: attribute_operators(lambda mode: probes[mode].fresh(), path.parent))

    for _ in range(2):  # warm-up: allocator pools, optimizer state, the first call's imports
        plain(), attribution()
    found = attribute_operators(lambda mode: probes[mode].fresh(), path.parent)
    blocks: list[list[float]] = []
    steps: list[float] = []
    while len(blocks) < args.max_blocks:
        ratios = []
        before = plain()
        for _ in range(args.pairs):
            elapsed = attribution()
            after = plain()
            ratios.append(elapsed / ((before + after) / 2))
            steps += [before, after]
            before = after
        blocks.append(ratios)
        medians = [statistics.median(b) for b in blocks]
        if len(blocks) >= args.min_blocks and iqr(medians) < args.spread * statistics.median(medians):
            break
    pooled = [r for b in blocks for r in b]
    medians = [statistics.median(b) for b in blocks]
    print(
        f"{path.name:22} {found.operators:5d} ops  plain step {statistics.median(steps) * 1e3:8.1f} ms  "
        f"attribution / plain {statistics.median(pooled):5.2f}  IQR {iqr(pooled):.2f}  "
        f"block IQR {iqr(medians):.3f}  ({len(pooled)} pairs, target <= {TARGET:g})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--min-blocks", type=int, default=3)
    parser.add_argument("--max-blocks", type=int, default=8)
    parser.add_argument("--spread", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=sorted(WORKLOADS), default=sorted(WORKLOADS, reverse=True))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.only:
        measure(WORKLOADS[name], args)


if __name__ == "__main__":
    main()
