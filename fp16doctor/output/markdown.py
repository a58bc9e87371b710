"""Diagnosis outputs other than the terminal: Markdown report, corrected config (YAML), JUnit XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import Any

import yaml

from ..diagnosis.findings import CorrectedConfig, Diagnosis, Finding, Verification
from ..diagnosis.verify import verification_status
from ..files import jsonable
from .formatting import exact_numbers, shown_evidence
from .patches import contradicted_settings, reference_to_corrected


def _evidence_lines(finding: Finding) -> list[str]:
    return [f"- `{key}`: {json.dumps(value)}" for key, value in shown_evidence(finding.evidence_json()).items()]


def markdown(diagnosis: Diagnosis, training_file: str, figures: list[tuple[Any, str]] | None = None) -> str:
    """A Markdown report: verdict, the figures (linked files beside it), stages, ranked findings with evidence and fixes."""
    lines = [f"# fp16doctor diagnosis: `{training_file}`", "", f"**Verdict: {diagnosis.verdict}**", ""]
    if figures:
        lines += ["## Plots", ""]
        for figure, link in figures:
            lines += [f"![{figure.title}]({link})", "", f"*{figure.title}*: {figure.caption}", ""]
    errors = [f for f in diagnosis.findings if f.severity == "error"]
    lines.append(
        f"{len(errors)} error finding(s), {len(diagnosis.findings) - len(errors)} other(s). "
        f"Device: {diagnosis.evidence.device}; {diagnosis.evidence.steps} steps per probe."
    )
    lines += ["", "## Stages", "", "| stage | status | what it found |", "|---|---|---|"]
    for stage in diagnosis.stages:
        lines.append(f"| {stage.name} | {stage.status} | {stage.summary.replace('|', '/')} |")
    lines += ["", "## Findings", ""]
    for item in diagnosis.unexplained:
        exc = item.exception
        lines += [
            f"**The {item.probe} probe raised {exc.type} at step {exc.step}**: {exc.message} "
            f"(`{exc.location}`); no rule explains it: fix the training code there.",
            "",
        ]
    if not diagnosis.findings and not diagnosis.unexplained:
        lines.append("No findings: AMP behaves like its FP32 twin.")
    contested = contradicted_settings(diagnosis)
    for f in diagnosis.findings:
        found = " (found by intervention)" if f.found_by == "intervention" else ""
        lines += [f"### {f.rank}. [{f.severity}] `{f.cause}`{found}: {f.title}", "", "Evidence:", ""]
        lines += _evidence_lines(f)
        lines += ["", f"Fix: {f.fix.summary}", ""]
        if f.fix.code:
            lines += ["```python", f.fix.code, "```", ""]
        if f.rank in contested:
            lines += [reference_to_corrected(f, contested[f.rank], diagnosis), ""]
        elif f.fix.config_patch:
            lines += [
                "Config patch (try it now with `--config`, see `--fix-config`):",
                "",
                "```yaml",
                yaml.safe_dump(exact_numbers(f.fix.config_patch), sort_keys=False).rstrip(),
                "```",
                "",
            ]
        if f.verification:
            lines += [verification_text(f.verification), ""]
    if diagnosis.corrected is not None:
        lines += ["## Corrected config", "", corrected_text(diagnosis.corrected), ""]
        if contested:  # the findings point here instead of printing patches that contradict each other
            lines += [
                "```yaml",
                yaml.safe_dump(exact_numbers(jsonable(diagnosis.corrected.config_patch)), sort_keys=False).rstrip(),
                "```",
                "",
            ]
    return "\n".join(lines) + "\n"


def verification_text(v: Verification) -> str:
    """What trying a fix measured, as one sentence."""
    _, text = verification_status(v)
    if not v.tried:
        return text[0].upper() + text[1:] + "."
    return f"Tried {v.tried}: {text} (symptoms before: {', '.join(v.symptoms_before) or 'none'})."


def corrected_text(c: CorrectedConfig) -> str:
    """The corrected config's measured before and after, as one sentence."""
    before = ", ".join(c.symptoms_before) or "none"
    after = ", ".join(c.symptoms_after) or "none"
    text = (
        f"Measured with the corrected config ({', '.join(c.from_findings)}): symptoms before: {before}; "
        f"after: {after} ({c.summary})."
    )
    if c.caveats:
        text += f" Not covered: {c.caveats}."
    elif c.ranks_summary:
        text += f" On the ranks: {c.ranks_summary}."
    return text


def fixed_config_yaml(config: dict[str, Any], diagnosis: Diagnosis, training_file: str) -> str:
    """The corrected config as YAML, with a header naming the findings it applies and what it measured."""
    applied = (
        [f for f in diagnosis.findings if f.cause in diagnosis.corrected.from_findings]
        if diagnosis.corrected
        else [f for f in diagnosis.findings if f.fix.config_patch and f.severity != "info"]
    )
    header = [
        f"# fp16doctor: corrected config for {training_file}",
        "# Applies the config patches of these findings (the code snippets in the report make them permanent):",
    ]
    header += [f"#   {f.rank}. {f.cause}: {f.title}" for f in applied] or [
        "#   (none: no config setting repairs this training)"
    ]
    code_fixes = [
        f for f in diagnosis.findings if f.severity == "error" and not f.fix.config_patch and f not in applied
    ]
    if code_fixes:
        header.append("# Still needed, in the training file or the data (no config setting does it):")
        header += [f"#   {f.rank}. {f.cause}: {f.fix.summary}" for f in code_fixes]
    if diagnosis.corrected is not None:
        header.append("# " + corrected_text(diagnosis.corrected))
    header.append("# Use with: fp16doctor train " + training_file + " --config <this file>")
    return "\n".join(header) + "\n" + yaml.safe_dump(jsonable(config), sort_keys=False)


def junit_xml(diagnosis: Diagnosis, training_file: str, rule_codes: list[str]) -> str:
    """One test case per cause: failed where the diagnosis has an error finding of that cause."""
    by_cause: dict[str, list[Finding]] = {}
    for f in diagnosis.findings:
        by_cause.setdefault(f.cause, []).append(f)
    seconds = sum(s.seconds for s in diagnosis.stages)
    suite = ET.Element(
        "testsuite",
        name=f"fp16doctor:{training_file}",
        tests=str(len(rule_codes)),
        failures=str(sum(1 for c in rule_codes if any(f.severity == "error" for f in by_cause.get(c, [])))),
        errors="0",
        skipped="0",
        time=f"{seconds:.2f}",
    )
    for code in rule_codes:
        case = ET.SubElement(suite, "testcase", classname=f"fp16doctor.{training_file}", name=code, time="0")
        findings = by_cause.get(code, [])
        for f in findings:
            body = "\n".join([f.title, "", "Evidence:", *_evidence_lines(f), "", f"Fix: {f.fix.summary}", f.fix.code])
            if f.severity == "error":
                failure = ET.SubElement(case, "failure", message=f.title, type=code)
                failure.text = body
            else:
                out = ET.SubElement(case, "system-out")
                out.text = f"[{f.severity}] {body}"
    stages = ET.SubElement(suite, "system-out")
    stages.text = "\n".join(f"{s.name}: {s.status}: {s.summary}" for s in diagnosis.stages)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
