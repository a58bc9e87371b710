"""Launching the doctor's own ranks: torchrun's elastic agent, each rank forked once torch is imported.

``python -m torch.distributed.run -m MODULE`` starts every rank as a fresh interpreter that imports torch and
dynamo again (DDP's constructor imports dynamo, and dynamo FSDP): 2 to 4 s of CPU a rank before it does anything,
most of a small training's parallel stage. The doctor's own ranks (the parallel stage of ``diagnose --nproc``,
``compare --nproc``, ``train --nproc``) run a function of the doctor, so this launcher runs the agent torchrun runs
(:func:`torch.distributed.launcher.api.elastic_launch`, with torchrun's ``--standalone`` rendezvous) with that
function as its entry point, forked from this process once those modules are imported. Each rank gets torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and ``sys.argv``, and imports the training file itself.

Forking is safe because this process does nothing before it but import: no OpenMP pool has started, and no CUDA
call was made. Where the launching process sees CUDA, the ranks are spawned instead (fresh interpreters, as under
torchrun): a CUDA context cannot be used in a child forked from a process that initialised one, and an import may
have.

A rank that fails exits non-zero, and so does this launcher, with each failed rank's exit code on stderr (a rank's
unexpected exception prints its traceback there first).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import traceback
import uuid
from collections.abc import Callable

import torch

PRELOADED = ("torch._dynamo",)
"""Imported once here, before the ranks are forked: DDP's constructor imports dynamo, which imports FSDP and DTensor."""
START_METHODS = ("fork", "spawn")


def launch_command(world: int, entry: str, argument: str) -> list[str]:
    """The command that runs ``entry`` (``module:function``, taking ``[argument]`` and returning an exit code) on
    ``world`` ranks, forked on a CPU and spawned where this process sees CUDA."""
    method = "spawn" if torch.cuda.is_available() else "fork"
    return [sys.executable, "-m", __name__, f"--nproc={world}", f"--start-method={method}", entry, argument]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--start-method", choices=START_METHODS, default="fork")
    parser.add_argument("entry", help="module:function")
    parser.add_argument("argument")
    args = parser.parse_args(argv)
    if args.start_method == "fork":
        for name in PRELOADED:
            importlib.import_module(name)
    _entry_function(args.entry)  # a missing entry fails here, once, not on every rank
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: a free port on this machine
        max_restarts=0,
        start_method=args.start_method,
    )
    # run_rank as its module's, not __main__'s: a spawned rank unpickles it by that name
    launched = importlib.import_module("fp16doctor.engine.rank_launcher").run_rank
    # the agent logs a failed rank's exit as an error with its own traceback: the rank printed what went wrong,
    # and the launcher names it below
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, launched)(args.entry, args.argument)
    except ChildFailedError as failed:
        for rank, failure in sorted(failed.failures.items()):
            print(f"rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return 1
    return 0


def run_rank(entry: str, argument: str) -> None:
    """One rank: ``entry([argument])``, with the ``sys.argv`` ``python -m MODULE ARGUMENT`` would give it."""
    _fresh_signal_handlers()
    function = _entry_function(entry)
    module = sys.modules[function.__module__]
    sys.argv = [getattr(module, "__file__", None) or entry, argument]
    try:
        code = function([argument])
    except BaseException as exc:
        if not isinstance(exc, SystemExit):
            traceback.print_exc()
            code = 1
        else:
            raise
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def _fresh_signal_handlers() -> None:
    """A fresh interpreter's handlers: a forked rank inherits the agent's, which turn SIGINT and SIGTERM into its own
    exception, so Ctrl-C would not raise KeyboardInterrupt where the training expects it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _entry_function(entry: str) -> Callable[[list[str]], int]:
    module, _, name = entry.partition(":")
    function: Callable[[list[str]], int] = getattr(importlib.import_module(module), name)
    return function


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
