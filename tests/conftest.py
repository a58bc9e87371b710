"""Shared helpers: sample paths, throw-away training files, running the CLI."""

from __future__ import annotations

import functools
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

torch.set_num_threads(min(2, os.cpu_count() or 1))  # CI has 2 cores; keep timings comparable


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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped where there is none (CI is CPU-only)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
