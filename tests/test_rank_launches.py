"""The suite's torchrun launches: one that torch's gloo teardown hung or crashed is taken again from a clean folder,
with its ranks killed; any other outcome is returned as it is, after one launch."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import rank_launches

LAUNCH = """
import os, subprocess, sys, time
log = sys.argv[1]
with open(log, "a") as handle:
    handle.write("launch\\n")
launches = open(log).read().count("launch")
open("output_%d" % launches, "w").write("written by launch %d" % launches)
if launches == 1 and sys.argv[2] in ("hang", "hang in its own session"):
    # a rank, left waiting: real torchrun starts each in a session of its own, the forked ones share the launch's
    own_session = sys.argv[2] == "hang in its own session"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=own_session)
    open(log + ".child", "w").write(str(child.pid))
    time.sleep(600)
if sys.argv[2] == "busy, its rank waiting":  # one rank computes while the other waits for it
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"])
    subprocess.run([sys.executable, "-c", "import time\\nend = time.time() + 4\\nwhile time.time() < end: pass"])
    waiting.wait()
if launches == 1 and sys.argv[2] == "abort":
    sys.exit("terminate called without an active exception")
if sys.argv[2] == "raise":
    raise ValueError("a bug")
"""


def launch(tmp_path, monkeypatch, outcome, launch_seconds=5, idle_seconds=60):
    monkeypatch.setattr(rank_launches, "LAUNCH_SECONDS", launch_seconds)
    monkeypatch.setattr(rank_launches, "IDLE_SECONDS", idle_seconds)
    script, log, folder = tmp_path / "launch.py", tmp_path / "launches.log", tmp_path / "run"
    script.write_text(textwrap.dedent(LAUNCH))
    folder.mkdir()
    (folder / "input").write_text("the user's")
    proc = rank_launches.launch_ranks([sys.executable, str(script), str(log), outcome], folder, dict(os.environ))
    return proc, log.read_text().count("launch"), sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("outcome", ["hang", "hang in its own session"])
def test_a_hung_launch_is_killed_with_its_children_and_taken_again_from_a_clean_folder(tmp_path, monkeypatch, outcome):
    start = time.monotonic()
    with pytest.warns(UserWarning, match="torn down badly, taken again"):
        proc, launches, files = launch(tmp_path, monkeypatch, outcome)
    assert proc.returncode == 0 and launches == 2 and time.monotonic() - start < 60
    assert files == ["input", "output_2"]  # the first launch's output removed, the folder's own file kept
    child = int((tmp_path / "launches.log.child").read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_launch_whose_ranks_wait_without_using_the_cpu_is_hung_long_before_the_launch_limit(tmp_path, monkeypatch):
    start = time.monotonic()
    with pytest.warns(UserWarning, match="its ranks used no CPU for 2 s"):
        proc, launches, _ = launch(tmp_path, monkeypatch, "hang", launch_seconds=150, idle_seconds=2)
    assert proc.returncode == 0 and launches == 2 and time.monotonic() - start < 30


def test_a_rank_waiting_while_another_computes_is_not_idle(tmp_path, monkeypatch, recwarn):
    proc, launches, _ = launch(tmp_path, monkeypatch, "busy, its rank waiting", launch_seconds=150, idle_seconds=2)
    assert proc.returncode == 0 and launches == 1 and not recwarn.list


def test_a_launch_aborted_in_native_teardown_is_taken_again(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match="terminate called without an active exception"):
        proc, launches, _ = launch(tmp_path, monkeypatch, "abort")
    assert proc.returncode == 0 and launches == 2


def test_a_python_exception_is_returned_after_one_launch(tmp_path, monkeypatch):
    proc, launches, _ = launch(tmp_path, monkeypatch, "raise")
    assert proc.returncode == 1 and launches == 1 and "ValueError: a bug" in proc.stderr


def _alive(pid: int) -> bool:
    """Running: a killed child of a killed launch may linger as a zombie until init reaps it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
