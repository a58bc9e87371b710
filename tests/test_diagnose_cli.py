"""``fp16doctor diagnose`` as a user (and a CI job) runs it."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import yaml
from conftest import SAMPLES, run_cli

from fp16doctor.config import build_config
from fp16doctor.diagnosis.rules import all_rules


def test_json_is_one_object_in_the_documented_shape():
    proc = run_cli("diagnose", SAMPLES / "loss_in_half.py", "--json")
    assert proc.returncode == 1, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["verdict"] == "unhealthy"
    first = payload["findings"][0]
    assert first["rank"] == 1 and first["cause"] == "loss-in-half" and first["severity"] == "error"
    assert set(first) >= {"rank", "cause", "severity", "title", "evidence", "fix"}
    assert set(first["fix"]) == {"summary", "code", "config_patch"}
    assert first["fix"]["config_patch"] == {"overrides": {"loss_in_fp32": True}}
    names = [s["name"] for s in payload["stages"]]
    assert names[:3] == ["data scan", "fp32 baseline", "amp as configured"]
    assert all(s["status"] in ("ran", "skipped") and s["summary"] for s in payload["stages"])


@pytest.mark.parametrize(
    ("sample", "output", "code"), [("mlp.py", "--ci", 0), ("loss_in_half.py", "--json", 1)], ids=["text", "json"]
)
def test_a_reader_that_stops_reading_leaves_the_exit_code_the_diagnosis_gives(sample, output, code):
    """``fp16doctor diagnose FILE | head``: the reader is gone before the report is printed, and the shell (with
    ``set -o pipefail``, a CI job) still sees the verdict's exit code, with no error on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp16doctor", "diagnose", str(SAMPLES / sample), output, "--ci"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # as head does once it has its lines
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == code, stderr[-2000:]
    assert "error" not in stderr.lower() and "Traceback" not in stderr


def test_healthy_sample_exits_zero_and_says_so():
    proc = run_cli("diagnose", SAMPLES / "mlp.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("healthy: ") and "unhealthy" not in proc.stdout  # "healthy" alone matches "unhealthy"
    assert "Triage" in proc.stdout


def test_report_fix_config_and_junit(tmp_path):
    report, fixed, junit = tmp_path / "r.md", tmp_path / "fixed.yaml", tmp_path / "j.xml"
    proc = run_cli(
        "diagnose", SAMPLES / "clip_before_unscale.py", "--report", report, "--fix-config", fixed, "--junit", junit
    )
    assert proc.returncode == 1, proc.stderr
    text = report.read_text()
    assert "clip-before-unscale" in text and "## Stages" in text and "```python" in text
    config = yaml.safe_load(fixed.read_text())
    assert config["overrides"]["unscale_before_clip"] is True and config["steps"] == 20  # the user's CONFIG kept
    build_config(config)  # a valid config
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (
        suite.get("failures") == "1" and int(suite.get("tests")) == len(all_rules()) + 1
    )  # every cause and `unexplained`
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["clip-before-unscale"]
    # the corrected config, given back, gives a healthy diagnosis
    again = run_cli("diagnose", SAMPLES / "clip_before_unscale.py", "--config", fixed, "--json")
    assert again.returncode == 0, again.stdout[-2000:]
    assert json.loads(again.stdout)["verdict"] == "healthy"


def test_existing_files_are_not_overwritten_without_force(tmp_path):
    target = tmp_path / "fixed.yaml"
    target.write_text("mine: true\n")
    proc = run_cli("diagnose", SAMPLES / "mlp.py", "--fix-config", target)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert target.read_text() == "mine: true\n"
    proc = run_cli("diagnose", SAMPLES / "mlp.py", "--fix-config", target, "--force", "--steps", "5")
    assert proc.returncode == 0 and "mine" not in target.read_text()


def test_ci_fast_path_with_junit(tmp_path):
    junit = tmp_path / "j.xml"
    proc = run_cli("diagnose", SAMPLES / "scale_too_high.py", "--ci", "--junit", junit, "--json")
    assert proc.returncode == 1
    payload = json.loads(proc.stdout)
    assert payload["findings"][0]["cause"] == "scale-overflow"
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "1"


def test_an_optimizer_written_for_the_model_is_told_what_it_receives(tmp_path):
    # A common slip: optimizer(model) where the contract passes model.parameters() (as torch.optim takes them).
    path = tmp_path / "opt.py"
    path.write_text(
        "import torch\n"
        "def model():\n    return torch.nn.Linear(4, 3)\n"
        "def data():\n    return [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]\n"
        "def optimizer(model):\n    return torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
    )
    proc = run_cli("diagnose", path, "--ci", "--steps", "2")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "optimizer() raised AttributeError" in message, proc.stderr[-2000:]
    assert "with model.parameters()" in message and "opt.py:7" in message and "Traceback" not in proc.stderr


def test_bad_input_gets_exit_two(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\ndef model():\n    return torch.nn.Linear(2, 2)\n")
    proc = run_cli("diagnose", broken)
    assert proc.returncode == 2 and "data()" in proc.stderr and "Traceback" not in proc.stderr


STEP_RETURNING = """
import torch
def model():
    return torch.nn.Linear(4, 2)
def data():
    for _ in range(4):
        yield torch.randn(8, 4), torch.randint(0, 2, (8,))
def train_step(model, batch, optimizer, scaler, autocast):
    optimizer.zero_grad()
    with autocast():
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return {RETURNED}
"""


@pytest.mark.parametrize("returned", ["{'loss': loss, 'logits': None}", "(loss, None)", "float(loss)"])
def test_a_train_step_may_return_the_loss_inside_an_output(tmp_path, returned):
    path = tmp_path / "step.py"
    path.write_text(STEP_RETURNING.replace("{RETURNED}", returned))
    proc = run_cli("diagnose", path, "--ci", "--json", "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    fp32 = next(s for s in json.loads(proc.stdout)["stages"] if s["name"] == "fp32 baseline")
    assert fp32["details"]["final_loss"] > 0


def test_a_loss_function_may_return_the_loss_with_its_metrics(tmp_path):
    path = tmp_path / "metrics.py"
    path.write_text(
        STEP_RETURNING.split("def train_step")[0]
        + (
            "def loss(model, batch):\n"
            "    logits = model(batch[0])\n"
            "    value = torch.nn.functional.cross_entropy(logits, batch[1])\n"
            "    return value, {'accuracy': (logits.argmax(-1) == batch[1]).float().mean()}\n"
        )
    )
    proc = run_cli("diagnose", path, "--ci", "--json", "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["verdict"] == "healthy"


def test_a_train_step_that_returns_nothing_is_bad_input(tmp_path):
    path = tmp_path / "step.py"
    path.write_text(STEP_RETURNING.replace("{RETURNED}", "None"))
    proc = run_cli("diagnose", path, "--ci", "--steps", "4")
    assert proc.returncode == 2 and "train_step() returned NoneType, not a loss" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr


CHATTY = """
import argparse, subprocess, sys
import torch
print("loading the dataset ...")
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()          # at module level, as training scripts do
CONFIG = {"steps": 3, "lr": args.lr}
def model():
    print("model ready")
    subprocess.run([sys.executable, "-c", "print('a child process writes to fd 1')"], check=True)
    return torch.nn.Linear(4, 2)
def data():
    for i in range(3):
        print(f"batch {i}")
        yield torch.randn(8, 4), torch.randint(0, 2, (8,))
"""


@pytest.mark.parametrize("command", [["diagnose", "--ci"], ["compare"]])
def test_json_stays_one_object_while_the_training_file_prints(tmp_path, command):
    path = tmp_path / "chatty.py"
    path.write_text(CHATTY)
    proc = run_cli(command[0], path, *command[1:], "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout)  # nothing but the JSON on stdout
    assert "model ready" in proc.stderr and "batch 0" in proc.stderr and "fd 1" in proc.stderr


def test_a_required_command_line_argument_at_import_is_bad_input_with_a_hint(tmp_path):
    path = tmp_path / "needs_args.py"
    path.write_text(CHATTY.replace('"--lr", type=float, default=1e-3', '"--data-dir", required=True'))
    proc = run_cli("diagnose", path, "--ci")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "called sys.exit(2)" in message and '__name__ == "__main__"' in message


def test_a_data_file_not_found_says_where_relative_paths_start(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "points.csv").write_text("1,2\n3,4\n")
    (folder / "reads.py").write_text(
        "import torch\n"
        "def model():\n    return torch.nn.Linear(2, 2)\n"
        "def data():\n"
        "    rows = [[float(v) for v in line.split(',')] for line in open('points.csv')]\n"
        "    yield torch.tensor(rows), torch.zeros(len(rows), dtype=torch.long)\n"
    )
    elsewhere = run_cli("diagnose", folder / "reads.py", "--ci", "--steps", "2", cwd=tmp_path)
    message = " ".join(elsewhere.stderr.split())
    assert (
        elsewhere.returncode == 2
        and f"current directory ({tmp_path})" in message
        and "Path(__file__).parent" in message
    )
    at_home = run_cli("diagnose", "reads.py", "--ci", "--steps", "2", cwd=folder)
    assert at_home.returncode == 0, at_home.stderr[-2000:]


@pytest.mark.parametrize(
    "forward, batch, said",
    [
        (
            "def forward(self, batch):\n        return self.l(batch['x'])",
            "{'x': torch.randn(8, 4), 'y': torch.randint(0, 2, (8,))}",
            "model(**batch).loss",
        ),
        (
            "def forward(self, x):\n        y = self.l(x)\n        return y, y.abs().mean()",
            "torch.randn(8, 4), torch.randint(0, 2, (8,))",
            "returned a tuple, not logits",
        ),
    ],
)
def test_a_model_the_default_loss_cannot_use_is_bad_input_asking_for_a_loss(tmp_path, forward, batch, said):
    """The default loss is model(**batch).loss for a dict and cross_entropy(model(x), y) for a pair: a model
    that fits neither is a contract mismatch, said plainly (exit 2), not a TypeError 'in FP32 too'
    diagnosed as fp32-divergence."""
    path = tmp_path / "mismatch.py"
    path.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.l = torch.nn.Linear(4, 2)\n"
        f"    {forward}\n"
        "def model():\n    return Net()\n"
        f"def data():\n    yield {batch}\n"
    )
    proc = run_cli("diagnose", path, "--ci", "--steps", "2")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and said in message and "Define loss(model, batch)" in message


def test_rules_command_lists_every_code():
    proc = run_cli("rules")
    assert proc.returncode == 0
    for code in ("nonfinite-data", "precision-gap", "bf16-advice"):
        assert code in proc.stdout


def test_an_amp_exception_is_never_healthy_and_the_search_names_what_repairs_it(tmp_path):
    path = tmp_path / "mixes_dtypes.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def model():\n    return nn.Linear(4, 2)\n\n"
        "def data():\n    return [(torch.randn(3, 4), torch.tensor([0, 1, 0]))]\n\n"
        "def loss(model, batch):\n"
        "    x, y = batch\n"
        "    with torch.autocast('cpu', enabled=False):\n"
        "        h = model(x.half())   # a half input into an fp32 layer, outside autocast\n"
        "    return nn.functional.cross_entropy(h.float(), y)\n"
    )
    proc = run_cli("diagnose", path, "--json", "--steps", "3")
    assert proc.returncode == 1, proc.stderr[-2000:]
    payload = json.loads(proc.stdout)
    assert payload["verdict"] == "unhealthy"
    # No rule matches it; the intervention search finds that the loss code in fp32 (its half cast neutralised)
    # repairs it, and that finding accounts for the exception, with the user's file and line.
    finding = payload["findings"][0]
    assert (finding["cause"], finding["severity"], finding["found_by"]) == ("loss-in-half", "error", "intervention")
    assert finding["evidence"]["symptoms"] == ["amp-exception"] and finding["verification"]["repaired"]
    assert finding["evidence"]["exception"]["location"].endswith(":13") and payload["unexplained"] == []


def test_an_exception_in_the_default_loss_has_one_place_in_every_probe_and_is_explained(tmp_path):
    """A label out of range in the default cross_entropy raises in both probes: the place is the default loss, not
    the doctor's dispatch modes (FP32's and AMP's gave two places, and the AMP one went unexplained)."""
    path = tmp_path / "bad_label.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def model():\n    return nn.Linear(4, 3)\n\n"
        "def data():\n    return [(torch.randn(5, 4), torch.tensor([0, 1, 2, 3 if i == 1 else 0, 1])) for i in range(3)]\n"
    )
    proc = run_cli("diagnose", path, "--json", "--steps", "3")
    assert proc.returncode == 1, proc.stderr[-2000:]
    payload = json.loads(proc.stdout)
    finding = payload["findings"][0]
    assert finding["cause"] == "fp32-divergence" and payload["unexplained"] == []
    assert finding["evidence"]["exception"]["location"] == "fp16doctor's default loss cross_entropy(model(x), y)"
    assert "fp16doctor/" not in finding["fix"]["summary"] and "IndexError" in finding["fix"]["summary"]
    stages = {s["name"]: s["summary"] for s in payload["stages"]}
    assert "raised IndexError" in stages["loss-scale sweep"] and "raised IndexError" in stages["precision-gap search"]


def test_scan_batches_reaches_beyond_the_probes_batches():
    short = run_cli("diagnose", SAMPLES / "nan_in_data.py", "--steps", "5", "--json")
    scanned = run_cli("diagnose", SAMPLES / "nan_in_data.py", "--steps", "5", "--scan-batches", "20", "--json")
    short_evidence = json.loads(short.stdout)["findings"][0]["evidence"]
    full_evidence = json.loads(scanned.stdout)["findings"][0]["evidence"]
    assert short_evidence["batches"] == [3] and full_evidence["batches"] == [3, 11]


@pytest.mark.parametrize(
    "command, flag", [((), "--version"), (("diagnose",), "--json"), (("train",), "--resume"), (("compare",), "--wide")]
)
def test_help_shows_flags_without_a_value_placeholder(command, flag):
    """A flag takes no value: typer's `<bool>` after it reads as if it did."""
    proc = run_cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert flag in proc.stdout and "--help" in proc.stdout
    assert "<bool>" not in proc.stdout
    assert "<path>" in proc.stdout or not command  # options that take a value keep theirs


def test_bad_input_under_json_is_still_one_object_on_stdout(tmp_path):
    """A CI script parsing stdout reads why, not an empty document; the red message stays on stderr."""
    proc = run_cli("diagnose", tmp_path / "missing.py", "--json")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["exit_code"] == 2 and "does not exist" in error["message"] and error["hint"]
