"""``fp16doctor serve-check`` drawn: each way of serving against FP32, what passes fp16's range, the keep-set."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..measure.serving import ServeCheck
from ..measure.serving_onnx import Conversion, OnnxServing
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
    if result.onnx is not None:
        render_onnx(result.onnx, console)
    tolerance = human(result.tolerance, percent=True)
    if result.onnx is not None and not result.onnx.within(result.tolerance):
        console.print(f"[bold red]unsafe[/] as an fp16 ONNX conversion: not finite, or past {tolerance} of FP32.")
    if result.safe:
        console.print(f"[bold green]safe[/] in fp16: finite, within {tolerance} of FP32 on {result.batches} batch(es).")
        return
    if result.modes["fp16"].within(result.tolerance):
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


def render_onnx(onnx: OnnxServing, console: Console) -> None:
    """Each fp16 conversion on onnxruntime against FP32, with what the provider ran in fp32 and what the converter
    clamped."""
    if onnx.error is not None:
        console.print(f"[red]ONNX[/]: no fp16 conversion to run: {escape(onnx.error)}")
        return
    table = Table(
        title=f"fp16 ONNX conversions on onnxruntime ({onnx.provider}, {onnx.batches} batch(es))",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("conversion", "finite", "worst deviation", "fp16 ops run in fp32", "note"):
        table.add_column(column, no_wrap=column != "note")
    for label, conversion in (("whole model", onnx.converted), ("keep-set blocked", onnx.kept)):
        if conversion is not None:
            table.add_row(label, *_conversion_cells(conversion))
    console.print(table)
    served = onnx.served
    if served is not None and served.upcast_ops:
        console.print(
            f"[yellow]{onnx.provider}[/] ran {served.upcast_ops} of the served conversion's {served.half_ops} fp16 "
            "operators in fp32 (no fp16 kernel there): where it is finite, a GPU's fp16 kernels may still not be."
        )
    if onnx.round_trips_folded:
        console.print(
            f"{onnx.round_trips_folded} cast(s) to fp16 and straight back at the block list's edges were folded, so "
            "the kept nodes take and give fp32 values."
        )
    if onnx.written is not None:
        console.print(f"Wrote the served conversion to [bold]{escape(onnx.written)}[/].")


def _conversion_cells(conversion: Conversion) -> tuple[str, str, str, str]:
    result = conversion.result
    ops = ", ".join(f"{row['op']} x{int(row['count'])}" for _, row in conversion.upcast.iterrows())
    clamped = ", ".join(
        f"{row['initializer']} ({human(row['max_abs'])} stored as 65504)" for _, row in conversion.clamped.iterrows()
    )
    note = escape(result.error or (f"clamped: {clamped}" if clamped else ""))
    return (
        "[green]yes[/]" if result.finite else "[red]no[/]",
        human(result.rel_dev, percent=True) if result.error is None and result.finite else "-",
        f"{conversion.upcast_ops} of {conversion.half_ops}" + (f": {ops}" if ops else ""),
        note,
    )
