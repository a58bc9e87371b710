"""``fp16doctor logs`` drawn: the terminal summary, and the HTML page with the history on one time axis."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from ..history.records import History
from ..history.report import LogsReport

CERTAINTY_STYLE = {"shown": "bold red", "likely": "red", "possible": "yellow"}
PLOT_POINTS = 4000
"""Rows drawn per quantity at most: a million-row history is thinned to every n-th row (trouble rows kept)."""


def render_logs(report: LogsReport, console: Console) -> None:
    """The verdict, what was read, then one panel per finding with its next command."""
    summary = report.summary()
    steps = f"steps {summary['first_step']}..{summary['last_step']}"
    if report.healthy:
        console.print(f"[bold green]healthy[/]: no pattern of trouble in {summary['rows']} logged rows ({steps}).")
    else:
        console.print(
            f"[bold red]unhealthy[/]: {len(report.findings)} finding(s) in {summary['rows']} logged rows ({steps})."
        )
    for source in report.sources:
        carried = ", ".join(source.carried) or "nothing the doctor reads"
        console.print(
            f"[dim]read[/] {escape(str(source.path))} [dim]as[/] {source.format}: {source.rows} rows; {carried}"
        )
    for note in report.notes + [n for s in report.sources for n in s.notes]:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    for finding in report.findings:
        codes = ", ".join(
            [f"cause [bold]{finding.cause}[/]"] * bool(finding.cause) + [f"symptom {s}" for s in finding.symptoms]
        )
        body = [
            f"{escape(finding.title)}.",
            f"[{CERTAINTY_STYLE[finding.certainty.value]}]{finding.certainty.value}[/]: {escape(finding.reason)}",
            f"steps: {', '.join(map(str, finding.steps))}" + (" ..." if finding.last_step > finding.steps[-1] else ""),
            f"[bold]next:[/] {escape(finding.next_command)}",
            f"[dim]{escape(finding.next_reason)}[/]",
        ]
        title = f"{finding.pattern}" + (f" ({codes})" if codes else "")
        console.print(Panel("\n".join(body), title=title, title_align="left", border_style="red"))


def _thinned(history: History) -> np.ndarray:
    """The rows to draw: every n-th, and every row with a skip or a non-finite value."""
    n = len(history)
    if n <= PLOT_POINTS:
        return np.arange(n)
    keep = np.zeros(n, dtype=bool)
    keep[:: math.ceil(n / PLOT_POINTS)] = True
    keep |= (history.skipped() > 0) | (history.nonfinite() > 0)
    return np.flatnonzero(keep)


def history_figure(report: LogsReport) -> Any:
    """Loss, loss scale, skips, gradient norm and LR over the steps, one panel each on a shared axis, the steps of
    every finding shaded."""
    from .plots import Figure, _log_if_wide, _pyplot, _svg

    history = report.history
    rows = _thinned(history)
    shown = [q for q in ("loss", "loss_scale", "skipped", "grad_norm", "lr") if q == "skipped" or history.has(q)]
    plt = _pyplot()
    fig, axes = plt.subplots(len(shown), 1, figsize=(7.5, 1.6 * len(shown) + 0.6), sharex=True, squeeze=False)
    skipped = history.skipped()
    for ax, quantity in zip(axes[:, 0], shown):
        steps = history.step[rows]
        if quantity == "skipped":
            ax.bar(steps, skipped[rows], width=max(1.0, float(np.median(history.span))), color="black")
            ax.set_ylabel("skipped")
        else:
            mask = history.present[quantity][rows]
            values = history.values[quantity][rows][mask]
            finite = np.where(np.isfinite(values) & ((values > 0) | (quantity == "loss")), values, np.nan)
            ax.plot(steps[mask], finite, linewidth=1.1, drawstyle="steps-post" if quantity == "loss_scale" else None)
            if quantity in ("loss_scale", "grad_norm", "lr") and np.isfinite(finite).any():
                ax.set_yscale("log", base=2 if quantity == "loss_scale" else 10)
            elif quantity == "loss":
                _log_if_wide(ax, [float(v) for v in finite])  # a spike must not flatten the rest
            bad = steps[mask][~np.isfinite(values)]
            if len(bad):
                ax.plot(bad, [1.0] * len(bad), "x", color="#d62728", transform=ax.get_xaxis_transform(), markersize=5)
            ax.set_ylabel(quantity.replace("_", " "))
    for i, finding in enumerate(report.findings):
        for ax in axes[:, 0]:
            ax.axvspan(finding.first_step, max(finding.last_step, finding.first_step + 1), color="#d62728", alpha=0.12)
        axes[0, 0].annotate(  # one line per finding above the first panel: the names never overlap
            finding.pattern,
            (finding.first_step, 1.02 + 0.15 * i),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="bottom",
            annotation_clip=False,
        )
    axes[-1, 0].set_xlabel("optimizer step")
    return Figure(
        "plot-history",
        "The run's history",
        "Loss, loss scale, skipped steps, gradient norm and LR on one step axis (x: non-finite); the shaded spans "
        "are the findings' steps.",
        _svg(fig),
        {"findings": [f.pattern for f in report.findings], "rows": len(history), "panels": shown},
    )


def logs_html(report: LogsReport, paths: list[str]) -> str:
    """The logs' reading as one self-contained HTML page: the history plotted, the findings below it."""
    from .html import _e, _page, _table

    verdict = report.verdict
    summary = report.summary()
    header = (
        f'<h1>fp16doctor logs</h1><p class="verdict {verdict}">{_e(verdict)}: {len(report.findings)} finding(s) in '
        f"{summary['rows']} logged rows (steps {summary['first_step']}..{summary['last_step']})</p>"
        + "".join(f'<p class="meta"><code>{_e(p)}</code></p>' for p in paths)
    )
    body = ["<h2>Findings</h2>"]
    for finding in report.findings:
        codes = ", ".join([f"cause {finding.cause}"] * bool(finding.cause) + [f"symptom {s}" for s in finding.symptoms])
        body.append(
            f'<article class="error"><h3><code>{_e(finding.pattern)}</code> {_e(codes)}</h3>'
            f"<p>{_e(finding.title)}.</p><p><b>{_e(finding.certainty.value)}</b>: {_e(finding.reason)}</p>"
            f"<p>steps: {_e(', '.join(map(str, finding.steps)))}</p>"
            + _table([[k, v] for k, v in finding.evidence.to_json().items()])
            + f"<p><b>Next:</b> <code>{_e(finding.next_command)}</code> ({_e(finding.next_reason)})</p></article>"
        )
    if not report.findings:
        body.append("<p>No pattern of trouble in the history.</p>")
    body.append("<h2>Sources</h2>")
    body.append(
        _table(
            [[str(s.path), s.format, s.rows, ", ".join(s.carried), "; ".join(s.notes)] for s in report.sources],
            ["path", "format", "rows", "carried", "notes"],
        )
    )
    return _page("fp16doctor logs", header, [history_figure(report)], body)
