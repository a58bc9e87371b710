"""The figures an expert draws by hand, as inline SVG: built from the records and tables the API returns.

matplotlib is imported here only, and this module only when a report is
written, so ``fp16doctor --help`` stays fast. Each figure has a stable id (the
HTML report's ``<figure id=...>``, the Markdown report's file name), a caption
saying what to look for, and data attributes the tests compare with the JSON.
"""

from __future__ import annotations

import functools
import io
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ..diagnosis.findings import ModuleGap
from ..measure.records import Column, Reading, Table
from ..tensors import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL

MAX_ROWS = 40
"""Layers shown in the per-layer plots: the most extreme ones when a model has more."""
COLOURS = {"fp32": "#1f77b4", "amp": "#d62728", "bf16": "#2ca02c", "corrected": "#9467bd"}


@dataclass
class Figure:
    """One plot, rendered: its id, caption, SVG text and the numbers tests check against the JSON."""

    id: str
    title: str
    caption: str
    svg: str
    data: dict[str, Any] = field(default_factory=dict)


@functools.cache
def _pyplot() -> Any:
    """pyplot, configured once: no display, text as paths (no fonts to fetch), stable SVG ids."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to files only
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "path",
            "font.size": 9,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "figure.dpi": 100,
            "svg.hashsalt": "fp16doctor",
        }
    )
    return plt


def _svg(fig: Any) -> str:
    """The figure as an inline ``<svg>`` element: no XML prologue, no metadata, nothing fetched."""
    plt = _pyplot()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)


def _new(width: float = 6.4, height: float = 3.2) -> tuple[Any, Any]:
    plt = _pyplot()
    return plt.subplots(figsize=(width, height))


def _log_if_wide(ax: Any, values: list[float]) -> None:
    """A log axis when the positive values span more than 50x (a loss spike must not flatten the rest)."""
    shown = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if shown and max(shown) / min(shown) > 50:
        ax.set_yscale("log")


def _finite(values: list[float]) -> list[float]:
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for v in values]


def loss_curves(curves: dict[str, pd.DataFrame], x_label: str = "step") -> Figure:
    """Loss per step for each run; non-finite steps marked at the top of the axis."""
    fig, ax = _new()
    marked = 0
    for name, records in curves.items():
        steps, losses = records[Column.STEP].tolist(), [float(v) for v in records[Column.LOSS]]
        ax.plot(steps, _finite(losses), label=name, color=COLOURS.get(name), linewidth=1.4)
        bad = [s for s, v in zip(steps, losses) if not math.isfinite(v)]
        marked += len(bad)
        if bad:
            ax.plot(
                bad,
                [1.0] * len(bad),
                "x",
                color=COLOURS.get(name, "red"),
                transform=ax.get_xaxis_transform(),
                label=f"{name}: non-finite",
                markersize=7,
            )
    _log_if_wide(ax, [float(v) for records in curves.values() for v in records["loss"]])
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss")
    ax.legend(loc="best", fontsize=8)
    return Figure(
        "plot-loss",
        "Loss per step",
        "The curves should lie on top of each other; a gap that grows, or crosses "
        "(x) at the top, is AMP leaving its FP32 twin.",
        _svg(fig),
        {"nonfinite_marked": marked, "runs": list(curves)},
    )


def loss_scale(records: pd.DataFrame, window: tuple[float, float] | None = None) -> Figure:
    """The loss scale over steps (log scale), skipped steps marked, the derived safe window shaded."""
    fig, ax = _new()
    steps, scales = records[Column.STEP].tolist(), [float(v) for v in records[Column.LOSS_SCALE]]
    ax.step(steps, scales, where="post", color=COLOURS["amp"], label="loss scale")
    skipped = [(s, v) for s, v, k in zip(steps, scales, records["skipped"].astype(bool)) if k]
    if skipped:
        ax.plot([s for s, _ in skipped], [v for _, v in skipped], "v", color="black", label=f"skipped ({len(skipped)})")
    if window is not None and window[0] > 0 and window[1] > 0:
        low, high = sorted(window)
        ax.axhspan(low, high, color="#2ca02c", alpha=0.12, label="safe window (from FP32 gradients)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.legend(loc="best", fontsize=8)
    return Figure(
        "plot-scale",
        "Loss scale and skipped steps",
        "A healthy scale settles inside the green window after a "
        "few skips and stays; skips that keep coming mean the scale grows past it.",
        _svg(fig),
        {"skipped_marked": len(skipped)},
    )


NONFINITE_AT = 4 * FP16_MAX
"""Where a layer with no finite value at any step is drawn: past fp16's largest value, its own marker."""


def _per_module_max(table: pd.DataFrame | None) -> pd.Series:
    """Per module, the largest finite ``abs_max`` over the steps; ``inf`` for a module finite at no step (its
    rows' ``abs_max`` are NaN or inf), which would otherwise drop out of the plot it is the point of."""
    if table is None or table.empty or Reading.MODULE not in table:
        return pd.Series(dtype=float)
    finite = table[Reading.ABS_MAX].astype(float).replace([math.inf, -math.inf], math.nan)
    return table.assign(abs_max=finite).groupby(Reading.MODULE, sort=False)[Reading.ABS_MAX].max().fillna(math.inf)


def activation_ranges(forward: pd.DataFrame | None, backward: pd.DataFrame | None) -> Figure:
    """Per layer: the largest activation (forward) and activation gradient (backward, as scaled) against fp16's edges."""
    fwd, bwd = _per_module_max(forward), _per_module_max(backward)
    modules = list(dict.fromkeys(list(fwd.index) + list(bwd.index)))
    if len(modules) > MAX_ROWS:  # keep the layers nearest an edge of fp16's range

        def distance(m: str) -> float:
            values = [v for v in (fwd.get(m), bwd.get(m)) if v is not None and v > 0]
            if math.inf in values:  # never finite: the layer the plot is for
                return 0.0
            return min(
                (min(abs(math.log10(v / FP16_MAX)), abs(math.log10(v / FP16_MIN_SUBNORMAL))) for v in values),
                default=math.inf,
            )

        modules = sorted(modules, key=distance)[:MAX_ROWS]
    fig, ax = _new(6.4, max(2.4, 0.22 * len(modules) + 1.0))
    rows = list(range(len(modules)))

    def finite_points(values: pd.Series) -> list[float]:
        return [max(v, 1e-30) if math.isfinite(v := values.get(m, math.nan)) else math.nan for m in modules]

    ax.scatter(finite_points(fwd), rows, marker="o", color=COLOURS["fp32"], label="forward |x| max", zorder=3)
    if len(bwd):  # a diagnosis that drew no plots did not record the activation gradients
        ax.scatter(finite_points(bwd), rows, marker="s", color=COLOURS["amp"], label="backward |g·S| max", zorder=3)
    never_finite = [(m, row) for values in (fwd, bwd) for row, m in enumerate(modules) if values.get(m) == math.inf]
    if never_finite:
        ax.scatter(
            [NONFINITE_AT] * len(never_finite),
            [row for _, row in never_finite],
            marker="x",
            color="black",
            label="non-finite at every step",
            zorder=4,
        )
    for value, label, style in (
        (FP16_MAX, "fp16 max 65504", "-"),
        (FP16_MIN_NORMAL, "smallest normal", "--"),
        (FP16_MIN_SUBNORMAL, "smallest subnormal", ":"),
    ):
        ax.axvline(value, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_xscale("log")
    ax.set_yticks(rows)
    ax.set_yticklabels(modules, fontsize=7)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=7)
    over = sum(1 for m in modules if fwd.get(m, 0.0) > FP16_MAX or bwd.get(m, 0.0) > FP16_MAX)
    caption = (
        "Layers whose points reach the solid line overflow fp16; "
        + ("backward points left of the dotted line flush to zero; " if len(bwd) else "")
        + "a cross past the line: no finite value at any step."
    )
    return Figure(
        "plot-activations",
        "Activation ranges per layer",
        caption,
        _svg(fig),
        {"layers": len(modules), "over_fp16_max": over, "never_finite": len({m for m, _ in never_finite})},
    )


def underflow_heatmap(param_grads: pd.DataFrame | None) -> Figure | None:
    """Layer x step: the share of each gradient's mass that flushes to zero at the step's scale."""
    column = Reading.UNDERFLOW_MASS_AT_SCALE
    if param_grads is None or param_grads.empty or column not in param_grads:
        return None
    grid = param_grads.pivot_table(index="param", columns="step", values=column, aggfunc="max", sort=False).fillna(0.0)
    if len(grid) > MAX_ROWS:
        grid = grid.loc[grid.max(axis=1).sort_values(ascending=False).index[:MAX_ROWS]]
    fig, ax = _new(6.4, max(2.4, 0.2 * len(grid) + 1.2))
    image = ax.imshow(
        grid.to_numpy(),
        aspect="auto",
        cmap="magma_r",
        vmin=0.0,
        vmax=max(0.05, float(grid.to_numpy().max())),
        interpolation="nearest",
    )
    ax.set_yticks(range(len(grid)))
    ax.set_yticklabels(grid.index, fontsize=7)
    ax.set_xlabel("step")
    ax.grid(False)
    fig.colorbar(image, ax=ax, label="gradient mass flushed")
    return Figure(
        "plot-underflow",
        "Gradient underflow per layer and step",
        "Dark cells are layers whose gradients flush to "
        "zero in fp16 at that step's scale: over 5% calls for a higher scale.",
        _svg(fig),
        {"layers": len(grid), "worst": float(grid.to_numpy().max()) if grid.size else 0.0},
    )


def module_gap(ranked: list[ModuleGap]) -> Figure | None:
    """The same-state error each module adds over its input (AMP against FP32, same weights and batch)."""
    if not ranked:
        return None
    rows = ranked[:MAX_ROWS]
    fig, ax = _new(6.4, max(2.0, 0.25 * len(rows) + 1.0))
    ax.barh([r.module for r in rows], [max(r.added_error, 1e-12) for r in rows], color=COLOURS["amp"])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("relative error added (AMP vs FP32)")
    return Figure(
        "plot-gap",
        "Which modules add the precision gap",
        "The top bars are the modules to keep in fp32 first.",
        _svg(fig),
        {"modules": len(rows)},
    )


def grad_norms(curves: dict[str, pd.DataFrame]) -> Figure:
    """Global gradient norm per step (unscaled) for each run."""
    fig, ax = _new()
    for name, records in curves.items():
        values = [float(v) for v in records[Column.GRAD_NORM]]
        ax.plot(
            records[Column.STEP].tolist(),
            [v if math.isfinite(v) and v > 0 else math.nan for v in values],
            label=name,
            color=COLOURS.get(name),
            linewidth=1.2,
        )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.legend(loc="best", fontsize=8)
    return Figure(
        "plot-gradnorm",
        "Gradient norm per step",
        "AMP should track FP32; gaps are overflowing steps (inf) or gradients lost to underflow (too low).",
        _svg(fig),
        {"runs": list(curves)},
    )


def lr_schedule(lrs: list[float], pause: int | None) -> Figure:
    """The LR schedule (dry run), with the step the doctor paused at."""
    fig, ax = _new(6.4, 2.6)
    ax.plot(range(len(lrs)), lrs, color=COLOURS["fp32"], drawstyle="steps-post")
    if pause is not None:
        ax.axvline(pause, color=COLOURS["amp"], linestyle="--", label=f"paused at step {pause}")
        ax.legend(loc="best", fontsize=8)
    _log_if_wide(ax, lrs)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    return Figure(
        "plot-lr",
        "Learning-rate schedule",
        "Trouble that starts right at a peak or jump of this curve is the schedule's (see the pause in the stages).",
        _svg(fig),
        {"pause_step": pause},
    )


def diagnosis_figures(diagnosis: Any) -> list[Figure]:
    """Every figure that applies to a diagnosis, in the report's order."""
    ev = diagnosis.evidence
    curves = {
        name: summary.records
        for name, summary in (("fp32", ev.fp32), ("amp", ev.amp), ("bf16", ev.bf16))
        if summary is not None
    }
    corrected = diagnosis.corrected.amp_records if diagnosis.corrected is not None else None
    if corrected is not None:
        curves["corrected"] = corrected
    figures = [loss_curves(curves)]
    if ev.amp is not None and ev.amp.scaler_enabled:
        figures.append(loss_scale(ev.amp.records, (ev.window.low, ev.window.high) if ev.window is not None else None))
    tables = ev.amp.tables if ev.amp is not None else {}
    if tables.get(Table.FORWARD) is not None and not tables[Table.FORWARD].empty:
        figures.append(activation_ranges(tables.get(Table.FORWARD), tables.get(Table.ACTIVATION_GRADS)))
    optional = [
        underflow_heatmap(tables.get(Table.PARAM_GRADS)),
        module_gap((ev.gap.ranked_modules or []) if ev.gap is not None else []),
    ]
    figures += [f for f in optional if f is not None]
    figures.append(grad_norms({k: v for k, v in curves.items() if k in ("fp32", "amp", "corrected")}))
    if ev.lr_peak is not None and ev.lr_peak.schedule.lrs:
        pause = ev.lr_peak.pause
        figures.append(lr_schedule(ev.lr_peak.schedule.lrs, pause.pause_step if pause is not None else None))
    return figures


def comparison_figures(result: Any) -> list[Figure]:
    """Loss, gradient norm and (for scaled modes) the loss scale of a ``compare`` run."""
    curves = {mode: t.records for mode, t in result.trajectories.items()}
    figures = [loss_curves(curves, "iteration (skipped steps retried)"), grad_norms(curves)]
    scaled = [t for mode, t in result.trajectories.items() if mode != "fp32" and (t.records["loss_scale"] != 1.0).any()]
    if scaled:
        figures.insert(1, loss_scale(scaled[0].records))
    return figures


def _shortened(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def speed_breakdown(report: Any) -> Figure:
    """Where the AMP step's work goes: its FLOPs by how they run (half precision on aligned shapes, half precision
    on shapes tensor cores cannot take whole, fp32 by operator), beside each piece of advice's estimated share."""
    c = report.counts
    total = max(c.flops_half + c.flops_fp32, 1)
    misaligned = min(sum(int(g["flops"]) for g in c.misaligned), c.flops_half)
    shares = {"half precision, aligned": (c.flops_half - misaligned) / total}
    if misaligned:
        shares["half precision, misaligned"] = misaligned / total
    shares |= {f"fp32: {op}": flops / total for op, flops in c.fp32_ops.most_common(5)}
    advice = {_shortened(f"{n}. {a.what}", 48): a.effect for n, a in enumerate(report.advice, 1)}
    fig, (flops_ax, advice_ax) = _pyplot().subplots(
        2, 1, figsize=(8.0, 1.8 + 0.3 * (len(shares) + max(len(advice), 1))), constrained_layout=True
    )
    colours = ["#2ca02c" if n == 0 else COLOURS["amp"] for n in range(len(shares))]  # the first: aligned
    flops_ax.barh(list(shares), [100 * v for v in shares.values()], color=colours)
    flops_ax.invert_yaxis()
    flops_ax.set_xlim(0, 100)
    flops_ax.set_xlabel("share of the AMP step's FLOPs (%)")
    if advice:
        advice_ax.barh(list(advice), [100 * v for v in advice.values()], color=COLOURS["fp32"])
        advice_ax.invert_yaxis()
        advice_ax.set_xlabel("estimated share of the step's work (%)")
    else:
        advice_ax.text(0.5, 0.5, "nothing to change", ha="center", va="center", transform=advice_ax.transAxes)
        advice_ax.set_axis_off()
    return Figure(
        "plot-speed",
        "Where the AMP step's work goes, and what each change addresses",
        "Green runs in half precision on shapes tensor cores take whole; red is what AMP cannot speed up as it "
        "stands. Below, the advice by its estimated share, the largest first.",
        _svg(fig),
        {
            "half_aligned_share": round(shares["half precision, aligned"], 4),
            "half_misaligned_share": round(misaligned / total, 4),
            "advice": len(advice),
        },
    )
