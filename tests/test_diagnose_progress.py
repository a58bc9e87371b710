"""The diagnosis's progress display: on a terminal's stderr while it runs, gone when the report prints,
absent off a terminal, and never on stdout (``--json`` stays one object)."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys

from conftest import ROOT, SAMPLES, run_cli
from rich.console import Console

from fp16doctor.diagnosis.triage import stage_names
from fp16doctor.output.progress import DiagnosisProgress

QUICK = ("--ci", "--steps", "4", "--json")
"""A short diagnosis of the healthy sample: every stage that always runs, in seconds."""

ESCAPE = "\x1b["


def run_with_terminal_stderr(*args: str, timeout: float = 300) -> tuple[str, str, int]:
    """``python -m fp16doctor ARGS`` with stderr on a pseudo-terminal and stdout on a file, as in a shell
    that pipes the JSON on: (stdout, what the terminal received, exit code)."""
    master, slave = pty.openpty()
    env = {
        k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
    }
    env.update(TERM="xterm-256color", COLUMNS="160")
    with (
        open(os.devnull) as stdin,
        subprocess.Popen(
            [sys.executable, "-m", "fp16doctor", *args],
            cwd=ROOT,
            env=env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=slave,
        ) as proc,
    ):
        os.close(slave)
        terminal = bytearray()
        stdout = bytearray()
        streams = [master, proc.stdout.fileno()]
        while streams:
            ready, _, _ = select.select(streams, [], [], timeout)
            if not ready:
                proc.kill()
                raise TimeoutError(f"fp16doctor {' '.join(args)} ran past {timeout}s")
            for fd in ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the terminal's other end closed (Linux: EIO)
                    chunk = b""
                if not chunk:
                    streams.remove(fd)
                else:
                    (terminal if fd == master else stdout).extend(chunk)
        os.close(master)
        code = proc.wait(timeout)
    return stdout.decode(), terminal.decode(errors="replace"), code


def test_progress_shows_on_a_terminal_and_json_stays_one_object():
    stdout, terminal, code = run_with_terminal_stderr("diagnose", SAMPLES / "mlp.py", *QUICK)
    assert code == 0, terminal
    assert json.loads(stdout)["verdict"] == "healthy"  # stdout is the one JSON object, nothing else
    assert ESCAPE not in stdout
    assert "diagnose" in terminal and "fp32 baseline" in terminal, terminal[-2000:]
    assert "fp32 step" in terminal and "/4" in terminal  # the step within the probe
    assert "left" in terminal  # the estimate of the time left
    # transient: after its last frame the display erases itself (cursor up, erase line)
    assert terminal.rfind("\x1b[1A\x1b[2K") > terminal.rfind("diagnose"), repr(terminal[-300:])


def test_no_progress_when_stderr_is_not_a_terminal():
    proc = run_cli("diagnose", SAMPLES / "mlp.py", *QUICK, env={"TERM": "xterm-256color"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "healthy"
    assert ESCAPE not in proc.stderr and ESCAPE not in proc.stdout
    assert "fp32 step" not in proc.stderr and "fp32 baseline" not in proc.stderr


def test_the_display_follows_stages_and_steps_and_never_moves_back():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160)
    stages = stage_names()
    with DiagnosisProgress(console, stages) as progress:
        progress.stage("fp32 baseline")
        progress.probe_step("fp32", 2, 4)
        task = progress.progress.tasks[0]
        assert task.fields["stage"] == "fp32 baseline" and task.fields["step"] == "fp32 step 3/4"
        assert stages.index("fp32 baseline") < task.completed < stages.index("fp32 baseline") + 1
        halfway = task.completed
        progress.probe_step("fp32", 0, 4)  # a second probe of the same stage starts again at step 0
        assert progress.progress.tasks[0].completed == halfway
        progress.stage("amp as configured")
        assert progress.progress.tasks[0].completed == stages.index("amp as configured")
        progress.progress.refresh()
    assert "amp as configured" in screen.getvalue()


def test_the_display_writes_nothing_off_a_terminal():
    screen = io.StringIO()
    with DiagnosisProgress(Console(file=screen, force_terminal=False), stage_names()) as progress:
        progress.stage("fp32 baseline")
        progress.probe_step("fp32", 1, 4)
    assert screen.getvalue() == ""


# --- every stage that steps a probe reports its steps against a planned total -------------------------

FAULTY = "warmup_peak.py"
"""A faulty sample whose diagnosis steps probes in nearly every stage: the baselines, the localisation's
replay, the loss-scale capture, the pause at the LR peak, the same-state comparisons, bf16, the verification."""

STEPPING_STAGES = {
    "fp32 baseline",
    "amp as configured",
    "localisation",
    "loss-scale sweep",
    "LR schedule peak",
    "precision-gap search",
    "bf16 check",
    "verifying fixes",
}


def recorded_diagnosis(sample: str) -> tuple[dict[str, list[tuple[str, int, int]]], object]:
    """The diagnosis of ``sample`` (--ci) with its progress reports, by the stage they came in."""
    from collections import defaultdict

    from fp16doctor.config import build_config
    from fp16doctor.diagnosis import DiagnoseOptions, diagnose
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(SAMPLES / sample)
    reports: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    stage = ["before any stage"]

    def on_stage(name: str) -> None:
        stage[0] = name
        reports[name]  # a stage that steps nothing shows as an empty list

    result = diagnose(
        spec,
        build_config(spec.config, {"device": "cpu"}),
        DiagnoseOptions(ci=True),
        on_stage=on_stage,
        on_probe_step=lambda mode, step, steps: reports[stage[0]].append((mode, step, steps)),
    )
    return dict(reports), result


def test_every_stage_that_steps_a_probe_reports_step_i_of_n():
    reports, result = recorded_diagnosis(FAULTY)
    assert "before any stage" not in reports  # every probe step falls in a stage
    stepped = {name for name, steps in reports.items() if steps}
    assert STEPPING_STAGES <= stepped, (stepped, [(s.name, s.status) for s in result.stages])
    assert not reports["data scan"]
    for name in stepped:
        steps = reports[name]
        assert [i for _, i, _ in steps] == list(range(len(steps))), name  # counted within the stage, from 0
        assert all(0 <= i < n for _, i, n in steps), (name, steps)  # never "step 7 of 6"
        # the stage announced its steps before taking them: the first report already knows more are coming
        assert steps[0][2] >= min(len(steps), 2), (name, steps[:3])
    steps = result.evidence.steps
    for name, mode in (("fp32 baseline", "fp32"), ("amp as configured", "amp"), ("bf16 check", "bf16")):
        assert reports[name] == [(mode, i, steps) for i in range(steps)]  # one probe: exactly its steps
    replay = reports["localisation"]
    assert {n for _, _, n in replay} == {result.evidence.localisation.step + 1}  # the replay and the traced step
    assert {m for m, _, _ in reports["precision-gap search"]} == {"fp32", "amp"}  # the same-state pairs


def test_a_faulty_diagnosis_off_a_terminal_keeps_stderr_free_of_progress_and_stdout_one_object():
    proc = run_cli("diagnose", SAMPLES / FAULTY, "--ci", "--json", env={"TERM": "xterm-256color"})
    assert proc.returncode == 1, proc.stderr  # error findings
    decoder = json.JSONDecoder()
    found, end = decoder.raw_decode(proc.stdout.strip())
    assert end == len(proc.stdout.strip())  # exactly one JSON object, nothing after it
    assert found["verdict"] != "healthy"
    assert {s["name"]: s["status"] for s in found["stages"]}["LR schedule peak"] == "ran"
    assert ESCAPE not in proc.stderr and ESCAPE not in proc.stdout
    for word in (" step ", "/16", "localisation", "fp32 baseline", "left"):
        assert word not in proc.stderr, (word, proc.stderr[-1000:])


def test_a_faulty_diagnosis_on_a_terminal_shows_the_steps_of_its_later_stages():
    stdout, terminal, code = run_with_terminal_stderr("diagnose", SAMPLES / FAULTY, "--ci", "--json")
    assert code == 1, terminal[-2000:]
    assert json.loads(stdout)["verdict"] != "healthy"
    for stage in ("localisation", "LR schedule peak", "verifying fixes"):
        assert stage in terminal, stage
    assert "amp step" in terminal and "bf16 step" in terminal
    assert terminal.rfind("\x1b[1A\x1b[2K") > terminal.rfind("diagnose"), repr(terminal[-300:])


def test_step_progress_counts_against_the_outermost_plan():
    from fp16doctor.engine.progress import StepProgress

    seen: list[tuple[str, int, int]] = []
    progress = StepProgress(lambda mode, step, steps: seen.append((mode, step, steps)))
    with progress.planned(6):  # a stage's plan: a helper's 4 steps, then 2 of its own
        with progress.planned(4):  # the helper's own announcement, a part of the stage's: it adds nothing
            progress.step("fp32")
            progress.step("amp")
        assert progress.total == 4  # the helper stopped early: its 2 untaken steps are dropped at once
        progress.step("amp")
    assert seen == [("fp32", 0, 6), ("amp", 1, 6), ("amp", 2, 4)]
    assert progress.total == 3  # the step the stage planned and did not take is dropped too
    progress.step("amp")  # past every plan: the total follows, never below the step
    assert seen[-1] == ("amp", 3, 4)
    with progress.planned(2):
        progress.step("fp32")
    assert seen[-1] == ("fp32", 4, 6)
    progress.begin()  # the next stage counts from 0
    progress.step("bf16")
    assert seen[-1] == ("bf16", 0, 1) and progress.done == 1
