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
    installs = [c for c in re.findall(r"```bash\n(.+?)\n```", readme) if "pip install" in c]
    assert len(installs) >= 2  # the quick start and the test command: a README without them passes nothing
    for command in installs:
        assert "torch==2.13.0" in command


def test_the_readme_training_file_example_runs(tmp_path):
    from fp16doctor.config import build_config
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.measure.compare import compare
    from fp16doctor.userfile.spec import load_training_file

    readme = (ROOT / "README.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.+?)```", readme, re.S) if "def train_step" in block)
    path = tmp_path / "readme_example.py"
    path.write_text(example)
    spec = load_training_file(path)
    assert spec.train_step is not None and spec.loss is not None
    result = compare(Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 4})), ["amp"])
    assert result.verdict == "healthy"
