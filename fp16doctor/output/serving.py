"""``fp16doctor serve-check`` drawn: each way of serving against FP32, what passes fp16's range, the keep-set."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..measure.serving import Conversion, ModeResult, OnnxServing, ServeCheck
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
        render_onnx(result.onnx, result.batches, console)
    tolerance = human(result.tolerance, percent=True)
    if result.onnx is not None and result.onnx.error is not None:
        console.print("[bold red]unsafe[/] as an fp16 ONNX conversion: it could not be made (above).")
    elif result.onnx is not None and not result.onnx.within(result.tolerance):
        console.print(
            f"[bold red]unsafe[/] as an fp16 ONNX conversion: not finite, or past {tolerance} of FP32, on "
            "onnxruntime or as written."
        )
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
    elif keep.verified and keep.whole_model:
        console.print(
            f"Only the whole model in fp32 serves it within {tolerance} ({', '.join(keep.modules)}: every module "
            "that holds parameters): serve it in fp32 or bf16, or look at what --tolerance it needs."
        )
    elif keep.verified:
        console.print(
            f"Keep in fp32: [bold]{', '.join(keep.modules)}[/] (verified: finite, {human(keep.rel_dev, percent=True)} "
            "from FP32). In an ONNX fp16 conversion, these are the block list."
        )
        for module, why in keep.why.items():
            console.print(f"  {module}: kept because {why}")
    else:
        console.print(f"Kept in fp32 so far, not enough: {', '.join(keep.modules)}.")
    if result.modes["fp16"].scalar_overflow:
        console.print(
            "The forward writes a number past 65504 into an fp16 tensor (a fill such as -1e9 for a mask): write it "
            "from the tensor's dtype instead, torch.finfo(x.dtype).min, which fits every precision."
        )


def render_onnx(onnx: OnnxServing, batches: int, console: Console) -> None:
    """Each fp16 conversion against FP32, on onnxruntime and as written (every operator in its graph dtype), then
    what the provider ran in fp32, what the converter clamped, and the batches the export's shapes left out."""
    if onnx.error is not None:
        console.print(f"[red]ONNX[/]: the model was not exported and converted: {escape(onnx.error)}")
        return
    table = Table(title=f"fp16 ONNX conversions ({onnx.batches} batch(es))", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("conversion", f"on {onnx.provider}", "as written", "ops run in fp32 there"):
        table.add_column(column)
    conversions = [("whole model", onnx.converted), ("keep-set blocked", onnx.kept)]
    for label, conversion in conversions:
        if conversion is not None:
            table.add_row(
                label,
                _outcome(conversion.result),
                _outcome(conversion.as_written),
                f"{conversion.upcast_ops} of {conversion.half_ops}",
            )
    console.print(table)
    console.print(
        "[dim]as written: every operator in the dtype the graph gives it (onnx's reference evaluator), as an engine "
        f"with fp16 kernels for all of them computes; {escape(onnx.provider)} runs the operators it has no fp16 "
        "kernel for in fp32.[/]"
    )
    for label, conversion in conversions:
        if conversion is not None:
            _conversion_notes(label, conversion, onnx.provider, console)
    if onnx.batches < batches:
        console.print(
            f"{batches - onnx.batches} of the {batches} batches were left out of the ONNX runs: their inputs' shapes "
            "differ from the exported ones (the export takes fixed shapes)."
        )
    if onnx.round_trips_folded:
        console.print(
            f"{onnx.round_trips_folded} cast(s) to fp16 and straight back at the block list's edges were folded, so "
            "the kept nodes take and give fp32 values."
        )
    if onnx.written is not None:
        console.print(
            f"Wrote the served conversion to [bold]{escape(onnx.written)}[/] (its inputs take the exported shapes)."
        )


def _outcome(result: ModeResult) -> str:
    if result.error is not None:
        return "[yellow]not run[/]"
    if not result.finite:
        return "[red]inf/NaN[/]"
    return human(result.rel_dev, percent=True)


def _conversion_notes(label: str, conversion: Conversion, provider: str, console: Console) -> None:
    for mode in (conversion.result, conversion.as_written):
        if mode.error is not None:
            console.print(f"{label}: {escape(mode.error)}")
    if not conversion.upcast.empty:
        ops = ", ".join(f"{row['op']} x{int(row['count'])}" for _, row in conversion.upcast.iterrows())
        console.print(f"{label}: {escape(provider)} ran in fp32: {escape(ops)}")
    for _, row in conversion.clamped.iterrows():
        console.print(
            f"{label}: [yellow]{escape(row['initializer'])}[/] ({human(row['value'])}, read by "
            f"{escape(row['used_by'])}) is stored as {'-' if row['value'] < 0 else ''}65504"
        )
