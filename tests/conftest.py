"""Shared helpers: sample paths, throw-away training files, running the CLI."""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"

# CI has 2 cores: one thread per xdist worker (two workers share them), two in a single process
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


@pytest.fixture
def training_file(tmp_path):
    """Write a training file from source text and return its path."""

    def write(source: str, name: str = "train_me.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m fp16doctor`` in a fresh process, as a user would, capturing stdout and stderr apart."""
    return subprocess.run(
        [sys.executable, "-m", "fp16doctor", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
    )


MLP_FILE = """
import torch
from torch import nn

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(6)]
"""


@functools.cache
def diagnosed(sample: str, patch: str = "{}", ci: bool = False):
    """(the user's config layers, the diagnosis) of a sample model, cached for the whole session."""
    from fp16doctor.config import build_config
    from fp16doctor.diagnosis import DiagnoseOptions, diagnose
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(SAMPLES / sample)
    layers = {**spec.config, **json.loads(patch)}
    config = build_config(layers, {"device": "cpu"})
    return layers, diagnose(spec, config, DiagnoseOptions(ci=ci))


FRESH_PROCESS_CALLS = ("run_cli(", "subprocess.", "sys.executable")
"""What a test that starts a fresh Python process calls: such a test is ``e2e`` (it shows what only a fresh
process shows: imports, ``sys.modules``, exit codes, the CLI as a user runs it)."""


def starts_a_process(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return any(call in source for call in FRESH_PROCESS_CALLS)


def pytest_collection_modifyitems(config, items):
    """Tests that start a fresh process are marked ``e2e`` (the fast tier, ``-m "not e2e"``, leaves them out);
    tests marked ``cuda`` need a GPU: skipped where there is none (CI is CPU-only)."""
    for item in items:
        if "e2e" not in item.keywords and starts_a_process(item):
            item.add_marker(pytest.mark.e2e)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
