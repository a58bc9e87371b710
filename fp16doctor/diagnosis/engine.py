"""Running the triage and turning its evidence into ranked findings."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..config import DoctorConfig, build_config, merge
from ..probe import Workbench
from ..spec import TrainingSpec
from .model import SEVERITIES, Diagnosis, Evidence, Finding, StageReport
from .stages import STAGES, StageContext

CI_STEPS = 20
"""--ci: probes this long (a smoke check, under a minute per model on 2 cores)."""


@dataclass
class DiagnoseOptions:
    ci: bool = False
    """The CI smoke check: fewer steps, narrower sweeps and searches."""
    scan_batches: int | None = None
    """Scan this many batches in stage 1 (default: the batches the probes use)."""


def diagnose(
    spec: TrainingSpec,
    config: DoctorConfig,
    options: DiagnoseOptions | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Run every stage in order, then every rule; return the ranked diagnosis."""
    options = options or DiagnoseOptions()
    if options.ci and config.steps > CI_STEPS:
        config = build_config(merge(config.to_dict(), {"steps": CI_STEPS}))
    bench = Workbench(spec, config, batch_count=max(config.steps, options.scan_batches or 0))
    evidence = Evidence(config=config, device=bench.device.type, steps=config.steps,
                        has_scheduler=spec.scheduler is not None, has_train_step=spec.train_step is not None)
    ctx = StageContext(bench=bench, config=config, evidence=evidence, ci=options.ci)
    stages: list[StageReport] = []
    for name, stage in STAGES:
        if on_stage is not None:
            on_stage(name)
        start = time.perf_counter()
        report = stage(ctx)
        report.seconds = time.perf_counter() - start
        stages.append(report)
    return Diagnosis(findings=rank(evaluate_rules(evidence)), stages=stages, evidence=evidence)


def evaluate_rules(evidence: Evidence) -> list[Finding]:
    """Every rule's findings, minus the symptoms of a root cause found as an error."""
    from ..rules import all_rules

    rules = all_rules()
    findings: list[Finding] = []
    suppressors: dict[str, tuple[str, ...]] = {}
    for rule in rules:
        found = rule.check(evidence)
        findings.extend(found)
        if any(f.severity == "error" for f in found):
            suppressors[rule.code] = rule.suppresses
    hidden = {code for root, codes in suppressors.items() for code in codes if code != root}
    return [f for f in findings if f.cause not in hidden]


def rank(findings: list[Finding]) -> list[Finding]:
    """Severity first, then causal order (data, model, precision settings), then confidence."""
    ordered = sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.order, -f.confidence))
    for index, finding in enumerate(ordered, 1):
        finding.rank = index
    return ordered


def fixed_config(user_layers: dict[str, Any], diagnosis: Diagnosis) -> dict[str, Any]:
    """The user's config with every finding's config patch applied (lists of modules are merged)."""
    out = dict(user_layers)
    for finding in diagnosis.findings:
        if finding.severity == "info":
            continue  # advice, not a fix: bf16 changes the training's precision
        out = merge_patch(out, finding.fix.config_patch)
    return out


def merge_patch(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = list(dict.fromkeys(out[key] + value))
        else:
            out[key] = value
    return out
