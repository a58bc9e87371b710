"""Stage 7, the precision-gap search: the smallest set of modules kept in fp32 that closes a same-state gap; where
none does, the operators attributed line by line and the smallest set of lines computed in fp32 that closes it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...config import overrides_patch, scaler_patch
from ...engine.kept import release_memory
from ...engine.records import StepRecord
from ...measure.attribution import attribute_operators
from ...measure.localise import trace_step
from ...measure.records import ROOT, OperatorAttribution
from ...measure.symptoms import loss_floor, relative_deviation
from ...measure.thresholds import BF16_FACTOR, GAP_TOLERANCE, SITE_SHARE
from ...tensors import OUT_OF_MEMORY
from ...userfile.modules import module_names
from ..findings import GapSearch, GapTrial, LineTrial, ModuleGap, StageName, StageReport, StageStatus
from .context import (
    StageContext,
    gap_states,
    probe_at,
    remember_fp32_states,
    same_state_gap,
    same_state_records,
    skip_reaches_later_step,
)


def stage_precision_gap(ctx: StageContext) -> StageReport:
    ev, cfg = ctx.evidence, ctx.config
    amp = ev.amp
    if amp is not None and amp.exception is not None:
        return StageReport(
            StageName.PRECISION_GAP, StageStatus.SKIPPED, f"AMP raised {amp.exception.type}: no trajectory to compare"
        )
    if amp is None or amp.first_nonfinite_loss is not None:
        return StageReport(
            StageName.PRECISION_GAP, StageStatus.SKIPPED, "AMP is not finite: a range problem, not a precision gap"
        )
    tolerance = GAP_TOLERANCE * (BF16_FACTOR if cfg.dtype == "bfloat16" else 1.0)
    states = gap_states(ctx)
    if not states:
        return StageReport(
            StageName.PRECISION_GAP, StageStatus.SKIPPED, "FP32 is not finite from its first step: no state to compare"
        )
    floor = loss_floor(ev.fp32.records) if ev.fp32 is not None else 0.0
    ctx.loss_floor = floor
    missing = sorted(set(states) - set(ctx.states))  # usually none: the FP32 baseline kept them
    gaps: dict[int, float] = {}
    amp_steps: dict[int, StepRecord] = {}
    with ctx.progress.planned((missing[-1] if missing else 0) + 2 * len(states)):  # the replay, then a pair per state
        remember_fp32_states(ctx, states)
        for step in states:
            records = same_state_records(ctx, step, {"fp32": ("fp32", cfg), "amp": ("amp", cfg)})
            gaps[step] = relative_deviation(records["amp"].loss, records["fp32"].loss, floor)
            amp_steps[step] = records["amp"]
    worst_step = max(gaps, key=lambda step: gaps[step])
    gap = gaps[worst_step]
    ev.gap = info = GapSearch(same_state_rel_dev=gaps, worst_step=worst_step, gap=gap, tolerance=tolerance)
    _note_compared_scale(info, amp_steps[worst_step], cfg.scaler.init_scale)
    if gap <= tolerance:
        return StageReport(
            StageName.PRECISION_GAP,
            StageStatus.RAN,  # the same-state pairs ran; no module search is needed
            f"AMP matches fp32 on the same state (largest deviation {gap:.3%} at step {worst_step}): "
            "no module to search for",
            details=info.to_json(),
        )
    leak_check = cfg.scaler.enabled and cfg.dtype == "float16"
    # at most: the pair without loss scaling, the pair that ranks the modules, the traced AMP step, a pair per
    # module set tried; where none closes the gap, the pair the operators are attributed on and a pair per line set
    with ctx.progress.planned((2 if leak_check else 0) + 3 + 2 * search_limit(ctx) + 2 + 2 * search_limit(ctx)):
        return _search(ctx, info, leak_check)


def _note_compared_scale(info: GapSearch, amp: StepRecord, configured: float) -> None:
    """Into ``info``: the loss scale AMP's step at the worst state was compared at where a skip lowered it from the
    configured one, and the optimizers whose skip a later optimizer still saw there."""
    trace = amp.trace
    if trace is not None and trace.scaled and amp.loss_scale != configured:
        info.compared_loss_scale = amp.loss_scale
    if trace is not None and skip_reaches_later_step(amp):
        info.skipped_in_comparison = list(trace.skipped_optimizers)


def search_limit(ctx: StageContext) -> int:
    """At most this many module sets are tried."""
    return 3 if ctx.ci else 6


def _search(ctx: StageContext, info: GapSearch, leak_check: bool) -> StageReport:
    """A same-state gap past the tolerance: the loss scale's leak, else the modules that close it."""
    gap, worst_step, tolerance = info.gap, info.worst_step, info.tolerance
    if leak_check:
        # The loss of one step does not depend on the loss scale, unless the scale leaks into it.
        info.gap_without_loss_scaling = plain = same_state_gap(
            ctx, ctx.with_config(scaler_patch(enabled=False)), worst_step
        )
        if plain <= tolerance:
            info.scale_leak = True
            return StageReport(StageName.PRECISION_GAP, StageStatus.RAN, _leak_summary(info), details=info.to_json())
    ranked = _rank_modules(ctx, worst_step)
    info.ranked_modules = ranked[:8]
    info.absorbed_overflow = absorbed_overflow(ctx, worst_step)
    _search_fp32_set(ctx, info, [r.module for r in ranked])
    closed = info.closing_set
    if not closed:  # the operators no module holds (the model's own forward code, the loss), line by line
        _attribute_operators(ctx, info)
    summary = f"AMP deviates {gap:.3%} from fp32 on the same state (step {worst_step}); "
    summary += (
        f"keeping {closed} in fp32 closes it ({info.closed_gap:.3%})"
        if closed
        else "no fp32 module set tried closes it" + _lines_sentence(info)
    )
    if info.absorbed_overflow is not None:
        summary += f"; an overflow no module output shows: {info.absorbed_overflow.describe()}"
    return StageReport(StageName.PRECISION_GAP, StageStatus.RAN, summary, details=info.to_json())


def _leak_summary(info: GapSearch) -> str:
    said = (
        f"AMP deviates {info.gap:.3%} from fp32 on the same state (step {info.worst_step}), and "
        f"{info.gap_without_loss_scaling or 0.0:.3%} with loss scaling off"
    )
    if info.skipped_in_comparison:
        # every scale tried skipped: the later optimizers saw other weights than FP32's, which closes with scaling
        return f"{said}, but {', '.join(info.skipped_in_comparison)} skipped at every loss scale tried"
    return f"{said}: the loss scale leaks into the loss (not a precision gap)"


def absorbed_overflow(ctx: StageContext, step: int) -> Any:
    """AMP's step at ``step`` from the FP32 state, traced: the first forward operator that made a result past fp16's
    range which no module output shows (:func:`~fp16doctor.measure.localise.trace_step`'s ``absorbed``). A linear
    attention's normaliser or a hand-written variance that passes 65504 becomes inf, and ``x / inf = 0`` hides it:
    the run stays finite and only the gap shows. None when the step made none."""
    probe = probe_at(ctx, "amp", ctx.config, step, whole_batches=True)
    try:
        return trace_step(probe, absorbed=True)
    finally:
        probe.close()


def _rank_modules(ctx: StageContext, step: int) -> list[ModuleGap]:
    """Per module: the relative error its output adds over its input, AMP against fp32, same state and batch."""
    outputs: dict[str, dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
    for mode in ("fp32", "amp"):
        probe = probe_at(ctx, mode, ctx.config, step, whole_batches=True)  # each module's output on the whole batch
        names = {m: n for m, n in module_names(probe.model).items() if n != ROOT}
        captured: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

        def hook(
            module: torch.nn.Module,
            args: Any,
            output: Any,
            captured: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = captured,
            names: dict[torch.nn.Module, str] = names,
        ) -> None:
            if module in names and names[module] not in captured:
                first_in = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
                out = (
                    output
                    if isinstance(output, torch.Tensor)
                    else next(
                        (
                            o
                            for o in (output if isinstance(output, (tuple, list)) else [])
                            if isinstance(o, torch.Tensor)
                        ),
                        None,
                    )
                )
                # fp32 copies: exact for fp32 and half values (the errors are taken in fp64, one module at a time)
                captured[names[module]] = (
                    first_in.detach().to(torch.float32, copy=True) if first_in is not None else None,
                    out.detach().to(torch.float32, copy=True) if out is not None and out.is_floating_point() else None,
                )

        handles = [m.register_forward_hook(hook) for m in names]
        try:
            probe.step()
        finally:
            for h in handles:
                h.remove()
            probe.close()
        outputs[mode] = captured
        del probe, handles, hook  # freed before the next mode's probe is built
    ranked = []
    for name, (in32, out32) in outputs["fp32"].items():
        in16, out16 = outputs["amp"].get(name, (None, None))
        if out32 is None or out16 is None or out32.shape != out16.shape:
            continue
        err_out = _rel_err(out16, out32)
        err_in = _rel_err(in16, in32) if in32 is not None and in16 is not None and in32.shape == in16.shape else 0.0
        ranked.append(
            ModuleGap(module=name, added_error=max(err_out - err_in, 0.0), output_error=err_out, input_error=err_in)
        )
    ranked.sort(key=lambda r: r.added_error, reverse=True)
    return ranked


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    diff = float(torch.linalg.vector_norm((a - b).nan_to_num(nan=1e30, posinf=1e30, neginf=1e30)).item())
    return diff / max(float(torch.linalg.vector_norm(b).item()), 1e-30)


def _search_fp32_set(ctx: StageContext, found: GapSearch, candidates: list[str]) -> None:
    """The smallest set of modules (greedy, in ranked order) whose fp32 fallback closes the gap, into ``found``
    (``closing_set`` stays None when no set tried closes it; ``tried`` lists every set)."""
    limit = search_limit(ctx)
    chosen: list[str] = []
    found.tried = tried = []
    for name in candidates[:limit]:
        trial = chosen + [name]
        gap = same_state_gap(ctx, ctx.with_config(overrides_patch(fp32_modules=trial)), found.worst_step)
        tried.append(GapTrial(fp32_modules=trial, gap=gap))
        if gap <= found.tolerance:
            found.closing_set, found.closed_gap = trial, gap
            return
        best_before = min((t.gap for t in tried[:-1]), default=math.inf)
        if gap < best_before:
            chosen = trial  # keep a module only if it helps


def _attribute_operators(ctx: StageContext, info: GapSearch) -> None:
    """Into ``info``: the lines of the user's code ranked by their operators' share of the gap at the worst state
    (:func:`~fp16doctor.measure.attribution.attribute_operators`), and the smallest set of them whose operators in
    fp32 close it."""
    try:
        info.operators = attribute_operators(
            lambda mode: probe_at(ctx, mode, ctx.config, info.worst_step, whole_batches=True),
            base=Path(ctx.bench.spec.path).parent,
        )
    except OUT_OF_MEMORY:  # one more AMP step than the module search takes: the search goes on without it
        release_memory(ctx.bench.device)
        return
    # a line's own operators: one that only calls submodules (``self.encoder(x)``) is the module search's to try
    candidates = [s.site for s in info.operators.sites if s.own_share >= SITE_SHARE and not s.site.startswith("<")]
    _search_fp32_lines(ctx, info, candidates)


def _search_fp32_lines(ctx: StageContext, found: GapSearch, candidates: list[str]) -> None:
    """The smallest set of lines (greedy, in ranked order) whose operators in fp32 close the gap, into ``found``
    (``closing_lines`` stays None when no set tried closes it; ``lines_tried`` lists every set)."""
    chosen: list[str] = []
    found.lines_tried = tried = []
    for site in candidates[: search_limit(ctx)]:
        trial = chosen + [site]
        gap = same_state_gap(ctx, ctx.with_config(overrides_patch(fp32_lines=trial)), found.worst_step)
        tried.append(LineTrial(fp32_lines=trial, gap=gap))
        if gap <= found.tolerance:
            found.closing_lines, found.lines_closed_gap = trial, gap
            return
        if gap < min((t.gap for t in tried[:-1]), default=math.inf):
            chosen = trial  # keep a line only if it helps


def _lines_sentence(info: GapSearch) -> str:
    """What the operator-level attribution found, as the stage's summary ends."""
    found = info.operators
    if found is None or not found.sites:
        return ""
    unmatched = (
        f" ({found.unmatched} of its {found.operators} operators found no FP32 twin: weighed by AMP's gradient alone)"
        if found.unmatched
        else ""
    )
    return _attribution_sentence(info, found) + unmatched


def _attribution_sentence(info: GapSearch, found: OperatorAttribution) -> str:
    """The line that makes most of the gap and the line set that closed it; or how little the rounding accounts for."""
    top = found.sites[0]
    if top.share < SITE_SHARE:  # the rounding of no line accounts for it (an overflow divided away, say)
        return (
            f"; line by line, its operators' rounding accounts for {round(found.explained, 2) + 0.0:.0%} of it, "
            f"no line for {SITE_SHARE:.0%} or more"
        )
    said = f"; the operators at {top.site} ({', '.join(top.operators)}) make {top.share:.0%} of it"
    if info.closing_lines:
        return (
            said
            + f"; computing the operators at {', '.join(info.closing_lines)} in fp32 closes it ({info.lines_closed_gap:.3%})"
        )
    return said + ("; no line set tried in fp32 closes it" if info.lines_tried else "")
