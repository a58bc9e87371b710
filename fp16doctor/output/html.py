"""Self-contained HTML reports: the figures inline as SVG, the findings, fixes and stages below them.

One file, no network: no scripts, no external stylesheets or fonts (matplotlib
draws text as paths), so it opens offline and can be attached to a CI artifact
or an issue. Built from the data the API returns; rendering only.
"""

from __future__ import annotations

import html
import io
from typing import Any

import yaml

from ..diagnosis.findings import Diagnosis, Finding, Verification
from ..diagnosis.verify import verification_status
from ..files import jsonable
from .formatting import exact_numbers, healthy_headline, human, shown_evidence
from .markdown import corrected_text
from .patches import contradicted_settings, reference_to_corrected
from .plots import Figure, comparison_figures, diagnosis_figures, speed_breakdown
from .speed import advice_measured

STYLE = """
:root { --err: #c62828; --warn: #b26a00; --info: #1565c0; --ok: #2e7d32; --muted: #666; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto; max-width: 1200px;
       padding: 16px; color: #111; background: #fff; }
h1 { font-size: 1.5em; margin: 0 0 4px; } h2 { font-size: 1.2em; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; margin: 0 0 6px; }
.verdict { font-weight: 600; font-size: 1.1em; } .healthy { color: var(--ok); } .unhealthy, .diverged, .unstable { color: var(--err); }
.drift { color: var(--warn); } .meta { color: var(--muted); margin: 2px 0; overflow-wrap: anywhere; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 520px), 1fr)); gap: 16px; }
figure { margin: 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 8px; background: #fafafa; min-width: 0; }
figure svg { width: 100%; height: auto; display: block; }
figcaption { font-size: 0.9em; color: #333; } figcaption b { display: block; color: #111; }
article { border-left: 5px solid var(--info); padding: 8px 12px; margin: 12px 0; background: #f7f9fc; overflow-wrap: anywhere; }
article.error { border-color: var(--err); } article.warning { border-color: var(--warn); }
.sev { text-transform: uppercase; font-size: 0.8em; font-weight: 700; }
.error .sev { color: var(--err); } .warning .sev { color: var(--warn); } .info .sev { color: var(--info); }
table { border-collapse: collapse; font-size: 0.9em; margin: 6px 0; max-width: 100%; }
td, th { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top; text-align: left; }
th { background: #f0f0f0; } .scroll { overflow-x: auto; }
pre { background: #f4f4f4; padding: 8px; overflow-x: auto; font-size: 0.85em; margin: 6px 0; }
.verification { font-weight: 600; } .verified { color: var(--ok); } .partial { color: var(--warn); }
.untried, .unmeasured { color: var(--muted); }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
"""


def _e(text: Any) -> str:
    return html.escape(str(text))


def figure_html(figure: Figure) -> str:
    data = " ".join(
        f'data-{k.replace("_", "-")}="{_e(" ".join(map(str, v)) if isinstance(v, list) else v)}"'
        for k, v in figure.data.items()
        if not isinstance(v, dict)
    )
    return (
        f'<figure id="{figure.id}" {data}>{figure.svg}'
        f"<figcaption><b>{_e(figure.title)}</b>{_e(figure.caption)}</figcaption></figure>"
    )


def highlighted(code: str, lexer: str = "python") -> str:
    """Code coloured with rich's highlighter, exported with inline styles (no stylesheet to fetch)."""
    from rich.console import Console
    from rich.syntax import Syntax

    console = Console(record=True, file=io.StringIO(), width=110, color_system="truecolor")
    console.print(Syntax(code, lexer, theme="default", background_color="default", word_wrap=True))
    return console.export_html(inline_styles=True, code_format="<pre><code>{code}</code></pre>")


def _table(rows: list[list[Any]], header: list[str] | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table>{head}{body}</table></div>'


def verification_html(v: Verification | None) -> str:
    if not v:
        return ""
    status, text = verification_status(v)
    tried = f" (tried {v.tried})" if v.tried else ""
    return f'<p class="verification {status}">{_e(text[0].upper() + text[1:] + tried)}</p>'


def finding_html(finding: Finding, contested: list[str] | None = None, diagnosis: Diagnosis | None = None) -> str:
    """One finding; ``contested``: the settings of its patch another finding's contradicts (see :mod:`.patches`)."""
    evidence = [
        [
            key,
            yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
            if not isinstance(value, str)
            else value,
        ]
        for key, value in shown_evidence(finding.evidence_json()).items()
    ]
    parts = [
        f'<article class="{finding.severity}" id="finding-{finding.rank}">',
        f'<h3><span class="sev">{_e(finding.severity)}</span> {finding.rank}. <code>{_e(finding.cause)}</code>{" (found by intervention)" if finding.found_by == "intervention" else ""}</h3>',
        f"<p>{_e(finding.title)}</p>",
        _table(evidence),
        f"<p><b>Fix:</b> {_e(finding.fix.summary)}</p>",
    ]
    if finding.fix.code:
        parts.append(highlighted(finding.fix.code))
    if contested and diagnosis is not None:
        parts.append(f"<p>{_e(reference_to_corrected(finding, contested, diagnosis))}</p>")
    elif finding.fix.config_patch:
        parts.append("<p>Config patch (try it now with <code>--config</code>):</p>")
        parts.append(
            highlighted(yaml.safe_dump(exact_numbers(finding.fix.config_patch), sort_keys=False).rstrip(), "yaml")
        )
    parts.append(verification_html(finding.verification))
    parts.append("</article>")
    return "".join(parts)


def _page(title: str, header: str, figures: list[Figure], body: list[str]) -> str:
    plots = "".join(figure_html(f) for f in figures)
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>"
        f'<header>{header}</header><h2>Plots</h2><section class="plots">{plots}</section>{"".join(body)}'
        '<footer><p class="meta">Written by fp16doctor. Self-contained: nothing in this file is fetched from anywhere.</p>'
        "</footer></body></html>\n"
    )


def diagnosis_html(diagnosis: Diagnosis, training_file: str) -> str:
    """The diagnosis as one self-contained HTML page."""
    ev = diagnosis.evidence
    errors = [f for f in diagnosis.findings if f.severity == "error"]
    verdict = diagnosis.verdict
    line = f"{verdict}: " + (
        f"{len(errors)} error finding(s); top cause {errors[0].cause}"
        if errors
        else "the training " + healthy_headline([f.severity for f in diagnosis.findings], diagnosis.only_eager_fails)
    )
    header = (
        f'<h1>fp16doctor diagnosis</h1><p class="verdict {verdict}">{_e(line)}</p>'
        f'<p class="meta"><code>{_e(training_file)}</code> · device {_e(ev.device)} · {ev.steps} steps per probe · '
        f"dtype {_e(ev.config.dtype)}</p>" + "".join(f'<p class="meta">note: {_e(n)}</p>' for n in diagnosis.notes)
    )
    body = ["<h2>Findings</h2>"]
    contested = contradicted_settings(diagnosis)
    body += [finding_html(f, contested.get(f.rank), diagnosis) for f in diagnosis.findings] or [
        "<p>No findings: AMP behaves like its FP32 twin.</p>"
    ]
    if diagnosis.evidence.symptoms:
        body.append("<h2>Measured symptoms</h2>")
        body.append(
            _table(
                [
                    [s.code, s.description, ", ".join(diagnosis.evidence.explained.get(s.code, [])) or "unexplained"]
                    for s in diagnosis.evidence.symptoms
                ],
                ["symptom", "measured", "explained by"],
            )
        )
    if diagnosis.corrected is not None:
        c = diagnosis.corrected
        body.append("<h2>Corrected config</h2>")
        body.append(f"<p>{_e(corrected_text(c))}</p>")
        body.append(
            highlighted(yaml.safe_dump(exact_numbers(jsonable(c.config_patch)), sort_keys=False).rstrip(), "yaml")
        )
    body.append("<h2>Triage stages</h2>")
    body.append(
        _table(
            [[s.name, s.status, f"{s.seconds:.2f} s", s.summary] for s in diagnosis.stages],
            ["stage", "status", "time", "what it found"],
        )
    )
    return _page(f"fp16doctor: {training_file}", header, diagnosis_figures(diagnosis), body)


def comparison_html(result: Any, training_file: str) -> str:
    """A ``compare`` run as one self-contained HTML page."""
    header = (
        f'<h1>fp16doctor compare</h1><p class="verdict {result.verdict}">{_e(result.verdict)}</p>'
        f'<p class="meta"><code>{_e(training_file)}</code> · modes {_e(", ".join(result.modes))} · {result.steps} steps</p>'
    )
    rows = []
    for mode in result.modes[1:]:
        t = result.trajectories[mode]
        rows.append(
            [
                mode,
                result.verdict_by_mode[mode],
                human(result.max_rel_dev.get(mode), percent=True),
                result.first_divergent_step.get(mode),
                t.skipped,
                "; ".join(s.description for s in t.symptoms) or "none",
            ]
        )
    body = [
        "<h2>Per mode</h2>",
        _table(rows, ["mode", "verdict", "worst deviation", "first step past tolerance", "skipped", "symptoms"]),
    ]
    return _page(f"fp16doctor compare: {training_file}", header, comparison_figures(result), body)


def speed_html(report: Any, training_file: str) -> str:
    """A ``speed`` report as one self-contained HTML page: the times, the breakdown plot, the advice and the counts
    behind it."""
    fp32, amp = report.timing["fp32"], report.timing["amp"]
    label = "" if report.device == "cuda" else " (on a CPU: the times do not predict a GPU)"
    speedup = f", AMP {human(report.speedup)}x fp32's speed" if report.speedup else ""
    header = (
        f'<h1>fp16doctor speed</h1><p class="verdict">step: fp32 {human(fp32["step_ms"])} ms, AMP '
        f"{human(amp['step_ms'])} ms{_e(speedup)}{_e(label)}</p>"
        f'<p class="meta"><code>{_e(training_file)}</code> · device {_e(report.device)}</p>'
    )
    advice = "".join(
        f"<li><b>{_e(a.what)}</b>: {_e(a.why)}"
        + (f"<br><small>{_e(measured)}</small>" if (measured := advice_measured(a)) else "")
        + "</li>"
        for a in report.advice
    )
    c = report.counts
    body = [
        "<h2>What would make AMP faster</h2>",
        f"<ol>{advice}</ol>"
        if advice
        else "<p>Nothing to change: the step runs in half precision, aligned and without host waits.</p>",
        "<h2>Counted on one AMP step</h2>",
        _table(
            [
                ["half-precision share of the FLOPs", human(c.half_share, percent=True)],
                ["casts", f"{c.casts} ({c.cast_bytes / 2**20:.2f} MiB)"],
                ["element-wise operators", f"{c.elementwise} ({c.elementwise_bytes / 2**20:.2f} MiB moved)"],
                ["host synchronisations", sum(c.syncs.values())],
            ]
        ),
    ]
    if c.misaligned:
        rows = report.misaligned_table().values.tolist()
        body += ["<h3>Misaligned half-precision products</h3>", _table(rows, ["op", "module", "shape", "flops"])]
    if c.syncs:
        rows = [[line, n] for line, n in c.syncs.most_common()]
        body += ["<h3>Host synchronisations</h3>", _table(rows, ["line", "a step"])]
    if c.elementwise_by_module:
        rows = [[module, n] for module, n in c.elementwise_by_module.most_common(10)]
        body += ["<h3>Element-wise operators by module</h3>", _table(rows, ["module", "operators"])]
    return _page(f"fp16doctor speed: {training_file}", header, [speed_breakdown(report)], body)


def write_figures(figures: list[Figure], folder: Any) -> list[tuple[Figure, str]]:
    """Each figure as ``<id>.svg`` in ``folder`` (atomically); returns (figure, file name) pairs."""
    from ..files import atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for figure in figures:
        name = f"{figure.id}.svg"
        atomic_write_text(folder / name, '<?xml version="1.0" encoding="utf-8"?>\n' + figure.svg)
        written.append((figure, name))
    return written
