"""Running the corrected training in one process or, with ``nproc`` > 1, under torchrun.

Each torchrun process runs :mod:`fp16doctor.run.worker` on a launch file; the outcome comes back through the
run directory's ``summary.json``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import DoctorConfig
from ..engine.rank_launcher import launch_command
from ..errors import DoctorError
from ..files import atomic_write_text
from ..userfile.spec import TrainingSpec
from .train import Trainer, TrainOptions, TrainResult


def run_training(
    spec: TrainingSpec,
    config: DoctorConfig,
    options: TrainOptions,
    nproc: int,
    training_file: Path,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """One process in this one (``on_step`` told each step's record), or ``nproc`` under torchrun."""
    if config.sharding.emulated:
        # Emulated ranks replay one step of a sharded run to diagnose it; a training trained so would run every
        # rank's batch in one process, in the doctor's imitation of the wrapper rather than the wrapper itself.
        raise DoctorError(
            f"sharding.world is {config.sharding.world}: the emulated ranks replay a sharded run's step for the "
            "diagnosis, they do not train.",
            hint="Train sharded for real with --nproc N and the file's parallelize(model), and sharding.world: 1.",
        )
    if nproc == 1:
        return Trainer(spec, config, options).run(on_step)
    result = train_distributed(config, options, nproc, training_file)
    for text in result.notes:  # the ranks built and ran the training: what they noted is said here
        spec.note(text)
    return result


def train_distributed(config: DoctorConfig, options: TrainOptions, nproc: int, training_file: Path) -> TrainResult:
    """torchrun with ``nproc`` processes of :mod:`fp16doctor.run.worker`."""
    options.run_dir.mkdir(parents=True, exist_ok=True)
    launch = options.run_dir / "launch.json"
    payload = {
        "training_file": str(Path(training_file).resolve()),
        "config": config.to_dict(),
        "options": {**asdict(options), "run_dir": str(options.run_dir.resolve())},
    }
    atomic_write_text(launch, json.dumps(payload, indent=2))
    command = launch_command(nproc, "fp16doctor.run.worker:main", str(launch))
    summary = options.run_dir / "summary.json"
    summary.unlink(missing_ok=True)  # an earlier run's (this run replaces it): never read as this run's outcome
    proc = subprocess.Popen(command)
    try:
        proc.wait()
    except KeyboardInterrupt:
        # the terminal's Ctrl-C reached the ranks too: they finish the step in flight, write a checkpoint and stop;
        # waiting for them keeps it (a second Ctrl-C stops waiting, and them)
        try:
            proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            raise
    if not summary.exists():  # rank 0 wrote this run's outcome (Ctrl-C's included); a failed rank, none
        raise DoctorError(
            f"the {nproc}-process run failed (its launcher's exit code {proc.returncode}).",
            hint="Its processes' messages are above; try --nproc 1 to see the problem in one process.",
        )
    return TrainResult(**json.loads(summary.read_text()))
