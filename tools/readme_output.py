"""Regenerate the real diagnosis shown at the top of README.md.

    python tools/readme_output.py            # rewrite the block between the markers
    python tools/readme_output.py --check    # exit 1 when the README's block is out of date

The block is the output of ``python -m fp16doctor diagnose`` on one sample model, run in a fresh process at a
fixed terminal width, so the README shows what a user sees and never a hand-edited transcript. The diagnosis is
bit-for-bit deterministic on CPU; anything that varies from run to run (a duration) is normalised so that
rerunning the script leaves the README unchanged.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SAMPLE = "sample_models/nan_in_data.py"
"""Short (one finding, under 50 lines at 100 columns) and telling: a NaN in the data looks like a loss-scale problem
under AMP, and the triage shows it is not."""
COLUMNS = 100
START = "<!-- output:start -->"
END = "<!-- output:end -->"

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
DURATION = re.compile(r"\b\d+(?:\.\d+)? ?s\b(?= *[│|]|$)")
"""A number of seconds ending a table cell or a line (a stage's time): varies run to run."""


def diagnosis_output() -> str:
    """The sample's diagnosis as the terminal shows it, normalised."""
    env = dict(os.environ, COLUMNS=str(COLUMNS), LINES="50", NO_COLOR="1", TERM="dumb", PYTHONHASHSEED="0")
    env.pop("FORCE_COLOR", None)  # rich would colour a pipe
    result = subprocess.run(
        [sys.executable, "-m", "fp16doctor", "diagnose", SAMPLE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode not in (0, 1):  # 0 healthy, 1 findings; anything else is not a diagnosis to show
        sys.stderr.write(result.stderr)
        raise SystemExit(f"diagnose {SAMPLE} exited with {result.returncode}")
    lines = [ANSI.sub("", line).rstrip() for line in result.stdout.splitlines()]
    lines = [DURATION.sub(lambda m: "x" * (len(m.group()) - 2) + " s", line) for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def with_block(readme: str, output: str) -> str:
    """The README with the text between the markers replaced by the command and its output."""
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md needs the markers {START} and {END}, in that order")
    block = f"{START}\n```console\n$ fp16doctor diagnose {SAMPLE}\n{output}\n```\n"
    return readme[:start] + block + readme[end:]


def write_atomically(path: Path, text: str) -> None:
    """Write a temporary file beside ``path`` and rename it over: a reader never sees half a README."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's block is out of date")
    args = parser.parse_args()
    readme = README.read_text(encoding="utf-8")
    updated = with_block(readme, diagnosis_output())
    if args.check:
        if updated != readme:
            print("README.md's output block is out of date: run python tools/readme_output.py", file=sys.stderr)
            return 1
        return 0
    if updated != readme:
        write_atomically(README, updated)
        print(f"README.md: output of {SAMPLE} updated")
    else:
        print("README.md: output unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
