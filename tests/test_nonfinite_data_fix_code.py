"""The code a nonfinite-data finding hands the user runs on the batch it names, whatever the batch's structure (a
tuple, a dict, a capsule's recorded call): it once referred to an undefined name for a nested field."""

from __future__ import annotations

import pytest
import torch

from fp16doctor.diagnosis.rules.nonfinite_data import _drop_rows_code

ROWS = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0]])


@pytest.mark.parametrize(
    ("field", "batch"),
    [
        ("0", (ROWS, torch.arange(3))),
        ("input_ids", {"input_ids": ROWS, "labels": torch.arange(3)}),
        ("args.1", {"args": [torch.zeros(3), ROWS], "kwargs": {}}),
    ],
)
def test_the_fix_code_reads_the_named_field_and_finds_its_bad_rows(field, batch):
    scope = {"batch": batch, "torch": torch}
    exec(_drop_rows_code(field), scope)  # noqa: S102 - the finding's code, run as the user would paste it
    assert scope["x"] is ROWS
    assert scope["keep"].tolist() == [True, False, True]
