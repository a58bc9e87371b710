"""The launcher of the doctor's own ranks: torchrun's agent, the ranks forked (or spawned) with torchrun's
environment, a failed rank said with its traceback and exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ENTRY = """
import atexit, json, os, signal, sys, time
import torch
import torch.distributed as dist

def main(argv):
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    handlers = {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")}
    seen = {
        "argv": sys.argv, "arg": argv, "total": total.item(), "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"), "handlers": handlers,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    }
    with open(os.path.join(argv[0], f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(seen, handle)
    rank = dist.get_rank()
    atexit.register(lambda: open(os.path.join(argv[0], f"atexit{rank}"), "a").write("ran\\n"))
    from fp16doctor.engine.rank_launcher import leave_process_group

    leave_process_group()
    with open(os.path.join(argv[0], f"group{rank}"), "w") as handle:
        handle.write("kept" if dist.is_initialized() else "destroyed")
    return 0

def fails_on_rank_1(argv):
    if os.environ["RANK"] == "1":
        raise ValueError("a bug on rank 1")
    return 0

def exits_3(argv):
    return 3

def prints_then_waits(argv):
    if os.environ["RANK"] == "0":
        print("rank 0 was here")  # to a pipe: block-buffered, unless the rank's stdout is unbuffered
        time.sleep(60)
    time.sleep(1)
    raise ValueError("rank 1 fails while rank 0 waits")
"""


def launch(tmp_path, entry, method, world=2, threads="1"):
    """The launcher in a fresh process, its output to pipes (as the doctor reads it), without PYTHONUNBUFFERED."""
    (tmp_path / "ranks_entry.py").write_text(textwrap.dedent(ENTRY))
    command = [sys.executable, "-m", "fp16doctor.engine.rank_launcher", f"--nproc={world}"]
    command += [f"--start-method={method}", f"ranks_entry:{entry}", str(tmp_path)]
    # the training files' folder only: not this worker's sys.path, which other tests' folders may shadow
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")}
    env = {**env, "PYTHONPATH": str(tmp_path), **({"OMP_NUM_THREADS": threads} if threads else {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize(("method", "threads"), [("fork", None), ("spawn", "2")])
def test_each_rank_gets_what_torchrun_gives_it_and_the_ranks_meet(tmp_path, method, threads):
    """torchrun's environment (one thread per rank unless told otherwise), the argv ``python -m`` gives, a fresh
    interpreter's signal handlers (not the agent's: Ctrl-C raises KeyboardInterrupt, which the trainer checkpoints
    on), its atexit handlers run once at the end."""
    proc = launch(tmp_path, "main", method, threads=threads)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(seen):
        assert record["env"]["RANK"] == record["env"]["LOCAL_RANK"] == str(rank)
        assert record["env"]["WORLD_SIZE"] == "2" and record["env"]["MASTER_PORT"]
        assert record["arg"] == [str(tmp_path)]
        assert record["argv"] == [str(tmp_path / "ranks_entry.py"), str(tmp_path)]  # as `python -m` gives them
        assert record["total"] == 3.0  # 1 + 2: the ranks' all-reduce met
        assert (record["omp"], record["threads"]) == (("1", 1) if threads is None else ("2", 2))
        assert "default_int_handler" in record["handlers"]["SIGINT"]
        assert {record["handlers"][n] for n in ("SIGTERM", "SIGHUP", "SIGQUIT")} == {"<Handlers.SIG_DFL: 0>"}
        assert (tmp_path / f"atexit{rank}").read_text() == "ran\n"
        assert (tmp_path / f"group{rank}").read_text() == ("kept" if method == "fork" else "destroyed")


@pytest.mark.e2e
def test_a_rank_that_raises_fails_the_launch_with_its_traceback_and_code(tmp_path):
    proc = launch(tmp_path, "fails_on_rank_1", "fork")
    assert proc.returncode == 1
    assert "ValueError: a bug on rank 1" in proc.stderr and "rank 1 exited with code 1" in proc.stderr
    assert "rank 0 exited" not in proc.stderr


@pytest.mark.e2e
def test_an_entry_that_returns_non_zero_is_a_failed_rank_with_that_code(tmp_path):
    """The agent stops the others at the first failed rank, as torchrun does: that rank is said."""
    proc = launch(tmp_path, "exits_3", "fork")
    assert proc.returncode == 1
    assert re.search(r"^rank [01] exited with code 3$", proc.stderr, re.MULTILINE), proc.stderr[-2000:]


@pytest.mark.e2e
def test_what_a_rank_printed_is_out_when_the_agent_ends_it_for_another_ranks_failure(tmp_path):
    """Rank 1 fails while rank 0 waits: the agent ends rank 0, whose printed line was already written (a rank's
    streams are unbuffered, as under torchrun's python -u)."""
    proc = launch(tmp_path, "prints_then_waits", "fork")
    assert proc.returncode == 1 and "ValueError: rank 1 fails while rank 0 waits" in proc.stderr
    assert "rank 0 was here" in proc.stdout


def test_the_ranks_fork_only_on_linux_without_cuda(monkeypatch):
    from fp16doctor.engine import rank_launcher

    monkeypatch.setattr(rank_launcher.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(rank_launcher.sys, "platform", "linux")
    assert rank_launcher.start_method() == "fork"
    assert "--start-method=fork" in rank_launcher.launch_command(2, "m:f", "a")
    monkeypatch.setattr(rank_launcher.torch.cuda, "is_available", lambda: True)
    assert rank_launcher.start_method() == "spawn"
    monkeypatch.setattr(rank_launcher.torch.cuda, "is_available", lambda: False)
    for platform in ("darwin", "win32"):
        monkeypatch.setattr(rank_launcher.sys, "platform", platform)
        assert rank_launcher.start_method() == "spawn"
