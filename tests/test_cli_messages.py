"""The CLI's messages and exit codes, in process (typer's CliRunner): the fast tier's view of the commands.

What only a fresh process shows (imports, ``sys.modules``, the exit code the shell sees) stays in the ``e2e``
tests that run ``python -m fp16doctor``.
"""

from __future__ import annotations

import json

import pytest
from conftest import MLP_FILE, SAMPLES
from typer.testing import CliRunner

from fp16doctor import __version__
from fp16doctor.cli import app
from fp16doctor.diagnosis.rules import all_rules

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "160"})


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_a_missing_training_file_is_bad_input_with_one_message(tmp_path):
    result = invoke("diagnose", tmp_path / "nope.py")
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_json_errors_are_one_object_on_stdout(tmp_path):
    result = invoke("diagnose", tmp_path / "nope.py", "--json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["error"]["exit_code"] == 2 and "does not exist" in payload["error"]["message"]


def test_an_unknown_config_key_names_the_key_and_its_neighbour(training_file):
    path = training_file(MLP_FILE + "\nCONFIG = {'scaler': {'init_scael': 1024}}\n")
    result = invoke("diagnose", path)
    assert result.exit_code == 2
    assert "scaler.init_scael" in result.output and "scaler.init_scale" in result.output


def test_a_bad_memory_size_is_bad_input(training_file):
    result = invoke("diagnose", training_file(MLP_FILE), "--max-memory", "lots")
    assert result.exit_code == 2 and "--max-memory" in result.output


def test_a_capsule_and_a_training_file_together_are_refused(tmp_path, training_file):
    result = invoke("diagnose", training_file(MLP_FILE), "--capsule", tmp_path)
    assert result.exit_code == 2


def test_watch_without_a_script_says_how_to_call_it():
    result = invoke("watch")
    assert result.exit_code == 2 and "no script given" in result.output


def test_rules_lists_every_cause_code():
    result = invoke("rules")
    assert result.exit_code == 0
    assert all(rule.code in result.output for rule in all_rules())


def test_compare_of_a_healthy_file_exits_0_and_prints_one_json_object(training_file):
    result = invoke("compare", training_file(MLP_FILE), "--steps", "3", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["verdict"] == "healthy" and set(payload["modes"]) >= {"fp32", "amp"}


@pytest.mark.parametrize("sample", ["nan_in_data.py"])
def test_diagnose_of_a_faulty_sample_exits_1_and_names_its_cause(sample):
    result = invoke("diagnose", SAMPLES / sample, "--ci", "--device", "cpu", "--json")
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    assert payload["verdict"] == "unhealthy" and payload["findings"][0]["cause"] == "nonfinite-data"


def test_train_refuses_emulated_ranks_and_points_at_nproc(tmp_path):
    """sharding.world > 1 replays a sharded step in one process; training so would not be the run it imitates."""
    config = tmp_path / "sharded.yaml"
    config.write_text("sharding:\n  world: 2\n")
    result = invoke("train", SAMPLES / "mlp.py", "--config", config, "--run-dir", tmp_path / "run", "--steps", "2")
    assert result.exit_code == 2, result.output
    assert "sharding.world is 2" in result.output and "--nproc" in result.output
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_compare_html_with_nproc_is_refused_before_anything_runs(tmp_path):
    result = invoke("compare", SAMPLES / "mlp.py", "--nproc", "2", "--html", tmp_path / "c.html")
    assert result.exit_code == 2 and "--json" in result.output and not (tmp_path / "c.html").exists()


def test_a_console_whose_reader_is_gone_stops_printing_without_ending_the_command():
    """Rich's own console raises SystemExit(1) on a broken pipe (and silences stdout, even for stderr's console)."""
    import os

    from fp16doctor.output.streams import PipedConsole

    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    with os.fdopen(write, "w") as stream:
        console = PipedConsole(file=stream)
        console.print("the report")  # no SystemExit, no BrokenPipeError
        console.print("the rest")
        assert console.quiet
