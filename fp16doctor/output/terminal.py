"""Terminal rendering with rich. The library returns data; only this module draws it."""

from __future__ import annotations

from typing import Any

import yaml
from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..diagnosis.findings import Diagnosis, Finding, StageStatus, Verification
from ..diagnosis.verify import verification_status
from ..files import jsonable
from ..measure.compare import VERDICTS, Comparison, RanksComparison, wrapping_words
from .formatting import exact_numbers, fitted_code, healthy_headline, human, shown_evidence
from .patches import contradicted_settings, reference_to_corrected

VERDICT_STYLE = {"healthy": "bold green", "drift": "bold yellow", "unstable": "bold red", "diverged": "bold red"}
STEP_BY_STEP_LIMIT = 30
"""Runs up to this many steps are shown step by step; longer ones are summarised."""


def _shown_steps(total: int) -> list[int]:
    if total <= STEP_BY_STEP_LIMIT:
        return list(range(total))
    stride = max(1, total // 10)
    return sorted(set(range(0, total, stride)) | {total - 1})


Column = tuple[str, str, str]
"""(header, mode, what) of a column of the step table."""


def _wanted_columns(result: Comparison) -> list[tuple[int, Column]]:
    """Every column of the step table with its priority (0 first): the losses, then the deviations, the gradient
    norms, the skip counts."""
    wanted: list[tuple[int, Column]] = []
    for mode in result.modes:
        wanted.append((0, (f"{mode}\nloss", mode, "loss")))
        if mode != "fp32":
            wanted.append((1, (f"{mode}\ndev", mode, "dev")))
            wanted.append((3, (f"{mode}\nskips", mode, "skips")))
        wanted.append((2, (f"{mode}\n|g|", mode, "grad_norm")))
    return wanted


def _fitted(wanted: list[tuple[int, Column]], widths: dict[Column, int], room: int) -> list[Column]:
    """The columns that fit in ``room`` characters, taken by priority (each its widest cell plus padding), in
    the table's order: a column is left out before any number is cut."""
    chosen: set[Column] = set()
    used = 0
    for _priority, column in sorted(wanted, key=lambda pc: pc[0]):
        if used + widths[column] > room:
            break
        chosen.add(column)
        used += widths[column]
    return [c for _, c in wanted if c in chosen]


def _step_cell(result: Comparison, k: int, mode: str, what: str, digits: int) -> str:
    """One cell of the step table (rich markup for a deviation past its tolerance)."""
    entries = result.trajectories[mode].aligned
    entry = entries[k] if k < len(entries) else None
    if what in ("loss", "grad_norm"):
        return human(entry[what], digits) if entry else "-"
    if what == "skips":
        return str(entry["skipped_before"]) if entry else "-"
    devs = result.rel_dev.get(mode, [])
    dev = devs[k] if k < len(devs) else None
    style = (
        "" if dev is None or dev <= result.tolerance[mode] else ("yellow" if dev <= result.divergence[mode] else "red")
    )
    text = human(dev, 2, percent=True)
    return f"[{style}]{text}[/]" if style else text


def render_comparison(result: Comparison, console: Console, wide: bool = False) -> None:
    """A compact summary per mode first, then the step table fitted to the terminal (``wide``: everything); with
    ``--nproc``, the ranks' comparison after it in the same shape, and whether the ranks agree."""
    _render_modes(result, console, wide)
    ranks = result.ranks
    if ranks is None:
        return
    console.rule(f"On {ranks.world} ranks")
    console.print(f"[dim]{_topology_words(ranks)}; {ranks.seconds:.1f} s[/]")
    _render_modes(ranks.comparison, console, wide)
    agreement = "[green]the ranks agree[/]" if ranks.ranks_agree else "[bold red]the ranks disagree[/]"
    console.print(f"{agreement} on the weights, the loss scale and the skipped steps after every mode.")
    only = ranks.only_parallel(result)
    if only:
        console.print(f"[bold yellow]only when parallelised[/]: {', '.join(only)} is healthy in one process.")


def _topology_words(ranks: RanksComparison) -> str:
    reduced = ", ".join(ranks.hooks) or (
        "DDP's default all-reduce"
        if ranks.policy is None
        else f"reduce_dtype={ranks.policy.get('reduce_dtype') or ranks.policy.get('param_dtype') or 'float32'}"
    )
    return f"{wrapping_words(ranks.topology, ranks.parallelized_by)}, {reduced}; each rank takes one batch of every {ranks.world}"


def _render_modes(result: Comparison, console: Console, wide: bool) -> None:
    summary = Table(title="Summary per mode", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("mode", "verdict", "worst dev", "at step", "first > div", "skips"):
        summary.add_column(column, no_wrap=True)
    for mode in result.modes[1:]:
        verdict = result.verdict_by_mode[mode]
        summary.add_row(
            mode,
            f"[{VERDICT_STYLE[verdict]}]{verdict}[/]",
            human(result.max_rel_dev.get(mode), percent=True),
            human(result.max_rel_dev_step.get(mode)),
            human(result.first_divergent_step.get(mode)),
            str(result.trajectories[mode].skipped),
        )
    console.print(summary)
    tolerances = ", ".join(
        f"{m} {human(result.tolerance[m], percent=True)} / {human(result.divergence[m], percent=True)}"
        for m in result.modes[1:]
    )
    console.print(f"[dim]tolerance / divergence tolerance: {tolerances}[/]")

    digits = 6 if wide else 3
    steps = _shown_steps(result.steps)
    wanted = _wanted_columns(result)
    cells = {c: [_step_cell(result, k, c[1], c[2], digits) for k in steps] for _, c in wanted}
    # a column takes its widest cell, its padding on both sides and the space between columns; the table one edge
    widths = {c: 3 + max(len(Text.from_markup(t).plain) for t in [*c[0].split("\n"), *cells[c]]) for c in cells}
    step_width = 3 + max(len("step"), *(len(str(k)) for k in steps))
    columns = [c for _, c in wanted] if wide else _fitted(wanted, widths, console.width - step_width - 1)
    table = Table(title="Loss and gradient norm on aligned optimizer steps", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("step", justify="right", no_wrap=True)
    for header, _, _ in columns:
        table.add_column(header, justify="right", no_wrap=True)
    for row, k in enumerate(steps):
        table.add_row(str(k), *(cells[c][row] for c in columns))
    notes = []
    if result.steps > STEP_BY_STEP_LIMIT:
        notes.append(f"every {max(1, result.steps // 10)}th of {result.steps} steps shown")
    dropped = len(wanted) - len(columns)
    if dropped:
        notes.append(f"{dropped} column(s) left out to fit: --wide or --csv for all")
    table.caption = "; ".join(notes) or None
    console.print(table)
    for mode, trajectory in result.trajectories.items():
        if trajectory.exception:
            exc = trajectory.exception
            console.print(
                f"[red]{mode}: {exc.type} at step {exc.step}: {escape(exc.message or '')}[/] ({escape(exc.location or 'no location')})"
            )
        skips = trajectory.skipped
        if mode != "fp32" and skips and result.verdict_by_mode.get(mode) not in ("diverged", "unstable"):
            console.print(
                f"[dim]{mode}: {skips} step(s) skipped by the GradScaler (scale settling); trajectories aligned on steps taken.[/]"
            )
    console.print(_verdict_line(result))


def _verdict_line(result: Comparison) -> str:
    """This comparison's own verdict (not the worse of it and the ranks')."""
    verdict = max(result.verdict_by_mode.values(), key=VERDICTS.index, default="healthy")
    style = VERDICT_STYLE[verdict]
    if verdict == "healthy":
        return f"[{style}]healthy[/]: every mode stays within tolerance of fp32."
    parts = []
    for mode, verdict in result.verdict_by_mode.items():
        if verdict == "diverged":
            step = result.first_nonfinite_step.get(mode)
            module = result.trajectories[mode].first_nonfinite_module
            parts.append(
                f"{mode}: first non-finite step {step}"
                + (f" (in module '{module}')" if module else "")
                + (" (the fp32 baseline itself)" if mode == "fp32" else "")
            )
        elif verdict == "drift":
            parts.append(
                f"{mode}: largest deviation {human(result.max_rel_dev[mode], percent=True)} at step {result.max_rel_dev_step[mode]}"
            )
        elif verdict == "unstable":
            parts.append(f"{mode}: " + "; ".join(s.description for s in result.trajectories[mode].symptoms))
    return f"[{style}]{verdict}[/]: " + "; ".join(parts)


SEVERITY_STYLE = {"error": "bold red", "warning": "bold yellow", "info": "bold cyan"}


def render_diagnosis(diagnosis: Diagnosis, console: Console, training_file: str) -> None:
    """Summary line, the stages, then the ranked findings with evidence and fix snippets."""
    errors = [f for f in diagnosis.findings if f.severity == "error"]
    if not errors and diagnosis.unexplained:
        console.print(
            "[bold red]unhealthy[/]: the training raised an exception under AMP that no rule explains (below)."
        )
    elif diagnosis.healthy:
        style = "bold yellow" if any(f.severity == "warning" for f in diagnosis.findings) else "bold green"
        console.print(
            f"[{style}]healthy[/]: {escape(training_file)} "
            f"{healthy_headline([f.severity for f in diagnosis.findings], diagnosis.only_eager_fails)}."
        )
    else:
        console.print(
            f"[bold red]unhealthy[/]: {len(errors)} error finding(s) in {escape(training_file)}; top cause: [bold]{errors[0].cause}[/]"
        )
    stages = Table(title="Triage", title_justify="left", show_lines=False)
    for column in ("stage", "status", "what it found"):
        stages.add_column(column, overflow="fold")
    for stage in diagnosis.stages:
        status = "[green]ran[/]" if stage.status == StageStatus.RAN else "[dim]skipped[/]"
        stages.add_row(stage.name, status, escape(stage.summary))
    console.print(stages)
    contested = contradicted_settings(diagnosis)
    for finding in diagnosis.findings:
        console.print(_finding_panel(finding, contested.get(finding.rank, []), diagnosis, console.width))
    if diagnosis.corrected is not None:
        c = diagnosis.corrected
        style = "green" if c.healthy_after else "yellow"
        console.print(
            f"[{style}]corrected config[/] ({', '.join(c.from_findings)}): {escape(c.summary)}"
            + ("" if c.healthy_after or not c.symptoms_after else f"; symptoms left: {', '.join(c.symptoms_after)}")
            + (f"; {c.caveats}" if c.caveats else "")
            + (
                f"; {c.ranks_summary}"
                if c.ranks_summary and not c.ranks_symptoms_after and not c.ranks_not_rerun
                else ""
            )
        )
        if contested:  # the findings point here instead of printing patches that contradict each other
            console.print(
                _highlighted(yaml.safe_dump(exact_numbers(jsonable(c.config_patch)), sort_keys=False).rstrip(), "yaml")
            )
    for item in diagnosis.unexplained:
        exc = item.exception
        console.print(
            f"[bold red]the {item.probe} probe raised {exc.type} at step {exc.step}[/]: {escape(str(exc.message))} "
            f"({escape(str(exc.location))}); no rule explains it: fix the training code there."
        )


def _highlighted(code: str, language: str) -> Any:
    """``code`` syntax-highlighted. rich's Syntax is imported here, when a fix is printed: it loads pygments (2 MB
    resident), which a diagnosis's probes would otherwise carry (the memory target counts the doctor's own imports)."""
    from rich.syntax import Syntax

    # word_wrap: a line still wider than the panel wraps instead of being cut off (comments were fitted first)
    return Syntax(code, language, theme="ansi_dark", background_color="default", word_wrap=True)


def _finding_panel(finding: Finding, contested: list[str], diagnosis: Diagnosis, width: int) -> Panel:
    """One finding; ``contested``: the settings of its patch another finding's contradicts (see :mod:`.patches`);
    ``width``: the terminal's, that the fix's code is fitted to (the panel's border and padding take 4)."""
    evidence = Table.grid(padding=(0, 2))
    evidence.add_column(style="dim")
    evidence.add_column(overflow="fold")
    for key, value in shown_evidence(finding.evidence_json()).items():
        text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
        evidence.add_row(key, escape(text.removesuffix("\n...")))
    parts: list = [
        f"[bold]{escape(finding.title)}[/]",
        "",
        "[underline]Evidence[/]",
        evidence,
        "",
        f"[underline]Fix[/] {escape(finding.fix.summary)}",
    ]
    if finding.fix.code:
        parts.append(_highlighted(fitted_code(finding.fix.code, width - PANEL_MARGIN), "python"))
    if contested:
        parts.append(f"[dim]{escape(reference_to_corrected(finding, contested, diagnosis))}[/]")
    elif finding.fix.config_patch:
        parts += [
            "[dim]config patch:[/]",
            _highlighted(yaml.safe_dump(exact_numbers(finding.fix.config_patch), sort_keys=False).rstrip(), "yaml"),
        ]
    if finding.verification:
        parts.append(verification_line(finding.verification))
    style = SEVERITY_STYLE[finding.severity]
    found = " (found by intervention)" if finding.found_by == "intervention" else ""
    return Panel(
        Group(*parts),
        title=f"[{style}]{finding.rank}. {finding.severity}: {finding.cause}{found}[/]",
        title_align="left",
        border_style=style.split()[-1],
    )


PANEL_MARGIN = 4
"""Columns a finding's panel takes from the terminal's width: its border and padding on both sides."""

VERIFICATION_STYLE = {"untried": "dim", "verified": "green", "unmeasured": "dim", "partial": "yellow"}


def verification_line(v: Verification) -> str:
    """One line under a fix: what trying it measured."""
    status, text = verification_status(v)
    return f"[{VERIFICATION_STYLE[status]}]{escape(text)}[/]"


def render_training(result: Any, run_dir: Any, console: Console) -> None:
    """The run's final summary."""
    style = {"completed": "bold green", "stopped": "bold red", "failed": "bold red", "interrupted": "bold yellow"}[
        result.status
    ]
    table = Table(
        title=f"Training run: [{style}]{result.status}[/]" + (f" ({escape(result.reason)})" if result.reason else ""),
        title_justify="left",
        show_header=False,
    )
    table.add_column(style="dim")
    table.add_column(overflow="fold")
    table.add_row("steps", f"{result.first_step} -> {result.steps}")
    table.add_row("final loss", human(result.final_loss, 6))
    table.add_row("skipped steps", str(result.skipped))
    table.add_row("non-finite steps", str(result.nonfinite))
    if result.first_nonfinite:
        table.add_row(
            "first non-finite",
            escape(f"step {result.first_nonfinite['step']}: {result.first_nonfinite.get('explanation', '')}"),
        )
    table.add_row("last checkpoint", escape(str(result.last_checkpoint)))
    table.add_row("run directory", escape(str(run_dir)) + "  (metrics.csv, checkpoints/, summary.json)")
    table.add_row("time", f"{result.seconds:.1f} s")
    console.print(table)
    for finding in result.findings:
        console.print(
            f"[yellow]{finding['severity']}: {finding['cause']}[/]: {escape(finding['title'])}. {escape(finding['fix'])}"
        )
