"""``fp16doctor serve-check`` drawn: each way of serving against FP32, what passes fp16's range, the keep-set."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..measure.serving import ServeCheck
from .formatting import human


def render_serve_check(result: ServeCheck, console: Console) -> None:
    """The modes' table, the modules and parameters past fp16's range, then the verdict and the keep-set."""
    table = Table(title="Served against FP32", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("mode", "finite", "worst deviation", "note"):
        table.add_column(column, no_wrap=column != "note")
    for name, mode in result.modes.items():
        table.add_row(
            name,
            "[green]yes[/]" if mode.finite else "[red]no[/]",
            human(mode.rel_dev, percent=True) if mode.error is None and mode.finite else "-",
            escape(mode.error or ""),
        )
    console.print(table)
    for _, row in result.overflowing.iterrows():
        console.print(f"[red]{escape(row['module'])}[/]: outputs up to {human(row['max_abs'])}, past fp16's 65504")
    for _, row in result.flushing.iterrows():
        console.print(
            f"[yellow]{escape(row['module'])}[/]: {int(row['flushed'])} non-zero output(s) "
            f"({human(row['share'], percent=True)}) below fp16's smallest subnormal: zero in fp16"
        )
    for _, row in result.cast_parameters.iterrows():
        console.print(
            f"[yellow]{escape(row['name'])}[/]: {int(row['overflow'])} value(s) past 65504, "
            f"{int(row['flushed'])} flushed to zero when cast to fp16"
        )
    tolerance = human(result.tolerance, percent=True)
    if result.safe:
        console.print(f"[bold green]safe[/] in fp16: finite, within {tolerance} of FP32 on {result.batches} batch(es).")
        return
    console.print(f"[bold red]unsafe[/] in fp16 (model.half()): not finite, or past {tolerance} of FP32.")
    keep = result.keep
    if keep is not None and keep.first_nonfinite:
        console.print(
            f"In fp16 the first module to turn inf or NaN from finite inputs is [red]{keep.first_nonfinite}[/]."
        )
    if keep is None or not keep.modules:
        console.print("No set of modules kept in fp32 was found that serves it.")
    elif keep.verified:
        console.print(
            f"Keep in fp32: [bold]{', '.join(keep.modules)}[/] (verified: finite, {human(keep.rel_dev, percent=True)} "
            "from FP32). In an ONNX fp16 conversion, these are the block list."
        )
    else:
        console.print(f"Kept in fp32 so far, not enough: {', '.join(keep.modules)}.")
