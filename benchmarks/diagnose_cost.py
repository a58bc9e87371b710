"""What a whole `diagnose` costs against the FP32 + AMP probes it cannot do without.

Per sample model, in one process: the time of one FP32 probe plus one AMP probe
(the irreducible part), and of the whole diagnosis (every stage, every fix tried,
the corrected config checked), full and `--ci`. Prints the ratios; the targets are diagnose < 4x the probes and `--ci` under 60 s per sample on 2 cores.

    python benchmarks/diagnose_cost.py [sample.py ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp16doctor.config import build_config  # noqa: E402
from fp16doctor.diagnosis import DiagnoseOptions, diagnose  # noqa: E402
from fp16doctor.engine.probe import Workbench  # noqa: E402
from fp16doctor.userfile.spec import load_training_file  # noqa: E402


def timed(job) -> float:
    start = time.perf_counter()
    job()
    return time.perf_counter() - start


def probes_seconds(spec, config) -> float:
    bench = Workbench(spec, config)

    def run(mode: str) -> None:
        probe = bench.probe(mode)
        try:
            probe.run()
        finally:
            probe.close()

    return timed(lambda: run("fp32")) + timed(lambda: run("amp"))


def main(paths: list[str]) -> None:
    torch.set_num_threads(2)
    samples = [Path(p) for p in paths] or sorted((ROOT / "sample_models").glob("*.py"))
    warm = load_training_file(samples[0])  # one-time costs (imports, kernel registration) stay out of the ratios
    diagnose(warm, build_config(warm.config, {"device": "cpu"}), DiagnoseOptions(ci=True))
    print(f"{'sample':28} {'probes s':>9} {'diagnose s':>11} {'ratio':>6} {'--ci s':>7}")
    ratios = []
    for path in samples:
        spec = load_training_file(path)
        config = build_config(spec.config, {"device": "cpu"})
        base = probes_seconds(spec, config)
        full = timed(lambda spec=spec, config=config: diagnose(spec, config))
        ci = timed(lambda spec=spec, config=config: diagnose(spec, config, DiagnoseOptions(ci=True)))
        ratios.append(full / base)
        print(f"{path.name:28} {base:9.2f} {full:11.2f} {full / base:6.1f} {ci:7.1f}", flush=True)
    print(
        f"median diagnose / (FP32 + AMP probes) = {sorted(ratios)[len(ratios) // 2]:.1f}, "
        f"worst {max(ratios):.1f} (target < 4)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
