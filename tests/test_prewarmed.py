"""The suite's pre-importing server (tests/prewarmed.py) hands each CLI run a process of its own: its working
directory, environment, temporary folder, arguments and exit code, and nothing a previous run imported."""

from __future__ import annotations

import json
import os

import prewarmed
from conftest import run_cli

FILE = """
import json, os, sys, tempfile
import torch
from torch import nn

with open(os.environ["FACTS"], "w") as facts:
    json.dump({
        "cwd": os.getcwd(),
        "tmp": tempfile.gettempdir(),
        "argv0": sys.argv[0],
        "path0": sys.path[0],
        "modules": sorted(m for m in sys.modules if m.startswith("first_") or m.startswith("second_")),
        "fp16doctor_loaded": "fp16doctor.cli" in sys.modules,
    }, facts)

def model():
    return nn.Linear(4, 2)

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]
"""


def _run(folder, name, cold=False):
    """Diagnose ``name`` (written into ``folder``) in a forked or a cold process: what its file saw there."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tmp").mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(FILE)
    facts = folder / "facts.json"
    env = {"FACTS": str(facts), "TMPDIR": str(folder / "tmp")}
    proc = run_cli("diagnose", f"{name}.py", "--steps", "2", "--json", cwd=folder, env=env, cold=cold)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert json.loads(proc.stdout)["verdict"] in ("healthy", "unhealthy")
    return json.loads(facts.read_text())


def test_a_forked_run_sees_what_a_cold_one_sees_and_nothing_of_the_run_before(tmp_path):
    _run(tmp_path / "first", "first_file")
    forked = _run(tmp_path / "second", "second_file")
    cold = _run(tmp_path / "second", "second_file", cold=True)
    assert forked == cold
    assert forked["cwd"] == str(tmp_path / "second") and forked["tmp"] == str(tmp_path / "second" / "tmp")
    assert forked["modules"] == ["second_file"], "the first run's training file is not in the second's process"


def test_an_exit_code_and_stderr_come_back_and_an_import_time_variable_means_a_cold_process(tmp_path):
    proc = run_cli("diagnose", tmp_path / "missing.py")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert prewarmed.SERVER.differs_at_import({**os.environ, "TORCH_LOGS": "dynamo"})
    assert not prewarmed.SERVER.differs_at_import({**os.environ, "COLUMNS": "80", "FACTS": "x"})
