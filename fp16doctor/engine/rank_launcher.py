"""Launching the doctor's own ranks: torchrun's elastic agent, each rank forked once torch is imported.

``python -m torch.distributed.run -m MODULE`` starts every rank as a fresh interpreter that imports torch and
dynamo again (DDP's constructor imports dynamo, and dynamo FSDP): 2 to 4 s of CPU a rank before it does anything,
most of a small training's parallel stage. The doctor's own ranks (the parallel stage of ``diagnose --nproc``,
``compare --nproc``, ``train --nproc``) run a function of the doctor, so this launcher runs the agent torchrun runs
(:func:`torch.distributed.launcher.api.elastic_launch`, with torchrun's ``--standalone`` rendezvous) with that
function as its entry point, forked from this process once those modules are imported.

Each rank gets what torchrun gives it: the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...,
``OMP_NUM_THREADS=1`` unless set), the ``sys.argv`` of ``python -m MODULE ARG``, unbuffered standard streams (torchrun
runs ``python -u``), a fresh interpreter's signal handlers, and its atexit handlers run when it ends. It imports the
training file itself.

When the agent forks, this process has imported modules and started the rendezvous: the agent's keep-alive thread
and its store's server threads are running, and no OpenMP pool or CUDA call has been made. The ranks never touch
the agent's threads or its store (they connect to it anew), the pattern torchrun's own ``--start-method fork`` uses.
The ranks are spawned instead (fresh interpreters) where the launching process sees CUDA (a child forked from a
process that initialised CUDA cannot use it, and an import may have) and off Linux (no fork on Windows; forking a
process with threads is unsafe on macOS).

A rank that fails exits non-zero, and so does this launcher, naming the failed rank and its exit code on stderr (a
rank's unexpected exception prints its traceback there first).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import io
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable

import torch

PRELOADED = ("torch._dynamo",)
"""Imported once here, before the ranks are forked: DDP's constructor imports dynamo, which imports FSDP and DTensor."""
START_METHODS = ("fork", "spawn")
ONE_THREAD = "FP16DOCTOR_RANK_ONE_THREAD"
"""Set for the ranks where the launcher set ``OMP_NUM_THREADS=1`` (torch, imported before, read it unset)."""
_leaves_by_exit = False
"""True in a forked rank: it leaves by ``os._exit``, with no interpreter teardown (set once, as the rank starts)."""


def start_method() -> str:
    """Fork on Linux without CUDA, else spawn (see the module docstring)."""
    return "fork" if sys.platform.startswith("linux") and not torch.cuda.is_available() else "spawn"


def launch_command(world: int, entry: str, argument: str) -> list[str]:
    """The command that runs ``entry`` (``module:function``, taking ``[argument]`` and returning an exit code) on
    ``world`` ranks."""
    method = start_method()
    return [sys.executable, "-m", __name__, f"--nproc={world}", f"--start-method={method}", entry, argument]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--start-method", choices=START_METHODS, default="fork")
    parser.add_argument("entry", help="module:function")
    parser.add_argument("argument")
    args = parser.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and args.nproc > 1:
        # as torchrun does: one intra-op thread per rank, so that N ranks do not each take every core
        os.environ["OMP_NUM_THREADS"] = os.environ[ONE_THREAD] = "1"
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
        # Ctrl-C reaches every process of the terminal's group, the ranks too, which finish their step and stop
        # together; the agent forwarding it would make it a second Ctrl-C, which stops a rank at once (mid-collective)
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the agent logs a failed rank's exit as an error with its own traceback: the rank printed what went wrong,
    # and the launcher names it below
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # run_rank as its module's, not __main__'s: a spawned rank unpickles it by that name
    launched = importlib.import_module("fp16doctor.engine.rank_launcher").run_rank
    try:
        elastic_launch(config, launched)(args.entry, args.argument, args.start_method == "fork")
    except ChildFailedError as failed:
        for rank, failure in sorted(failed.failures.items()):
            print(f"rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return 1
    return 0


def run_rank(entry: str, argument: str, forked: bool) -> None:
    """One rank: ``entry([argument])``, as ``python -u -m MODULE ARGUMENT`` would run it (see the module docstring).
    ``forked``: the process leaves by ``os._exit``, which skips the atexit handlers, so they are run here."""
    global _leaves_by_exit
    _leaves_by_exit = forked
    _fresh_signal_handlers()
    _unbuffered_streams()
    if os.environ.get(ONE_THREAD):
        torch.set_num_threads(1)
    function = _entry_function(entry)
    module = sys.modules[function.__module__]
    sys.argv = [getattr(module, "__file__", None) or entry, argument]
    try:
        code = function([argument])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):  # sys.exit("message"): said, as Python says it
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    if forked:
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def leave_process_group() -> None:
    """The end of a doctor's rank: its default process group destroyed, except a gloo group in a forked rank, which
    ends with the process.

    Torch's gloo teardown can deadlock (seen with gdb, torch 2.13, on a loaded machine): a collective launched during
    backward holds the backward's Python context (its thread-local state); when the last reference to it drops on
    gloo's run-loop thread, its destructor waits for the GIL, while the main thread, holding the GIL, joins that
    thread to destroy the group. A forked rank leaves by ``os._exit``: its group is never destroyed, and nothing
    waits."""
    if not torch.distributed.is_initialized():
        return
    if _leaves_by_exit and torch.distributed.get_backend() == "gloo":
        return
    gc.collect()  # a wrapper (DDP's reducer) left in a cycle drops its reference to the group before, not during
    torch.distributed.destroy_process_group()


def let_gloo_threads_finish() -> None:
    """A pause without the GIL, for a process whose own code keeps its process group to the end (a watched script,
    a test): a gloo run-loop thread waiting there to destroy a collective (see :func:`leave_process_group`) gets it.
    Ended in that wait by the interpreter's exit, the thread aborts the process (``terminate called without an
    active exception``, SIGABRT); joined by a group's destruction, it deadlocks. A mitigation: torch gives no way
    to wait for that thread."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        time.sleep(0.2)


def _fresh_signal_handlers() -> None:
    """A fresh interpreter's handlers: a forked rank inherits the agent's, which turn SIGINT and SIGTERM into its own
    exception, so Ctrl-C would not raise KeyboardInterrupt where the training expects it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def _unbuffered_streams() -> None:
    """``python -u``'s: what a rank printed is out before the agent ends it (a rank failing elsewhere)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(
            open(fd, "wb", 0, closefd=False),  # noqa: SIM115 - the process's own stream, open for its life
            encoding=getattr(old, "encoding", None),
            errors=getattr(old, "errors", None),
            write_through=True,
        )
        setattr(sys, name, stream)


def _entry_function(entry: str) -> Callable[[list[str]], int]:
    module, _, name = entry.partition(":")
    function: Callable[[list[str]], int] = getattr(importlib.import_module(module), name)
    return function


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
