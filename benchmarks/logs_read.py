"""How long ``fp16doctor logs`` takes on a million-line text log, read as a stream.

Two logs are written to a temporary folder, each of ``--lines`` lines (a million by default):

* megatron: Megatron-LM's iteration line (``megatron/training/training.py``, ``training_log``) every
  iteration, a healthy run: a million rows to keep and classify;
* deepspeed: a DeepSpeed run's stdout, nine in ten lines the user's own (a loss print the doctor does not read),
  the rest DeepSpeed's progress lines with an overflow line now and then (``loss_scaler.py``), ending in a
  collapse to the minimum scale: most lines are skipped by the readers' substring test.

Each is read and classified in this process (``read_logs``: what the command runs, without the rendering), timed
with ``time.perf_counter``; the process's peak resident memory after each is reported (``getrusage``).

    python benchmarks/logs_read.py [--lines N]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp16doctor.history import read_logs


def megatron_log(path: Path, lines: int) -> None:
    with open(path, "w") as handle:
        for i in range(1, lines + 1):
            handle.write(
                f" [2026-01-01 12:00:00.000000] iteration {i:8d}/{lines:8d} | consumed samples: {i * 256:12d} |"
                f" elapsed time per iteration (ms): 812.3 | learning rate: {3e-4:.6E} | global batch size:   256 |"
                f" lm loss: {2.0 + 1.0 / (1 + i / 1000):.6E} | loss scale: 65536.0 | grad norm: 1.234 |"
                " number of skipped iterations:   0 | number of nan iterations:   0 |\n"
            )


def deepspeed_log(path: Path, lines: int) -> None:
    prefix = "[2025-02-21 12:00:00,000] [INFO] "
    step = skipped = 0
    with open(path, "w") as handle:
        for i in range(lines - 20):
            if i % 10:
                handle.write(f"epoch 0 iter {i} loss 2.3142 tokens/s 10322.4\n")
                continue
            step += 10
            if i % 5000 == 0:
                skipped += 1
                handle.write(
                    prefix + "[loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
                    "Attempted loss scale: 131072, reducing to 65536\n"
                )
            handle.write(
                prefix + f"[logging.py:128:log_dist] [Rank 0] step={step}, skipped={skipped}, lr=[0.0001], "
                "mom=[(0.9, 0.999)]\n"
            )
        for k in range(16, -1, -1):
            handle.write(
                prefix + f"[loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
                f"Attempted loss scale: {2 ** (k + 1)}, reducing to {2**k}\n"
            )
        handle.write("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.\n")


def timed(path: Path) -> tuple[float, float, float, int, list[str]]:
    start, cpu = time.perf_counter(), time.process_time()
    report = read_logs([path])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    return seconds, cpu, peak, report.summary()["rows"], [f.pattern for f in report.findings]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for name, write in (("megatron", megatron_log), ("deepspeed", deepspeed_log)):
            path = Path(folder) / f"{name}.log"
            write(path, args.lines)
            size = path.stat().st_size / 2**20
            seconds, cpu, peak, rows, found = timed(path)
            print(
                f"{name:10s} {args.lines:,} lines ({size:.0f} MiB): {seconds:.2f} s wall, {cpu:.2f} s CPU, {rows:,} rows, "
                f"peak RSS {peak:.0f} MiB; findings: {', '.join(found) or 'none'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
