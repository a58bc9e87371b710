"""``fp16doctor speed`` drawn: the two step times, the counts, and the advice ranked by its estimated effect."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from ..measure.speed import Advice, SpeedReport
from .formatting import human


def render_speed(report: SpeedReport, console: Console) -> None:
    """Times first (labelled where they do not predict a GPU), then what the step runs, then the advice."""
    fp32, amp = report.timing["fp32"], report.timing["amp"]
    label = "" if report.device == "cuda" else " (on a CPU: this does not predict a GPU)"
    speedup = report.speedup
    console.print(
        f"step: fp32 {human(fp32['step_ms'])} ms, AMP {human(amp['step_ms'])} ms"
        + (f", AMP {human(speedup)}x fp32's speed" if speedup else "")
        + label
    )
    for mode, timing in (("fp32", fp32), ("AMP", amp)):
        if timing["peak_memory_bytes"] is not None:
            console.print(f"peak memory {mode}: {timing['peak_memory_bytes'] / 2**20:.0f} MiB")
    c = report.counts
    console.print(f"half-precision share of the FLOPs: {human(c.half_share, percent=True)}")
    if c.fp32_ops:
        total = max(c.flops_half + c.flops_fp32, 1)
        kept = ", ".join(f"{op} {human(flops / total, percent=True)}" for op, flops in c.fp32_ops.most_common(5))
        console.print(f"left in fp32 by autocast: {kept}")
    console.print(
        f"casts: {c.casts} ({c.cast_bytes / 2**20:.2f} MiB); element-wise operators: {c.elementwise} "
        f"({c.elementwise_bytes / 2**20:.2f} MiB moved); host synchronisations: {sum(c.syncs.values())}"
        + (f" (and {c.scaler_syncs} in GradScaler.step's skip check)" if c.scaler_syncs else "")
    )
    for line, count in c.syncs.most_common():
        console.print(f"  [yellow]{escape(line)}[/] ({count} a step)")
    if not report.advice:
        console.print("[green]nothing to change[/]: the step runs in half precision, aligned and without host waits.")
        return
    console.print("[bold]What would make AMP faster, largest effect first:[/]")
    for rank, advice in enumerate(report.advice, 1):
        console.print(f"{rank}. [bold]{escape(advice.what)}[/]: {escape(advice.why)}")
        measured = advice_measured(advice)
        if measured:
            console.print(f"   [dim]{escape(measured)}[/]")


def advice_measured(advice: Advice) -> str | None:
    """What the step measured with the change applied, or why it was not (None: measuring was not asked for)."""
    m = advice.measured
    if m is None:
        return f"not measured: {advice.not_measured}" if advice.not_measured else None
    verdict = "faster" if m.spread[0] > 1 else "slower" if m.spread[1] < 1 else "no clear change"
    label = "" if m.device == "cuda" else ", on a CPU: does not predict a GPU"
    return (
        f"measured: AMP step {human(m.before_ms)} ms -> {human(m.after_ms)} ms with it, {human(m.speedup)}x "
        f"(quartiles {human(m.spread[0])}-{human(m.spread[1])} over {m.rounds} rounds in turn{label}): {verdict}"
    )
