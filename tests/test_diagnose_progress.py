"""The diagnosis's progress display: on a terminal's stderr while it runs, gone when the report prints,
absent off a terminal, and never on stdout (``--json`` stays one object)."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys

from rich.console import Console

from conftest import ROOT, SAMPLES, run_cli
from fp16doctor.cli import DiagnosisProgress
from fp16doctor.diagnosis.engine import stage_names

QUICK = ("--ci", "--steps", "4", "--json")
"""A short diagnosis of the healthy sample: every stage that always runs, in seconds."""

ESCAPE = "\x1b["


def run_with_terminal_stderr(*args: str, timeout: float = 300) -> tuple[str, str, int]:
    """``python -m fp16doctor ARGS`` with stderr on a pseudo-terminal and stdout on a file, as in a shell
    that pipes the JSON on: (stdout, what the terminal received, exit code)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    env.update(TERM="xterm-256color", COLUMNS="160")
    with open(os.devnull) as stdin, subprocess.Popen(
        [sys.executable, "-m", "fp16doctor", *args], cwd=ROOT, env=env, stdin=stdin,
        stdout=subprocess.PIPE, stderr=slave,
    ) as proc:
        os.close(slave)
        terminal = bytearray()
        stdout = bytearray()
        streams = [master, proc.stdout.fileno()]
        while streams:
            ready, _, _ = select.select(streams, [], [], timeout)
            if not ready:
                proc.kill()
                raise TimeoutError(f"fp16doctor {' '.join(args)} ran past {timeout}s")
            for fd in ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the terminal's other end closed (Linux: EIO)
                    chunk = b""
                if not chunk:
                    streams.remove(fd)
                else:
                    (terminal if fd == master else stdout).extend(chunk)
        os.close(master)
        code = proc.wait(timeout)
    return stdout.decode(), terminal.decode(errors="replace"), code


def test_progress_shows_on_a_terminal_and_json_stays_one_object():
    stdout, terminal, code = run_with_terminal_stderr("diagnose", SAMPLES / "mlp.py", *QUICK)
    assert code == 0, terminal
    assert json.loads(stdout)["verdict"] == "healthy"  # stdout is the one JSON object, nothing else
    assert ESCAPE not in stdout
    assert "diagnose" in terminal and "fp32 baseline" in terminal, terminal[-2000:]
    assert "fp32 step" in terminal and "/4" in terminal  # the step within the probe
    assert "left" in terminal  # the estimate of the time left
    # transient: after its last frame the display erases itself (cursor up, erase line)
    assert terminal.rfind("\x1b[1A\x1b[2K") > terminal.rfind("diagnose"), repr(terminal[-300:])


def test_no_progress_when_stderr_is_not_a_terminal():
    proc = run_cli("diagnose", SAMPLES / "mlp.py", *QUICK, env={"TERM": "xterm-256color"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "healthy"
    assert ESCAPE not in proc.stderr and ESCAPE not in proc.stdout
    assert "fp32 step" not in proc.stderr and "fp32 baseline" not in proc.stderr


def test_the_display_follows_stages_and_steps_and_never_moves_back():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160)
    stages = stage_names()
    with DiagnosisProgress(console, stages) as progress:
        progress.stage("fp32 baseline")
        progress.probe_step("fp32", 2, 4)
        task = progress.progress.tasks[0]
        assert task.fields["stage"] == "fp32 baseline" and task.fields["step"] == "fp32 step 3/4"
        assert stages.index("fp32 baseline") < task.completed < stages.index("fp32 baseline") + 1
        halfway = task.completed
        progress.probe_step("fp32", 0, 4)  # a second probe of the same stage starts again at step 0
        assert progress.progress.tasks[0].completed == halfway
        progress.stage("amp as configured")
        assert progress.progress.tasks[0].completed == stages.index("amp as configured")
        progress.progress.refresh()
    assert "amp as configured" in screen.getvalue()


def test_the_display_writes_nothing_off_a_terminal():
    screen = io.StringIO()
    with DiagnosisProgress(Console(file=screen, force_terminal=False), stage_names()) as progress:
        progress.stage("fp32 baseline")
        progress.probe_step("fp32", 1, 4)
    assert screen.getvalue() == ""
