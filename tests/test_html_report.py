"""`--html` reports and `--report` figures: self-contained, every plot that applies, numbers that match the JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest
from conftest import ROOT, SAMPLES, run_cli

SIZE_BUDGET = 2_000_000
"""Bytes: a report must stay attachable to a CI artifact or an issue."""
EXTERNAL = re.compile(
    r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|<script|<link|@import""", re.I
)


class Page(HTMLParser):
    """Collects the figures (id and data attributes) and checks that tags open and close in order."""

    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.figures: dict[str, dict[str, str]] = {}
        self.stack: list[str] = []
        self.svg_depth = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "figure":
            self.figures[attrs["id"]] = attrs
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    assert page.stack == [], page.stack[-5:]
    return page


def check_self_contained(text: str) -> None:
    assert len(text.encode()) < SIZE_BUDGET
    assert not EXTERNAL.search(text), EXTERNAL.search(text).group(0)


def test_diagnose_html_has_every_plot_that_applies_and_agrees_with_the_json(tmp_path):
    path = tmp_path / "report.html"
    proc = run_cli("diagnose", SAMPLES / "warmup_peak.py", "--ci", "--json", "--html", path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report, text = json.loads(proc.stdout), path.read_text()
    check_self_contained(text)
    page = parse(text)
    assert {"plot-loss", "plot-scale", "plot-activations", "plot-underflow", "plot-gradnorm", "plot-lr"} <= set(
        page.figures
    )
    amp = next(s for s in report["stages"] if s["name"] == "amp as configured")
    assert int(page.figures["plot-scale"]["data-skipped-marked"]) == len(amp["details"]["skipped_steps"]) > 0
    lr = next(s for s in report["stages"] if s["name"] == "LR schedule peak")
    assert int(page.figures["plot-lr"]["data-pause-step"]) == lr["details"]["pause_step"]
    assert "corrected" in page.figures["plot-loss"]["data-runs"]  # the verified corrected run is drawn too
    for finding in report["findings"]:
        assert f">{finding['cause']}</code>" in text  # the ranked findings sit below the plots
    assert "Verified:" in text


def test_the_precision_gap_plot_appears_when_the_search_ran(tmp_path):
    path = tmp_path / "gap.html"
    proc = run_cli("diagnose", SAMPLES / "fast_variance_norm.py", "--ci", "--html", path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    page = parse(path.read_text())
    assert int(page.figures["plot-gap"]["data-modules"]) >= 1


def test_compare_html(tmp_path):
    path = tmp_path / "compare.html"
    proc = run_cli("compare", SAMPLES / "scale_too_high.py", "--steps", "8", "--html", path, "--json")
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    text = path.read_text()
    check_self_contained(text)
    page = parse(text)
    assert {"plot-loss", "plot-scale", "plot-gradnorm"} <= set(page.figures)
    assert int(page.figures["plot-scale"]["data-skipped-marked"]) == json.loads(proc.stdout)["skipped_steps"]["amp"]


def test_markdown_report_links_its_figures(tmp_path):
    report = tmp_path / "diag.md"
    proc = run_cli("diagnose", SAMPLES / "loss_in_half.py", "--ci", "--report", report)
    assert proc.returncode == 1, proc.stderr[-2000:]
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())
    assert links and all((tmp_path / link).is_file() for link in links)
    assert all((tmp_path / link).read_text().lstrip().startswith("<?xml") for link in links)


def test_an_existing_html_report_is_not_overwritten_without_asking(tmp_path):
    path = tmp_path / "keep.html"
    path.write_text("mine")
    proc = run_cli("diagnose", SAMPLES / "mlp.py", "--ci", "--html", path)
    assert proc.returncode == 2 and path.read_text() == "mine"


@pytest.mark.parametrize("columns", [80, 100])
def test_compare_fits_the_terminal_without_cutting_numbers(columns):
    proc = run_cli("compare", SAMPLES / "mlp.py", "--steps", "6", "--amp", "--bf16", env={"COLUMNS": str(columns)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert all(len(line) <= columns for line in lines)
    assert "…" not in proc.stdout
    # measured at their widest cells, this file's ten columns take 90 characters: at 80 some are left out
    assert ("left out to fit" in proc.stdout) == (columns == 80)
    wide = run_cli(
        "compare", SAMPLES / "mlp.py", "--steps", "6", "--amp", "--bf16", "--wide", env={"COLUMNS": str(columns)}
    )
    assert "left out" not in wide.stdout


def test_the_cli_imports_matplotlib_only_to_write_a_report():
    code = "import sys, fp16doctor.cli, fp16doctor.diagnosis, fp16doctor.measure.compare; print('matplotlib' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.strip() == "False"
    )


def test_opt_in_browser_screenshots(tmp_path):
    """A real browser renders the report at desktop and phone width (opt in: FP16DOCTOR_BROWSER=chromium)."""
    import os
    import shutil

    browser = os.environ.get("FP16DOCTOR_BROWSER")
    if not browser or not shutil.which(browser):
        pytest.skip("set FP16DOCTOR_BROWSER to a headless-capable Chromium to take the screenshots")
    path = tmp_path / "r.html"
    assert run_cli("diagnose", SAMPLES / "warmup_peak.py", "--ci", "--html", path).returncode == 1
    for width in (1280, 390):
        shot = tmp_path / f"shot{width}.png"
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--window-size={width},2400",
                f"--screenshot={shot}",
                path.as_uri(),
            ],
            capture_output=True,
            timeout=120,
        )
        assert shot.is_file() and shot.stat().st_size > 10_000


def test_a_layer_finite_at_no_step_stays_in_the_activation_plot_with_its_own_marker():
    import math

    import pandas as pd

    from fp16doctor.output.plots import activation_ranges

    forward = pd.DataFrame(
        [
            {"module": "ok", "abs_max": 3.0},
            {"module": "ok", "abs_max": math.nan},  # one bad step
            {"module": "broken", "abs_max": math.nan},
            {"module": "broken", "abs_max": math.nan},
        ]
    )
    backward = pd.DataFrame([{"module": "ok", "abs_max": 1e-3}, {"module": "blown", "abs_max": math.inf}])
    figure = activation_ranges(forward, backward)
    assert figure.data == {
        "layers": 3,
        "over_fp16_max": 2,
        "never_finite": 2,
    }  # "broken" and "blown" drawn, past the edge
