"""Launching the suite's gloo training scripts under torchrun, taken again when torch's own gloo teardown fails them.

A DistributedDataParallel run on gloo can hang or die as its process group is torn down, watched or not. Seen
with gdb on a hung rank of ``tests/scripts/ddp_loop.py --fp16-compress`` (torch 2.13, 2 loaded cores, 3 launches
in 60): a collective launched during backward captures the thread-local state, which holds the backward's Python
``contextvars`` context; when the last reference to that work is dropped on gloo's run-loop thread, its destructor
waits for the GIL. If the main thread is then destroying the process group (the DDP reducer's last reference, freed
as ``main()`` returns), it holds the GIL while it joins that thread: a deadlock. At interpreter exit the same race
aborts instead (C++'s ``terminate`` on a thread still joinable) or segfaults. Nothing of fp16doctor runs in either
thread. Such a launch is taken again; anything else, a Python exception included, is returned as it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

TEARDOWN_CRASHES = ("Signal 11 (SIGSEGV)", "terminate called without an active exception")
"""torchrun's report of a rank that died in native code while its process group was torn down."""
LAUNCH_SECONDS = 150
"""A launch still running then has hung (the longest of these runs takes about 30 s on a loaded 2-core machine)."""
IDLE_SECONDS = 20.0
"""A launch whose ranks have used no CPU for this long has hung: a deadlocked teardown waits without spinning, and
no script of the suite leaves every rank waiting longer than a few seconds (a rank timeout of 3 s at most)."""
IDLE_SHARE = 0.01
"""The ranks' CPU time per second of wall time below which they count as idle (a blocked thread still ticks)."""
POLL_SECONDS = 1.0
LAUNCHES = 3
"""At most: a fault of the watch's own shows in every launch, and fails the test."""
HUNG = "launch hung: killed after {} s"
IDLE = "launch hung: its ranks used no CPU for {} s"


def launch_ranks(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (a torchrun launch) in ``cwd``; a launch that torch's gloo teardown crashed or hung is taken
    again, from the same folder: whatever an earlier launch wrote there (a capsule) is removed first."""
    inputs = set(cwd.iterdir())
    for launch in range(LAUNCHES):
        _remove_outputs(cwd, inputs)
        proc = _launch_once(command, cwd, env)
        if not torn_down_badly(proc):
            break
        # said in the test report: a retry that keeps coming back is a bug to look at, not noise
        warnings.warn(
            f"launch {launch + 1} of {command[-1]!r} torn down badly, taken again:\n{proc.stderr[-1500:]}", stacklevel=2
        )
    return proc


def torn_down_badly(proc: subprocess.CompletedProcess[str]) -> bool:
    return proc.returncode is None or any(crash in proc.stderr for crash in TEARDOWN_CRASHES)


def _launch_once(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # its own session, so that a hung launch is killed with its ranks, which would otherwise be left behind
    with subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as popen:
        hung = _Hang(popen.pid)
        while True:
            try:
                stdout, stderr = popen.communicate(timeout=POLL_SECONDS)  # retried: no output is lost
                return subprocess.CompletedProcess(command, popen.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                why = hung.seen()
                if why is None:
                    continue
            _kill_tree(popen.pid)
            stdout, stderr = popen.communicate(timeout=30)
            return subprocess.CompletedProcess(command, None, stdout, stderr + why)  # type: ignore[arg-type]


class _Hang:
    """Whether a launch has hung: it ran past :data:`LAUNCH_SECONDS`, or its ranks (the processes under it; the
    launcher itself polls them) have been idle for :data:`IDLE_SECONDS`, which a teardown deadlock shows within
    seconds instead of minutes."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.started = self.polled = self.idle_since = time.monotonic()
        self.cpu: dict[int, float] = {}

    def seen(self) -> str | None:
        now = time.monotonic()
        if now - self.started > LAUNCH_SECONDS:
            return HUNG.format(LAUNCH_SECONDS)
        cpu = {pid: _cpu_seconds(pid) for pid in _descendants(self.root)}
        used = sum(seconds - self.cpu.get(pid, 0.0) for pid, seconds in cpu.items())
        busy = not cpu or used > IDLE_SHARE * (now - self.polled)  # no ranks yet: still starting
        self.cpu, self.polled = cpu, now
        if busy:
            self.idle_since = now
        elif now - self.idle_since > IDLE_SECONDS:
            return IDLE.format(IDLE_SECONDS)
        return None


def _cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kill_tree(root: int) -> None:
    """The launch and every process under it, each with its process group: real torchrun starts its ranks in
    sessions of their own, which killing the launch's group would leave running (holding its pipes open)."""
    for pid in [*_descendants(root), root]:
        for kill, target in ((os.killpg, _group(pid)), (os.kill, pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                kill(target, signal.SIGKILL)  # type: ignore[arg-type]


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *_descendants(child)]
    return found


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _remove_outputs(folder: Path, inputs: set[Path]) -> None:
    for path in set(folder.iterdir()) - inputs:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
