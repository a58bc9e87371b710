"""Numbers that say what they mean, in every renderer: exact powers of two, unmeasured shares in words,
one recommendation per config setting."""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass

import pytest
from conftest import SAMPLES, run_cli
from rich.console import Console

from fp16doctor.diagnosis import rule_cases as fx
from fp16doctor.diagnosis.findings import CorrectedConfig, Diagnosis, EvidenceRecord, Finding, Fix, Verification
from fp16doctor.output.formatting import healthy_headline, human, humanize
from fp16doctor.output.html import diagnosis_html
from fp16doctor.output.markdown import markdown
from fp16doctor.output.terminal import render_diagnosis


@dataclass(frozen=True)
class GrowthEvidence(EvidenceRecord):
    loss_scale: float
    lost_update_share: float


@dataclass(frozen=True)
class PeakEvidence(EvidenceRecord):
    pause_step: int
    loss_scale: float


@dataclass(frozen=True)
class SparseEvidence(EvidenceRecord):
    """Keys that hold nothing beside one that does."""

    keep_in_fp32: str
    rule_remark: str
    overflowing_value: float | None
    symptoms_removed: list[str]


@pytest.mark.parametrize(
    "value, text",
    [
        (2048.0, "2048"),
        (65536.0, "65536"),
        (1024.0, "1024"),
        (8192.0, "8192"),
        (2.0**-14, "2^-14"),
        (2.0**-24, "2^-24"),
        (2.0**40, "2^40"),
        (0.0625, "0.0625"),
        (65504.0, "65504"),
        (1234.5, "1.23e+03"),
        (0.1234567, "0.123"),
    ],
)
def test_powers_of_two_print_exactly_and_other_numbers_to_three_digits(value, text):
    assert human(value) == text
    shown = humanize({"value": value})["value"]
    assert str(shown) == text or float(shown) == float(text)


def test_a_share_that_could_not_be_measured_says_so():
    assert human(float("nan"), percent=True) == "not measured"
    assert humanize({"lost_update_share": float("nan"), "loss": float("nan")}) == {
        "lost_update_share": "not measured",
        "loss": "nan",
    }


def contradicting_diagnosis() -> Diagnosis:
    """Two error findings patching growth_interval with opposite values; the corrected config measured both."""

    def verified(patch):
        return Verification(
            tried="the config patch",
            config_patch=patch,
            symptoms_before=["skips"],
            symptoms_after=[],
            removed_share=1.0,
            repaired=True,
            summary="no symptom left",
        )

    growth = {"scaler": {"init_scale": 2048.0, "growth_interval": 2000}}
    peak = {"scaler": {"growth_interval": 10}, "overrides": {"max_lr": 0.001}}
    findings = [
        Finding(
            "scale-growth",
            "error",
            "The scale grows too fast",
            GrowthEvidence(loss_scale=2048.0, lost_update_share=float("nan")),
            Fix("Raise growth_interval.", config_patch=growth),
            rank=1,
            verification=verified(growth),
        ),
        Finding(
            "lr-schedule-peak",
            "error",
            "Training breaks at the peak",
            PeakEvidence(pause_step=9, loss_scale=8192.0),
            Fix("Cap the learning rate.", config_patch=peak),
            rank=2,
            verification=verified(peak),
        ),
    ]
    corrected = CorrectedConfig(
        config_patch={"scaler": {"init_scale": 2048.0, "growth_interval": 10}, "overrides": {"max_lr": 0.001}},
        from_findings=["scale-growth", "lr-schedule-peak"],
        symptoms_before=["skips"],
        symptoms_after=[],
        summary="no symptom left",
    )
    return Diagnosis(findings=findings, stages=[], evidence=fx.evidence(), corrected=corrected)


def rendered() -> dict[str, str]:
    diagnosis = contradicting_diagnosis()
    buffer = io.StringIO()
    render_diagnosis(diagnosis, Console(file=buffer, width=160, color_system=None), "train.py")
    page = html.unescape(re.sub(r"<[^>]+>", "", diagnosis_html(diagnosis, "train.py")))  # the text a reader sees
    return {"terminal": buffer.getvalue(), "markdown": markdown(diagnosis, "train.py"), "html": page}


@pytest.mark.parametrize("output", ["terminal", "markdown", "html"])
def test_each_renderer_shows_scales_exactly_and_unmeasured_shares_in_words(output):
    text = rendered()[output]
    assert "2048" in text and "8192" in text and "2050" not in text and "8190" not in text
    assert "init_scale: 2048" in text and "init_scale: 2048.0" not in text
    assert "nan%" not in text and "not measured" in text


@pytest.mark.parametrize("output", ["terminal", "markdown", "html"])
def test_contradicting_patches_give_way_to_the_one_corrected_config(output):
    text = rendered()[output]
    assert "growth_interval: 2000" not in text  # the patch the corrected config overrides is never printed
    assert text.count("growth_interval: 10") >= 2  # each finding's reference and the corrected config itself
    assert text.count("use the corrected config instead") == 2
    assert "max_lr: 0.001" in text


def test_the_cli_report_prints_loss_scales_exactly():
    """The scale-overflow finding recommends GradScaler settings: 65536, not 65500.0."""
    terminal = run_cli("diagnose", SAMPLES / "scale_too_high.py", "--ci")
    assert terminal.returncode == 1, terminal.stderr[-2000:]
    assert "init_scale: 65536" in terminal.stdout and "65500" not in terminal.stdout
    assert "nan%" not in terminal.stdout


def test_a_finding_title_never_reads_nan_percent():
    """Half weights whose updates could not be measured (no step taken): the title says so in words."""
    import pandas as pd

    from fp16doctor.diagnosis.rules.half_weights import HalfWeights

    updates = pd.DataFrame([{"param": "0.weight", "dtype": "float16", "lost_update_share": float("nan")}])
    amp = fx.probe(precision=fx.precision(("0", "Linear", "float16", None, "float16")), tables={"updates": updates})
    [finding] = HalfWeights().check(fx.evidence(amp=amp))
    assert "nan" not in finding.title and "could not be measured" in finding.title


def test_an_exception_no_finding_explains_is_reported_by_every_output():
    """A probe's exception with no finding for it: the JSON keeps its documented shape, every renderer names it."""
    evidence = fx.evidence(
        amp=fx.probe(
            record=fx.records(
                exception={
                    "step": 2,
                    "type": "RuntimeError",
                    "message": "boom",
                    "location": "train.py:7",
                    "module": "head",
                }
            )
        )
    )
    diagnosis = Diagnosis(findings=[], stages=[], evidence=evidence)
    assert diagnosis.to_json()["unexplained"] == [
        {
            "probe": "amp",
            "exception": {
                "step": 2,
                "type": "RuntimeError",
                "message": "boom",
                "location": "train.py:7",
                "module": "head",
            },
        }
    ]
    assert diagnosis.verdict == "unhealthy"
    buffer = io.StringIO()
    render_diagnosis(diagnosis, Console(file=buffer, width=160, color_system=None), "train.py")
    for text in (buffer.getvalue(), markdown(diagnosis, "train.py")):
        assert "amp probe raised RuntimeError at step 2" in " ".join(text.split()) and "train.py:7" in text


def test_the_healthy_headline_sends_the_reader_to_warnings_and_keeps_notes_as_notes():
    assert healthy_headline([]) == "trains in mixed precision like its FP32 twin"
    assert healthy_headline(["info", "info"]).endswith("(2 note(s) below)")
    warned = healthy_headline(["info", "warning"])
    assert "FP32 twin" not in warned and "1 warning(s) below" in warned


def test_a_fix_snippet_is_fitted_to_the_terminal_with_its_comments_still_comments():
    from fp16doctor.output.formatting import fitted_code

    code = (
        "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)   # fp32 params -> fp32 state; no .half()\n"
        "    # several optimizers (PyTorch's AMP recipe): every optimizer steps once, through the scaler\n"
        "s = 'a string  # with a hash that is not a comment, long enough to pass the width'\n"
        "scaler.update()"
    )
    fitted = fitted_code(code, 60)
    lines = fitted.splitlines()
    assert lines[0] == "# fp32 params -> fp32 state; no .half()"  # the trailing comment above its code
    assert lines[1] == "optimizer = torch.optim.AdamW(model.parameters(), lr=lr)"
    assert all(len(line) <= 60 and line.startswith("    # ") for line in lines[2:4])
    assert lines[4] == code.splitlines()[2]  # a string is never split
    compile(fitted, "<fix>", "exec")
    assert fitted_code(code, 200) == code  # what fits is left alone


@pytest.mark.parametrize("output", ["terminal", "markdown", "html"])
def test_evidence_keys_that_hold_nothing_are_not_printed_as_empty_rows(output):
    finding = Finding(
        "precision-gap",
        "error",
        "AMP trails FP32",
        SparseEvidence(keep_in_fp32="layers.0.ffn", rule_remark="", overflowing_value=None, symptoms_removed=[]),
        Fix("Keep it in fp32."),
        rank=1,
    )
    diagnosis = Diagnosis(findings=[finding], stages=[], evidence=fx.evidence())
    buffer = io.StringIO()
    render_diagnosis(diagnosis, Console(file=buffer, width=160, color_system=None), "train.py")
    text = {
        "terminal": buffer.getvalue(),
        "markdown": markdown(diagnosis, "train.py"),
        "html": html.unescape(re.sub(r"<[^>]+>", " ", diagnosis_html(diagnosis, "train.py"))),
    }[output]
    assert "keep_in_fp32" in text and "symptoms_removed" in text  # an empty list says something: nothing removed
    assert "rule_remark" not in text and "overflowing_value" not in text


def test_patches_that_keep_different_modules_in_fp32_add_up_and_contradict_nothing():
    """Lists in fixes add (the corrected config keeps every module each fix keeps): two findings keeping two modules
    in fp32 are shown with their own patches, and only their scalar settings can contradict each other."""
    from fp16doctor.output.patches import contradicted_settings

    diagnosis = contradicting_diagnosis()
    for finding, module in zip(diagnosis.findings, ("head", "norm")):
        finding.fix.config_patch["overrides"] = {
            **finding.fix.config_patch.get("overrides", {}),
            "fp32_modules": [module],
        }
    diagnosis.corrected.config_patch["overrides"]["fp32_modules"] = ["head", "norm"]
    assert contradicted_settings(diagnosis) == {1: ["scaler.growth_interval"], 2: ["scaler.growth_interval"]}
