"""Running a user's script in this process exactly as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would.

The way ``coverage run`` does it: ``__name__ == "__main__"``, ``sys.argv == [SCRIPT, *ARGS]``, the
script's folder first on ``sys.path`` (the current directory for ``-m``). Whatever the script raises
(``SystemExit`` included) propagates unchanged, so the caller keeps its traceback and exit code.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..engine.rank_launcher import let_gloo_threads_finish
from ..errors import EXIT_FINDINGS, ScriptError
from .observe import RANK_TIMEOUT, TrainingObserver, WatchStopped, torchrun_rank
from .watch import Alarm, WatchOptions

WATCH_ALARM = EXIT_FINDINGS
"""What a watched run exits with after an alarm (the findings' exit code)."""

PYTHON_NO_FILE = 2
"""What ``python missing.py`` exits with."""
PYTHON_NO_MODULE = 1
"""What ``python -m missing`` exits with."""


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, and its arguments."""

    name: str
    args: tuple[str, ...]
    module: bool = False


def check_target(target: Target) -> None:
    """Python's own complaint, as a :class:`ScriptError` with Python's exit code, before anything runs."""
    if target.module:
        try:
            found = importlib.util.find_spec(target.name)
        except (ImportError, ValueError) as exc:
            raise ScriptError(
                f"Error while finding module specification for '{target.name}' ({type(exc).__name__}: {exc})",
                PYTHON_NO_MODULE,
            ) from exc
        if found is None:
            raise ScriptError(
                f"No module named {target.name}",
                PYTHON_NO_MODULE,
                hint="fp16doctor watch -m takes a module importable from the current directory, as python -m does.",
            )
        return
    path = Path(target.name)
    if not path.exists():
        raise ScriptError(f"can't open file '{path.resolve()}': [Errno 2] No such file or directory", PYTHON_NO_FILE)


def run_target(target: Target) -> None:
    """Run the script as ``__main__`` with its own ``sys.argv`` and ``sys.path[0]``; both restored afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if target.module:
            sys.path[0:1] = [os.getcwd()]
            sys.argv = [target.name, *target.args]  # runpy replaces argv[0] with the module's file
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        else:
            sys.path[0:1] = [str(Path(target.name).resolve().parent)]
            sys.argv = [target.name, *target.args]
            runpy.run_path(target.name, run_name="__main__")
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path


def script_traceback(exc: BaseException) -> str:
    """The traceback ``python SCRIPT`` would print: the frames of fp16doctor and runpy that started it left out."""
    tb = exc.__traceback__
    ours = (str(Path(__file__).resolve().parents[1]), runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(ours):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def exit_status(exc: SystemExit) -> tuple[int, str | None]:
    """(exit code, message to print on stderr) for a ``SystemExit``, as the interpreter turns one into a status."""
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code, None
    return 1, str(code)


def _leave_now() -> None:
    """End this rank at once: the collective it gave up waiting for is still pending in the process group, and a
    normal exit (or destroying the group) would wait for it, the very hang the timeout ended. torchrun then ends the
    other ranks."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(WATCH_ALARM)


def watch_script(
    target: Target,
    options: WatchOptions,
    on_alarm: Callable[[Alarm], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> int:
    """Run the target under the observer, as python would; the exit code is the script's own, or 1 after an
    alarm. The script's own error prints its traceback to stderr, as python's would."""
    observer = TrainingObserver(options, on_alarm=on_alarm, on_note=on_note, rank=torchrun_rank())
    code = 0
    try:
        with observer:
            run_target(target)
    except WatchStopped as stop:
        if stop.alarm.kind == RANK_TIMEOUT:
            _leave_now()
        code = WATCH_ALARM
    except SystemExit as exc:
        code, message = exit_status(exc)
        if message:
            print(message, file=sys.stderr)
    except KeyboardInterrupt as exc:
        sys.stderr.write(script_traceback(exc))
        return 130
    except Exception as exc:  # noqa: BLE001 - the script's own error: its traceback, Python's exit code
        sys.stderr.write(script_traceback(exc))
        code = 1
    sys.stdout.flush()
    # before the rank exits, the script's frames gone: seen aborting ranks the watch stopped in a DDP run with a
    # compression hook on a loaded machine (1 launch in 10 with 3 busy processes on 2 cores; 0 in 10 with it)
    let_gloo_threads_finish()
    return code if code != 0 or not observer.alarms else WATCH_ALARM
