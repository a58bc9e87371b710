"""One process of a multi-process training run, started by torchrun (``fp16doctor train --nproc N``).

The launching command writes ``launch.json`` into the run directory (the
training file, the resolved config, the run options); every process reads it,
joins the process group (gloo on CPU, nccl on CUDA) and trains its shard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..config import build_config
from ..engine.rank_launcher import leave_process_group
from ..errors import DoctorError
from ..userfile.spec import load_training_file
from .train import Distributed, Trainer, TrainOptions


def main(argv: list[str]) -> int:
    launch = json.loads(Path(argv[0]).read_text())
    dist = Distributed.from_env()
    config = build_config(launch["config"])
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(dist.rank % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl" if use_cuda else "gloo")
    try:
        spec = load_training_file(launch["training_file"])
        options = TrainOptions(**{**launch["options"], "run_dir": Path(launch["options"]["run_dir"])})
        Trainer(spec, config, options, dist).run()
        # the run's verdict is in summary.json, read by the launching command: a rank that exits non-zero for
        # an unhealthy but completed run would make torchrun report it as a crashed child, with a traceback
        return 0
    except DoctorError as exc:
        if dist.main:
            print(f"error: {exc.message}" + (f" ({exc.location})" if exc.location else ""), file=sys.stderr)
        return 2
    finally:
        leave_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
