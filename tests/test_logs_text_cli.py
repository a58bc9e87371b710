"""`fp16doctor logs` in a fresh process on the plain-text logs of DeepSpeed, fairseq and Megatron-LM, each built
from the framework's own message strings (quoted with their source in test_history_readers.py): the pattern and
cause each shows, as a user reads them in the JSON, and the exit code."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from test_history_readers import (
    deepspeed_collapse,
    fairseq_inner,
    fairseq_overflow,
    megatron_line,
)


def fairseq_growth() -> list[str]:
    """The scale grows to 256, overflows back to 128, and 40 updates later again."""
    lines, updates = [], 0
    for cycle in range(12):
        updates += 40
        lines += [fairseq_inner(updates, 128.0, 5.0 - 0.1 * cycle), fairseq_overflow(128.0)]
    return lines


def megatron_nan_iterations() -> list[str]:
    """A falling loss at a flat gradient norm, then every iteration of the last intervals NaN (and skipped)."""
    lines = [megatron_line(i, 3.0 - i / 200, 1.0) for i in range(10, 250, 10)]
    return lines + [megatron_line(i, None, float("nan"), skipped=10, nan=10) for i in range(250, 310, 10)]


@pytest.mark.parametrize(
    ("log", "pattern", "cause", "first_step"),
    [
        (deepspeed_collapse, "scale-collapse", None, 196),
        (fairseq_growth, "recurring-overflow", "scale-growth", None),
        (megatron_nan_iterations, "nonfinite-loss", None, 241),
    ],
    ids=["deepspeed", "fairseq", "megatron"],
)
def test_a_frameworks_text_log_is_read_and_its_trouble_named(tmp_path, log, pattern, cause, first_step):
    path = tmp_path / "train.log"
    path.write_text("\n".join(log()) + "\n")
    proc = run_cli("logs", path, "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    (finding,) = json.loads(proc.stdout)["findings"]
    assert finding["pattern"] == pattern and finding["cause"] == cause, finding
    assert first_step is None or finding["first_step"] == first_step
