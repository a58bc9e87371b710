"""torchrun for the suite's watched training scripts, its ranks forked once torch and dynamo are imported.

``python tests/forked_torchrun.py TORCHRUN-ARGS`` is ``python -m torch.distributed.run TORCHRUN-ARGS``: the same
argument parsing, rendezvous, elastic agent, environment per rank, failure report and exit code (torchrun's own
functions do each). One thing differs: torchrun starts each rank as ``python -u -m MODULE ARGS`` (or
``python -u SCRIPT ARGS``), a fresh interpreter that imports torch and dynamo again (DDP's constructor imports dynamo,
which imports FSDP), about 2.5 s of CPU per rank; here the ranks are forked from this launcher after it imported
them, and run the module or script as ``python -u`` would: its ``sys.argv``, ``sys.path[0]``, unbuffered streams, a
fresh interpreter's signal handlers, its exit code (a traceback and 1 for an exception), and its atexit handlers at
the end, and ``sitecustomize`` run again with the rank's environment. Nothing of fp16doctor is imported before the fork: the rank imports the watch and the script itself.

The sharded watch's tests launch through it; ``tests/test_watch_cli.py`` keeps real torchrun, cold ranks included.
"""

from __future__ import annotations

import atexit
import importlib
import io
import os
import runpy
import signal
import sys
import traceback

import torch._dynamo  # noqa: F401 - imported once here, before the ranks are forked
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch


def as_python(*argv: str) -> None:
    """One rank: ``python ARGV``, where ARGV is what torchrun gives the interpreter (``-u -m MODULE ...``)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True, errors="backslashreplace")
    if "sitecustomize" in sys.modules:  # a fresh interpreter runs it at its start, with the rank's environment
        importlib.reload(sys.modules["sitecustomize"])
    args = list(argv[1:]) if argv[:1] == ("-u",) else list(argv)  # torchrun's own -u, not a script's
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a forked process leaves with os._exit, which would skip them
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


@record
def main() -> None:
    args = torchrun.parse_args(sys.argv[1:])
    assert args.standalone, "the suite's launches are --standalone"
    args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"  # what torchrun's run() sets for --standalone
    args.rdzv_id = os.urandom(8).hex()
    args.master_port = args.master_port or 29500
    config, _, python_args = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=as_python)(*python_args)


if __name__ == "__main__":
    main()
