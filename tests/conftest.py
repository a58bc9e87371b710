"""Shared helpers: sample paths, throw-away training files, running the CLI."""

from __future__ import annotations

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


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -m fp16doctor`` as a user would, capturing stdout and stderr apart."""
    return subprocess.run(
        [sys.executable, "-m", "fp16doctor", *map(str, args)],
        capture_output=True, text=True, cwd=cwd or ROOT, timeout=timeout,
        env={**os.environ, "COLUMNS": "160"},
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
