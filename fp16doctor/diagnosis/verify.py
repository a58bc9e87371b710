"""Trying each cause's fix: the intervention a finding proposes, measured on a short probe.

A rule explains symptoms; whether its fix removes them is measured, not
assumed. Every error finding's :class:`Intervention` (a config patch and
runtime overrides for precision causes, cleaned or standardised batches for
data causes, the capped learning rate for a schedule's peak) is applied to a
probe from the same initial weights and batches, and the symptoms are measured
again with the definitions that decide the verdict (:mod:`fp16doctor.measure.symptoms`).
The ranking then prefers the finding whose intervention removes the symptom.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..config import DoctorConfig
from ..engine.records import Column
from ..measure.symptoms import (
    Symptom,
    loss_floor,
    relative_deviation,
    skip_profile,
    tail_losses,
)
from ..tensors import OUT_OF_MEMORY
from ..userfile.batches import iter_tensors, map_named_tensors
from .findings import Evidence, Finding, Verification

if TYPE_CHECKING:
    from ..engine.instruments import InstrumentOptions


def symptom_instruments() -> InstrumentOptions:
    """What measuring the symptoms needs beyond the step records: the lost-update share (no rule reads these
    probes). Made on use: the rules import this module for :class:`Intervention`, and must not load the probe engine."""
    from ..engine.instruments import InstrumentOptions

    return InstrumentOptions(forward=False, activation_grads=False, param_grads=False, updates=True)


@dataclass
class Intervention:
    """What trying a finding's fix means concretely."""

    description: str
    config_patch: dict[str, Any] = field(default_factory=dict)
    batches: Callable[[list[Any]], list[Any]] | None = None
    """For data causes: the batches with the offending rows dropped or the field standardised."""
    compiled: bool = False
    """The AMP probe calls the model compiled (a fix to how the training compiles: the eager probe is healthy)."""
    measured: Outcome | None = None
    """Already tried where the fault shows (the parallel stage runs the fix under torchrun, in the same launch as
    the training it repairs): the verification reads it instead of running a probe in this process."""

    def size(self, current: dict[str, Any]) -> int:
        """How big a change this is against the ``current`` config: settings it changes (a module list
        counts its modules), a data edit counts 1."""
        return _changed(self.config_patch, current) + (1 if self.batches is not None else 0)

    @property
    def touches_fp32(self) -> bool:
        """Whether the FP32 baseline changes too (other data, a capped learning rate, the loss in float64), so it
        must run again."""
        overrides = self.config_patch.get("overrides", {})
        return self.batches is not None or "max_lr" in overrides or bool(overrides.get("loss_in_fp64"))


def _changed(patch: Any, current: Any) -> int:
    if isinstance(patch, dict):
        current = current if isinstance(current, dict) else {}
        return sum(_changed(v, current.get(k)) for k, v in patch.items())
    if patch == current:
        return 0
    if isinstance(patch, list):
        return max(len([p for p in patch if p not in (current or [])]), 1)
    return 1


@dataclass
class Outcome:
    """The probes of one intervention: the records the symptoms are measured on."""

    amp: pd.DataFrame
    fp32: pd.DataFrame
    symptoms: list[Symptom]
    aligned_amp: pd.DataFrame | None = None
    """The AMP run aligned on the steps taken, where the drift was measured on it (a settling scale's lag)."""

    def summary(self) -> str:
        """ "AMP finite, 0 skips after calibration, final loss within 0.3% of FP32" """
        if any(s.code == "fp32-nonfinite" for s in self.symptoms):
            return "the FP32 baseline still fails"
        parts = []
        bad = next((s for s in self.symptoms if s.code in ("nonfinite", "amp-exception")), None)
        parts.append("AMP finite" if bad is None else f"AMP still fails ({bad.description})")
        profile = skip_profile(self.amp)
        if not profile["settled"] and profile["attempted"]:
            parts.append(f"all {profile['attempted']} steps skipped: the scale never settled")
        else:
            parts.append(
                f"{profile['after_settling']} skip(s) after calibration"
                + (f" ({profile['leading']} while the scale settled)" if profile["leading"] else "")
            )
        aligned = self.aligned_amp is not None
        tails = tail_losses(self.aligned_amp if aligned else self.amp, self.fp32)
        if bad is None and tails is not None:
            parts.append(
                final_loss_phrase(tails[0], tails[1], relative_deviation(tails[0], tails[1], loss_floor(self.fp32)))
                + (" (aligned on the steps taken)" if aligned else "")
            )
        return ", ".join(parts)


def final_loss_phrase(amp_loss: float, fp32_loss: float, deviation: float) -> str:
    """How far the final losses lie apart: a share up to 100%, the two losses past it (a run that diverged is
    not "within 76214962437.2% of FP32")."""
    if deviation <= 1.0:
        return f"final loss within {deviation:.1%} of FP32"
    return f"final loss {amp_loss:.4g} against FP32's {fp32_loss:.4g} (apart by more than FP32's own)"


def apply_batches(batches: list[Any], edit: Callable[[Any], Any]) -> list[Any]:
    """``edit`` applied to each distinct batch once (a cycled short dataset stays cycled)."""
    done: dict[int, Any] = {}
    return [done.setdefault(id(b), edit(b)) for b in batches]


def drop_rows(field_name: str, limit: float | None = None) -> Callable[[list[Any]], list[Any]]:
    """The batches without the rows (first dimension) where ``field_name`` holds a non-finite value (``limit``:
    or a value of at least that magnitude)."""

    def clean(batch: Any) -> Any:
        target = dict(iter_tensors(batch)).get(field_name)
        if target is None or not target.is_floating_point() or target.dim() == 0:
            return batch
        flat = target.reshape(target.shape[0], -1)
        keep = torch.isfinite(flat).all(dim=1)
        if limit is not None:
            keep &= (flat.abs() < limit).all(dim=1)
        rows = target.shape[0]
        return map_named_tensors(batch, lambda _, t: t[keep] if t.dim() and t.shape[0] == rows else t)

    return lambda batches: apply_batches(batches, clean)


def standardise(field_name: str) -> Callable[[list[Any]], list[Any]]:
    """The batches with ``field_name`` standardised per feature (mean and std over every batch)."""

    def edit(batches: list[Any]) -> list[Any]:
        values = [dict(iter_tensors(b))[field_name] for b in {id(b): b for b in batches}.values()]
        stacked = torch.cat([v.double().reshape(v.shape[0], -1) for v in values])
        mean, std = stacked.mean(0), stacked.std(0).clamp_min(1e-6)

        def fix(name: str, t: torch.Tensor) -> torch.Tensor:
            if name != field_name:
                return t
            flat = (t.double().reshape(t.shape[0], -1) - mean) / std
            return flat.reshape(t.shape).to(t.dtype)

        return apply_batches(batches, lambda b: map_named_tensors(b, fix))

    return edit


class Verifier:
    """Runs interventions on short probes against the diagnosis's FP32 baseline (reused, not recomputed)."""

    def __init__(self, ctx: Any, measure_gap: Callable[[DoctorConfig, int], float] | None = None):
        self.ctx = ctx
        self.ev: Evidence = ctx.evidence
        self.measure_gap = measure_gap

    def run(self, intervention: Intervention) -> Outcome:
        """The AMP probe (and FP32 where the intervention changes it) with the intervention applied."""
        from .stages.context import measured_outcome, run_mode

        if intervention.measured is not None:
            return intervention.measured
        config = self.ctx.with_config(intervention.config_patch)
        ctx = self.ctx
        if intervention.batches is not None:
            ctx = copy.copy(self.ctx)
            ctx.bench = copy.copy(self.ctx.bench)
            ctx.bench.batches = intervention.batches(self.ctx.bench.batches)
        instruments = symptom_instruments()
        compiled = intervention.compiled or self._compiled_only()
        with ctx.progress.planned(self.planned_steps(intervention)):
            amp = run_mode(ctx, "amp", config, instruments=instruments, compiled=compiled)
            fp32 = run_mode(ctx, "fp32", config, instruments=instruments) if intervention.touches_fp32 else self.ev.fp32
            assert fp32 is not None, "verification runs after the FP32 baseline stage"
            gap = None
            if self._measures_gap():
                assert self.measure_gap is not None and self.ev.gap is not None
                gap = self.measure_gap(config, self.ev.gap.worst_step)
            symptoms, aligned = measured_outcome(ctx, config, amp, fp32, gap, compiled)
        return Outcome(amp=amp.records, fp32=fp32.records, symptoms=symptoms, aligned_amp=aligned)

    def _compiled_only(self) -> bool:
        """Only the compiled training fails: every fix is tried on it (the eager one is healthy already)."""
        return self.ev.only_compiled_fails()

    def _measures_gap(self) -> bool:
        return (
            self.measure_gap is not None
            and bool(self.ev.gap)
            and any(s.code == "same-state-gap" for s in self.ev.symptoms)
        )

    def planned_steps(self, intervention: Intervention | None) -> int:
        """The probe steps :meth:`run` takes for ``intervention`` (its progress estimate): the AMP probe, the
        FP32 one where the intervention changes it, the same-state pair where a gap is measured."""
        if intervention is None or intervention.measured is not None:
            return 0
        steps = self.ev.steps * (2 if intervention.touches_fp32 else 1)
        return steps + (2 if self._measures_gap() else 0)

    def verify(self, intervention: Intervention | None, nothing_to_try: str) -> Verification:
        """The ``verification`` record of one finding: what was tried, symptoms before and after, the share removed."""
        before = [s.code for s in self.ev.symptoms]
        if intervention is None:
            return Verification(
                tried=None,
                reason=nothing_to_try,
                symptoms_before=before,
                symptoms_after=None,
                removed_share=None,
                repaired=False,
            )
        try:
            outcome = self.run(intervention)
        except OUT_OF_MEMORY as exc:  # the diagnosis's limit: the fix stays untried, the finding stands
            from ..engine.kept import release_memory  # here: importing a rule must not load the engine

            release_memory(self.ctx.bench.device)
            return Verification(
                tried=None,
                reason=f"trying it did not fit in memory ({type(exc).__name__})",
                symptoms_before=before,
                symptoms_after=None,
                removed_share=None,
                repaired=False,
            )
        after = [s.code for s in outcome.symptoms]
        removed = [c for c in before if c not in after]
        return Verification(
            tried=intervention.description,
            config_patch=intervention.config_patch,
            symptoms_before=before,
            symptoms_after=after,
            removed_share=len(removed) / len(before) if before else None,
            repaired=bool(before) and not after,
            size=intervention.size(self.ctx.config.to_dict()),
            summary=outcome.summary(),
            amp_records=outcome.amp,
        )


SETTLING_SYMPTOMS = frozenset({"skips", "trajectory-drift"})
"""What a loss scale settling from far too high leaves behind: skipped steps, and the curve they hold back."""


def recommended_init_scale(ev: Evidence) -> float | None:
    """The initial loss scale the sweep measured best (else the scale window's), None without either."""
    scale = (ev.recommended_scaler or {}).get("init_scale") or (
        ev.window.recommended() if ev.window is not None else None
    )
    return float(scale) if scale else None


def with_recommended_scale(
    intervention: Intervention, tried: Verification | None, ev: Evidence, config: DoctorConfig
) -> tuple[Intervention, str] | None:
    """``intervention`` again with the sweep's recommended initial loss scale, and that change in words, when,
    tried, it removed the fault but left only a settling scale's symptoms (GradScaler halving from 65536, step
    after skipped step, down to what the repaired gradients need: an unnormalised loss of 9000 needs 8), and the
    sweep measured a lower scale. Keeping more of the model in fp32 would remove those skips too; the scale is the
    smaller change, and it is measured like every fix. None where that does not apply: the fix removed no fault of
    its own (skips alone before it), or it changes the data (a scale measured on the original batches)."""
    if (
        tried is None
        or not tried.tried
        or tried.repaired
        or not tried.symptoms_after
        or tried.amp_records is None
        or intervention.batches is not None
        or not set(tried.symptoms_before or []) - SETTLING_SYMPTOMS
    ):
        return None
    scaler = intervention.config_patch.get("scaler", {})
    if (
        not set(tried.symptoms_after) <= SETTLING_SYMPTOMS
        or not skip_profile(tried.amp_records)[Column.SKIPPED]
        or config.dtype != "float16"
        or not config.scaler.enabled
        or intervention.config_patch.get("dtype")
        or "init_scale" in scaler
        or scaler.get("enabled") is False
    ):
        return None
    recommended = recommended_init_scale(ev)
    if recommended is None or recommended >= config.scaler.init_scale:
        return None
    patch = copy.deepcopy(intervention.config_patch)
    patch["scaler"] = dict(scaler, init_scale=recommended)
    also = f"an initial loss scale of {recommended:g}"
    return Intervention(f"{intervention.description}, with {also}", patch, batches=intervention.batches), also


def verification_status(v: Verification) -> tuple[str, str]:
    """What trying a fix measured, for every renderer: a status (``untried``, ``verified``, ``unmeasured``:
    nothing was measured to remove, ``partial``: symptoms left) and the plain sentence."""
    if not v.tried:
        return "untried", f"not verified: {v.reason}"
    if v.repaired:
        return "verified", f"verified: {v.summary}"
    if v.removed_share is None:
        return "unmeasured", f"tried (no measured symptom to remove): {v.summary}"
    return "partial", f"tried, symptoms left ({', '.join(v.symptoms_after or [])}): {v.summary}"


def repair_rank(finding: Finding) -> int:
    """0: its intervention removed every symptom; 1: some; 2: nothing measured or nothing to try; 3: removed nothing."""
    v = finding.verification
    if not v or v.removed_share is None:
        return 2
    if v.repaired:
        return 0
    return 1 if v.removed_share > 0 else 3
