"""The package type-checks with no new mypy errors.

The package carried mypy errors when this test was added; ``MYPY_ERROR_BASELINE`` counted them down to 0.
The test fails on any new error.
"""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

MYPY_ERROR_BASELINE = 0
"""mypy errors in ``fp16doctor/`` (config: ``[tool.mypy]`` in pyproject.toml). Lower it as errors are fixed."""


def mypy_error_count() -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    if proc.returncode == 0 and "Success" in output:
        return 0, output
    found = re.search(r"Found (\d+) errors? in", output)
    assert found, f"mypy did not run (exit {proc.returncode}):\n{output[-3000:]}"
    return int(found.group(1)), output


def test_mypy_finds_no_new_errors_in_the_package():
    count, output = mypy_error_count()
    assert count <= MYPY_ERROR_BASELINE, f"{count - MYPY_ERROR_BASELINE} new mypy error(s):\n{output[-6000:]}"
    assert count == MYPY_ERROR_BASELINE, f"mypy errors fell to {count}: lower MYPY_ERROR_BASELINE to {count}"
