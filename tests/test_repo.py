"""The repository's promises about itself: CI runs the README's command."""

import re

from conftest import ROOT


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_torch_is_pinned_in_every_install_command():
    readme = (ROOT / "README.md").read_text()
    for command in re.findall(r"```bash\n(.+?)\n```", readme):
        if "pip install" in command:
            assert "torch==2.13.0" in command
