"""Fresh CLI processes without paying torch's import in each: a server per test worker imports torch, dynamo and
pandas once, then forks one child per run of ``python -m fp16doctor ARGS``.

A CLI run spends about 3.5 s of CPU importing torch and dynamo before it reads its file (every optimizer's
constructor imports dynamo), and the suite runs the CLI a few hundred times. The forked child is a new process for
everything the test looks at: its own pid, working directory, environment, ``sys.argv``, stdin, stdout and stderr
(files here), exit code, atexit handlers and interpreter shutdown. It has run nothing of fp16doctor's: the package,
the training file and everything they import are imported in the child, as in a cold process. What differs is only
that torch, dynamo and pandas are in ``sys.modules`` already; so a test about what a run imports, or one whose
environment changes how torch imports (``TORCH*``, ``OMP_*``, ``PYTHON*``, ...), runs in a cold process
(:meth:`Server.differs_at_import`), and so do a third of the sample models' diagnoses (``conftest.COLD_SAMPLES``). One more difference:
the runs of a worker share the server's string hash seed (a cold process draws its own).

Forking a process that has imported torch but run no operator is what a DataLoader's fork workers do: torch's
thread pools start lazily and are reset in a forked child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOADED = ("torch", "torch._dynamo", "pandas")
"""What the server imports before it forks: third-party modules only."""

IMPORT_TIME_VARIABLES = (
    "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "CUDA", "PYTHON", "LD_", "NCCL", "GLOO", "LANG", "LC_",
)  # fmt: skip
"""Prefixes of environment variables that change how Python starts (its streams' encoding, the locale, the path)
or how torch imports: a run whose environment differs from the server's in one of them runs in a cold process."""

_SERVER = r'''
import json, os, signal, sys, time
for name in sys.argv[1:]:
    __import__(name)
requests, replies = sys.stdin.buffer, sys.stdout


def serve():
    """Fork a child per request line; answer each with its exit status. In the child, return its request."""
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # its own group: a timeout stops what it started too (torchrun, its ranks)
            return request
        replies.write(json.dumps(_wait(pid, request["timeout"])) + "\n")
        replies.flush()
    sys.exit(0)


def _wait(pid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timed_out": True}
        time.sleep(0.02)


request = serve()
# the child: from here on, what `python -m fp16doctor ARGS` run in request["cwd"] would be
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
import tempfile
tempfile.tempdir = None  # looked up again from this environment's TMPDIR
# Python's own stdout and stderr objects (their encoding, errors and buffering as the environment set them at the
# server's start) now write to the run's files; stdin is read afresh (the server's buffer held its requests).
for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY), (2, request["stderr"], os.O_WRONLY)):
    os.dup2(os.open(path, mode), fd)
sys.stdin = sys.__stdin__ = open(0, closefd=False)
if "numpy" in sys.modules:  # numpy does not reseed in a forked child (random and torch start as a cold process does)
    sys.modules["numpy"].random.seed()
sys.path[0] = os.getcwd()
sys.orig_argv = [sys.executable, "-m", "fp16doctor", *request["args"]]
sys.argv = ["-m", *request["args"]]
del requests, replies, request, serve, _wait
import runpy
runpy.run_module("fp16doctor", run_name="__main__", alter_sys=True)
'''


class Server:
    """One pre-importing server, forking the runs of one test worker, one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._env: dict[str, str] = {}

    def run(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with self._lock, tempfile.TemporaryDirectory(prefix="fp16doctor-run-") as folder:
            proc = self._started(env)
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            out.touch()
            err.touch()
            request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps({**request, "timeout": timeout}) + "\n")
                proc.stdin.flush()
                reply = json.loads(proc.stdout.readline() or '{"server_died": true}')
            except BaseException:  # interrupted between request and reply: the next run must not read this reply
                self.close()
                raise
            command = [sys.executable, "-m", "fp16doctor", *args]
            if reply.get("timed_out"):
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            if "returncode" not in reply:
                raise RuntimeError(f"the pre-importing server died: {proc.poll()}")
            return subprocess.CompletedProcess(command, reply["returncode"], out.read_text(), err.read_text())

    def differs_at_import(self, env: dict[str, str]) -> bool:
        """Whether ``env`` differs from the server's where torch's import might read it."""
        started = self._env or dict(os.environ)
        names = {*env, *started}
        return any(n.startswith(IMPORT_TIME_VARIABLES) and env.get(n) != started.get(n) for n in names)

    def _started(self, env: dict[str, str]) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._env = dict(os.environ)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, *PRELOADED],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=self._env,
                cwd=tempfile.gettempdir(),
            )
        return self._proc

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        self._proc = None


SERVER = Server()
