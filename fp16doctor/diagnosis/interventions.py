"""The intervention search: a cause is what an intervention, tried, repairs.

Rules recognise patterns they were written for. For a measured symptom that no
rule's verified fix removes, the doctor does what an expert does by hand: it
tries its interventions one after the other, most local first and guided by the
localisation, on the same weights and batches, and keeps the first, smallest
one that removes the symptoms:

1. the localised module in fp32, then every module of its class (a repeated
   block fails everywhere once it fails once), then its parent; after a partial
   repair (the fault moved on) the module the fault moved to is added;
2. the set of modules the precision-gap search found to close a same-state gap;
3. the loss in fp32; fp32 master weights and optimizer state;
4. the scale window and growth settings; the LR cap at the schedule's event;
   the scheduler held on skipped steps; unscaling before clipping;
5. the data without the offending rows, or standardised; bf16.

Where the FP32 baseline fails too, only what changes FP32 as well can repair it, and the search runs on the FP32
probe: each candidate is screened on FP32's first non-finite step (does FP32 still fail there?), then run in
FP32 and AMP. Its candidates: the data without its non-finite rows, or without the few rows holding extreme
values; the learning rate capped before the schedule event the trouble grew from; the loss computed in float64
where FP32's first non-finite value is in the loss; an extreme field standardised. Where none repairs every
symptom, the first that repairs FP32 names the cause of FP32's failure.

Each candidate is first *screened* on the failing step alone, from the snapshot
the localisation kept (does the localised fault still happen?), or on the
same-state gap for precision symptoms; only a candidate that passes runs the
full probe past the original fault, with the symptoms measured by the same
definitions as the verdict. The cause is then named by the rule that claims the
repair (:meth:`fp16doctor.diagnosis.rules.Rule.names_repair`), with the
localisation as its evidence.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from ..config import overrides_patch, scaler_patch
from ..engine.records import Column, Reading, Table
from ..measure.localise import OUTSIDE_MODEL, Localisation, trace_step
from ..measure.records import ROOT
from ..measure.symptoms import Symptom, first_nonfinite, skip_runs
from ..measure.thresholds import EXTREME_INPUT, EXTREME_ROWS_SHARE
from ..tensors import FP16_MAX
from .findings import Evidence, Repair, RepairKind, Verification
from .rules._helpers import (
    class_members,
    highest_lr,
    library_modules,
    module_types,
    role_members,
    stores_half_training_state,
)
from .rules.lr_too_high import LOWER_BY
from .sharded import bf16_patch
from .stages import StageContext, same_state_gap
from .verify import Intervention, Verifier, drop_rows, recommended_init_scale, standardise, with_recommended_scale

KINDS = (
    "fp32-modules",
    "loss-fp32",
    "fp32-weights",
    "scaler-scale",
    "scaler-growth",
    "lr-cap",
    "hold-scheduler",
    "unscale-before-clip",
    "drop-nonfinite-rows",
    "drop-extreme-rows",
    "standardise",
    "loss-fp64",
    "bf16",
)
"""Every kind of intervention the search tries (a :class:`Repair`'s ``kind``)."""

RANGE_SYMPTOMS = {"nonfinite", "amp-exception", "skips"}
"""Symptoms of fp16's range: screened on the failing step."""
SEARCH_BUDGET = 8
"""At most this many candidates are tried (screened or run) in a full diagnosis."""
CI_SEARCH_BUDGET = 3
"""--ci: at most three interventions."""
MAX_GROWN = 3
"""A module set grown by localising again after partial repairs holds at most this many modules."""


AGAINST_FP32 = {"trajectory-drift", "same-state-gap", "lost-updates"}
"""The symptoms measured against a finite FP32 baseline: none while it fails."""


@dataclass
class Candidate:
    """One intervention to try, with what the search knows about it."""

    kind: str
    intervention: Intervention
    modules: list[str] = field(default_factory=list)
    scope: str = ""
    module_class: str | None = None
    screen: str = "none"
    """How it is screened before a full probe: ``range`` (the failing step), ``gap`` (the same-state gap), ``fp32``
    (FP32's first non-finite step), ``none``."""
    also: str = ""
    """A change made besides ``kind``'s (see :attr:`fp16doctor.diagnosis.findings.Repair.also`)."""


@dataclass
class Trial:
    """What trying one candidate measured."""

    candidate: Candidate
    screen: str = "not screened"
    passed_screen: bool | None = None
    moved_to: Localisation | None = None
    """A range screen that still failed, elsewhere: where the fault moved to."""
    symptoms_after: list[str] | None = None
    repaired: bool = False
    verification: Verification | None = None
    """The full probe's verification record (when the candidate passed its screen)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "intervention": self.candidate.intervention.description,
            "kind": self.candidate.kind,
            "screen": self.screen,
            "symptoms_after": self.symptoms_after,
            "repaired": self.repaired,
        }


@dataclass
class SearchResult:
    trials: list[Trial]
    repair: Repair | None = None
    fault_is_intrinsic: bool | None = None
    """Whether the localised fault happens at a loss scale of 1 too (None: not checked)."""


class InterventionSearch:
    """Tries the doctor's interventions for ``targets`` (symptoms nothing else removed); see the module docstring."""

    def __init__(self, ctx: StageContext, verifier: Verifier, targets: list[Symptom], budget: int | None = None):
        self.ctx = ctx
        self.ev: Evidence = ctx.evidence
        self.verifier = verifier
        self.targets = targets
        self.codes = {s.code for s in targets}
        self.budget = budget if budget is not None else (CI_SEARCH_BUDGET if ctx.ci else SEARCH_BUDGET)
        self.trials: list[Trial] = []
        self.intrinsic: bool | None = None

    # --- the search ---------------------------------------------------------------------------------
    def run(self) -> SearchResult:
        # the estimate: the scale-1 screen, then each candidate's screen and full probe (unused steps are
        # dropped when the search stops early)
        with self.ctx.progress.planned(self._screen_steps() + self.budget * (self._screen_steps() + self.ev.steps)):
            return self._search()

    def _screen_steps(self) -> int:
        """The probe steps of one screen of the failing step (:meth:`_screen_fault`): from the snapshot the
        localisation kept (else from the start) through the failing step; a same-state pair for a gap."""
        loc = self.ev.localisation
        if loc is None:
            return 2 if self.ev.gap else 0
        kept = [step for step in self.ctx.fault_snapshots if step <= loc.step]
        return loc.step - (max(kept) if kept else 0) + 1

    def _search(self) -> SearchResult:
        loc = self.ev.localisation
        if (
            self.codes & RANGE_SYMPTOMS
            and "fp32-nonfinite" not in self.codes
            and loc is not None
            and loc.phase != "data"
            and self.ev.localisation_deterministic
        ):
            # Does the fault happen at a loss scale of 1 too? Then candidates are screened there (a scaled
            # backward at 65536 overflows in healthy trainings too); if not, the scale is part of the fault.
            self.intrinsic = self._screen_fault(scaler_patch(enabled=False)) is not None
        seen: set[str] = set()
        for candidate in self._candidates():
            key = candidate.intervention.description
            if key in seen:
                continue
            seen.add(key)
            if len(self.trials) >= self.budget:
                break
            with self.ctx.progress.planned(self._screen_steps() + self.ev.steps):  # a failed screen drops the rest
                trial = self._try(candidate)
            self.trials.append(trial)
            completed = None if trial.repaired else self._with_recommended_scale(trial)
            if completed is not None and len(self.trials) < self.budget:
                seen.add(completed.intervention.description)
                with self.ctx.progress.planned(self.ev.steps):
                    completion = self._try(completed)
                self.trials.append(completion)
                trial = completion if completion.repaired else trial
            if trial.repaired:
                return SearchResult(self.trials, self._repair(trial), self.intrinsic)
        fp32 = self._fp32_repair()
        return SearchResult(self.trials, self._repair(fp32) if fp32 is not None else None, self.intrinsic)

    def _fp32_repair(self) -> Trial | None:
        """Where FP32 fails too and nothing repaired every symptom: of the trials that repaired FP32 without adding
        a symptom, the first in the search's order, unless a later one left strictly less (a rate a hundredth of a
        typo's that leaves AMP skipping gives way to a thousandth that does not). It names the cause of FP32's failure (and the AMP
        symptoms it removed with it); what it left is AMP's own. A symptom measured against FP32 (a drift, a
        same-state gap) could not be measured while FP32 failed: found after the repair, it is not added by it."""
        if "fp32-nonfinite" not in self.codes:
            return None
        before = {s.code for s in self.ev.symptoms} | AGAINST_FP32
        repairs = [
            t
            for t in self.trials
            if t.symptoms_after is not None
            and "fp32-nonfinite" not in t.symptoms_after
            and set(t.symptoms_after) <= before
        ]
        best = repairs[0] if repairs else None
        for trial in repairs[1:]:  # a later trial only where it leaves strictly less: the search's order says more
            if best is not None and set(trial.symptoms_after or []) < set(best.symptoms_after or []):
                best = trial
        return best

    def _with_recommended_scale(self, trial: Trial) -> Candidate | None:
        """The candidate again with the sweep's recommended initial loss scale, when it removed the fault but
        left only a settling scale's skips (:func:`~fp16doctor.diagnosis.verify.with_recommended_scale`)."""
        c = trial.candidate
        if c.kind.startswith("scaler") or c.also:
            return None
        completion = with_recommended_scale(c.intervention, trial.verification, self.ev, self.ctx.config)
        if completion is None:
            return None
        intervention, also = completion
        return Candidate(
            c.kind,
            intervention,
            modules=list(c.modules),
            scope=c.scope,
            module_class=c.module_class,
            screen="none",
            also=also,
        )

    def _try(self, candidate: Candidate) -> Trial:
        trial = Trial(candidate)
        if candidate.screen == "range" and self.intrinsic is not None:
            moved = self._screen_fault(candidate.intervention.config_patch)
            trial.passed_screen = moved is None
            trial.moved_to = moved
            trial.screen = (
                "the failing step stays finite"
                if moved is None
                else f"the failing step still fails: {moved.operator} in {moved.place}"
            )
        elif candidate.screen == "fp32" and self._fp32_trouble() is not None:
            trial.passed_screen = self._fp32_survives(candidate.intervention)
            trial.screen = (
                f"FP32 stays finite through step {self._fp32_trouble()}"
                if trial.passed_screen
                else f"FP32 still fails by step {self._fp32_trouble()}"
            )
        elif candidate.screen == "gap" and self.ev.gap:
            gap = same_state_gap(
                self.ctx, self.ctx.with_config(candidate.intervention.config_patch), self.ev.gap.worst_step
            )
            trial.passed_screen = gap <= self.ev.gap.tolerance
            trial.screen = f"same-state deviation {gap:.3%} (tolerance {self.ev.gap.tolerance:.3%})"
        if trial.passed_screen is False:
            return trial
        verification = self.verifier.verify(candidate.intervention, "")
        trial.symptoms_after = list(verification.symptoms_after or [])
        before = {s.code for s in self.ev.symptoms}
        trial.repaired = (
            not (self.codes & set(trial.symptoms_after)) and set(trial.symptoms_after) <= before - self.codes
        )
        trial.verification = verification
        if candidate.scope in ("module", "relocalised") and trial.passed_screen and not trial.repaired:
            trial.moved_to = self._fault_later(candidate, verification.amp_records)
        return trial

    def _fault_later(self, candidate: Candidate, records: pd.DataFrame | None) -> Localisation | None:
        """Where the fault moved to when the modules kept in fp32 held the failing step, but a later one failed
        (a deep stack's next block overflows a few steps on): that step, traced, under the same patch. An
        approximation: the trace steps on from the state the localisation kept at the first failing step (the
        unpatched run's), where the verification ran patched from the start; a fault it does not find there leaves
        the search to the next candidate."""
        loc = self.ev.localisation
        later = first_nonfinite(records) if records is not None and self.intrinsic is not None else None
        if loc is None or later is None or later <= loc.step:
            return None
        return self._screen_fault(candidate.intervention.config_patch, at=later)

    def _screen_fault(self, patch: dict[str, Any], at: int | None = None) -> Localisation | None:
        """The failing step (or step ``at``) under ``patch``, traced from the snapshot the localisation kept: the
        first non-finite op, or None. Screened at a loss scale of 1 when the fault happens there too (a fault that
        does not depend on the scale: a scaled backward at 65536 would overflow in healthy trainings too)."""
        loc = self.ev.localisation
        assert loc is not None
        step = loc.step if at is None else at
        patch = dict(patch)
        if self.intrinsic:
            patch["scaler"] = dict(patch.get("scaler", {}), enabled=False)
        config = self.ctx.with_config(patch)
        probe = self.ctx.bench.probe("amp", config, instruments=None)
        try:
            with self.ctx.progress.planned(self._screen_steps()):
                kept = [s for s in self.ctx.fault_snapshots if s <= loc.step]
                if kept:
                    probe.restore_kept(self.ctx.fault_snapshots, max(kept))
                while probe.iteration < step and probe.failed is None:
                    probe.step()
                if probe.failed is not None:
                    return loc  # the user's code raised before the failing step: no repair
                found = trace_step(probe)
            return loc if found is None and probe.failed is not None else found  # raising is no repair either
        finally:
            probe.close()

    def _fp32_trouble(self) -> int | None:
        """The FP32 baseline's first step it did not survive (None: it survived, or raised)."""
        fp32 = self.ev.fp32
        return first_nonfinite(fp32.records) if fp32 is not None and fp32.exception is None else None

    def _fp32_survives(self, intervention: Intervention) -> bool:
        """Whether the FP32 probe, with ``intervention``, takes the steps through its first non-finite one finite."""
        trouble = self._fp32_trouble()
        assert trouble is not None
        ctx = self.ctx
        if intervention.batches is not None:
            ctx = copy.copy(self.ctx)
            ctx.bench = copy.copy(self.ctx.bench)
            ctx.bench.batches = intervention.batches(self.ctx.bench.batches)
        probe = ctx.bench.probe("fp32", self.ctx.with_config(intervention.config_patch), instruments=None)
        try:
            with self.ctx.progress.planned(trouble + 1):
                for _ in range(trouble + 1):
                    record = probe.step()
                    if probe.failed is not None or record.nonfinite_loss or record.nonfinite_grads:
                        return False
            return True
        finally:
            probe.close()

    def _repair(self, trial: Trial) -> Repair:
        c = trial.candidate
        return Repair(
            kind=RepairKind(c.kind),
            description=c.intervention.description,
            config_patch=dict(c.intervention.config_patch),
            modules=list(c.modules),
            scope=c.scope,
            module_class=c.module_class,
            symptoms=sorted(self.codes - set(trial.symptoms_after or [])),
            forward_overflow=self._forward_overflow(c.modules),
            verification=trial.verification,
            also=c.also,
        )

    # --- candidates, most local first ---------------------------------------------------------------
    def _candidates(self) -> Iterator[Candidate]:
        loc = self.ev.localisation
        if "fp32-nonfinite" in self.codes:  # FP32 fails too: only what changes FP32 as well can repair it
            yield from self._fp32_candidates()
            return
        if self.codes & RANGE_SYMPTOMS:
            if self.intrinsic is False:
                yield from self._scaler()  # the fault goes away at a loss scale of 1: the scale is part of it
            if loc is not None and loc.phase == "loss":
                yield self._loss_fp32()
            if loc is not None and loc.phase in ("forward", "backward"):
                yield from self._modules(loc.module)
            elif "amp-exception" in self.codes and self.ev.amp is not None and self.ev.amp.exception:
                yield from self._modules(self.ev.amp.exception.module)  # the module that raised
            yield from self._gap_set()
            yield self._loss_fp32()
            yield from self._fp32_weights()
            yield from self._scaler()
            yield from self._schedule()
            yield from self._clipping()
            yield from self._data()
            if self.ctx.config.dtype == "float16" and self.ev.bf16_supported:
                yield self._bf16()
            return
        yield from self._gap_set()
        yield from self._fp32_weights()
        yield self._loss_fp32()
        yield from self._clipping()
        yield from self._schedule()
        yield from self._scaler()

    def _fp32_candidates(self) -> Iterator[Candidate]:
        """What can repair a training whose FP32 baseline fails, each screened on FP32's failing step: the data
        without its non-finite or extreme rows, the LR capped before the schedule event, the loss in float64 where
        FP32's first non-finite value is in the loss, an extreme field standardised, and last a lower LR."""
        data = list(self._data(extreme_rows=True))
        for candidate in data:
            if candidate.kind != "standardise":
                yield replace(candidate, screen="fp32")
        for candidate in self._schedule():
            if candidate.kind == "lr-cap":
                yield replace(candidate, screen="fp32")
        loc = self.ev.fp32_localisation
        if loc is not None and (loc.phase == "loss" or loc.module == OUTSIDE_MODEL):
            yield replace(self._loss_fp64(), screen="fp32")
        for candidate in data:
            if candidate.kind == "standardise":
                yield replace(candidate, screen="fp32")
        yield from self._lower_lr()  # last: a smaller update postpones most faults, it repairs only this one

    def _lower_lr(self) -> Iterator[Candidate]:
        """A tenth of the highest rate FP32 trained at, for every step, then a hundredth, then a thousandth (a rate typed
        three orders too high, 2.0 for 2e-3): an update too large for
        the model makes FP32 diverge too (tried after the schedule's own event, whose cap says more where there is
        one)."""
        highest = highest_lr(self.ev.fp32)
        if highest is None:
            return
        for factor in LOWER_BY:
            lower = highest / factor
            yield Candidate(
                "lr-lower",
                Intervention(
                    f"a learning rate of {lower:.3g} ({highest:.3g} / {factor:g})", overrides_patch(max_lr=lower)
                ),
                screen="fp32",
            )

    def _loss_fp64(self) -> Candidate:
        return Candidate(
            "loss-fp64",
            Intervention("computing the loss in float64", overrides_patch(loss_in_fp64=True)),
        )

    def _modules(self, module: str | None) -> Iterator[Candidate]:
        """The localised module, every module of its class, its parent (and its class); after a partial repair,
        the module the fault moved to is added to the set. Where the module held the failing step and the fault
        came back steps later elsewhere, that set is tried first: a deep stack's last blocks overflow, not all."""
        if not module or module in (OUTSIDE_MODEL, ROOT):
            return
        types = module_types(self.ev)
        chain = [module]
        parts = module.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:depth])
            if types.get(parent) not in ("ModuleList", "ModuleDict", None):
                chain.append(parent)
            if len(chain) == 3:
                break
        library = library_modules(self.ev)
        grown_first = False
        for index, path in enumerate(chain):
            yield self._fp32_modules([path], "module" if index == 0 else "parent")
            if index == 0 and self._held_then_moved([module]):
                grown_first = True
                yield from self._grown([module])
            members = class_members(path, types)
            role = role_members(path, types) if path in library else None
            if role is not None and role.members != members:  # every FFN's wo before every Linear of the model
                yield self._fp32_modules(role.members, "role", what=role.description())
            if members:
                yield self._fp32_modules(members, "class", module_class=types[path])
        if not grown_first:
            yield from self._grown([module])

    def _held_then_moved(self, modules: list[str]) -> bool:
        """The trial of ``modules`` held the failing step, and the fault came back later in another module."""
        last = self._last_trial_of(modules)
        return last is not None and bool(last.passed_screen) and last.moved_to is not None

    def _last_trial_of(self, modules: list[str]) -> Trial | None:
        return next((t for t in reversed(self.trials) if t.candidate.modules == modules), None)

    def _grown(self, modules: list[str]) -> Iterator[Candidate]:
        """Localise again after a partial repair: the fault moved on to another module; keep that one in fp32 too."""
        while len(modules) < MAX_GROWN:
            last = self._last_trial_of(modules)
            if last is None or last.moved_to is None:
                return
            moved = last.moved_to
            if (
                moved.phase not in ("forward", "backward")
                or not moved.module
                or moved.module in (OUTSIDE_MODEL, ROOT)
                or moved.module in modules
            ):
                return
            modules = modules + [moved.module]
            yield self._fp32_modules(modules, "relocalised")

    def _fp32_modules(
        self, modules: list[str], scope: str, module_class: str | None = None, what: str | None = None
    ) -> Candidate:
        types = module_types(self.ev)
        named = ", ".join(f"'{m}' ({types[m]})" if m in types else f"'{m}'" for m in modules)  # '1' (Mish), not "1"
        what = what or (f"every {module_class} ({', '.join(modules)})" if module_class else named)
        return Candidate(
            "fp32-modules",
            Intervention(f"keeping {what} in fp32", overrides_patch(fp32_modules=modules)),
            modules=modules,
            scope=scope,
            module_class=module_class,
            screen=self._screen_kind(),
        )

    def _gap_set(self) -> Iterator[Candidate]:
        gap = self.ev.gap
        if gap is None:
            return
        closing = gap.closing_set
        if closing:
            yield self._fp32_modules(list(closing), "gap-set")
        ranked = gap.ranked_modules or []
        if ranked and not closing:
            top = ranked[0].module
            yield self._fp32_modules([top], "module")
            types = module_types(self.ev)
            members = class_members(top, types)
            if members:
                yield self._fp32_modules(members, "class", module_class=types[top])

    def _screen_kind(self) -> str:
        """Range symptoms are screened on the failing step, a same-state gap on that gap; the rest need the full probe."""
        if self.codes & RANGE_SYMPTOMS:
            return "range"
        return "gap" if "same-state-gap" in self.codes else "none"

    def _loss_fp32(self) -> Candidate:
        return Candidate(
            "loss-fp32",
            Intervention("computing the loss in fp32", overrides_patch(loss_in_fp32=True)),
            screen=self._screen_kind(),
        )

    def _fp32_weights(self) -> Iterator[Candidate]:
        if stores_half_training_state(self.ev):
            yield Candidate(
                "fp32-weights",
                Intervention("fp32 master weights and optimizer state", overrides_patch(fp32_weights=True)),
                screen="range" if self.codes & RANGE_SYMPTOMS else "none",
            )

    def _scaler(self) -> Iterator[Candidate]:
        cfg = self.ctx.config
        if cfg.dtype != "float16":
            return
        recommended = recommended_init_scale(self.ev)
        if not cfg.scaler.enabled:
            yield Candidate(
                "scaler-scale",
                Intervention(
                    f"dynamic loss scaling from {recommended or 65536:g}",
                    scaler_patch(enabled=True, init_scale=float(recommended or 65536)),
                ),
            )
        elif recommended and not math.isclose(recommended, cfg.scaler.init_scale):
            yield Candidate(
                "scaler-scale",
                Intervention(f"an initial loss scale of {recommended:g}", scaler_patch(init_scale=float(recommended))),
            )
        amp = self.ev.amp
        if amp is not None and cfg.scaler.enabled and len(skip_runs(amp.skip_steps)) >= 2:
            interval = int(cfg.scaler.growth_interval * 10)
            yield Candidate(
                "scaler-growth",
                Intervention(f"a growth interval of {interval}", scaler_patch(growth_interval=interval)),
            )

    def _schedule(self) -> Iterator[Candidate]:
        info = self.ctx.schedule if self.ev.has_scheduler else None
        if not info:
            return
        tied = self._tied_cap()
        event = tied[0] if tied else self.ctx.schedule_event_before(self._trouble_step())
        cap = tied[1] if tied else info["lrs"][event - 1] if event is not None else 0.0
        if event is not None and cap > 0:
            where = (
                f"before step {event}'s jump"
                if cap == info["lrs"][event - 1]
                else f"below the warm-up's climb to step {event}'s peak"
            )
            yield Candidate(
                "lr-cap",
                Intervention(f"the learning rate capped at {cap:.3g} ({where})", overrides_patch(max_lr=cap)),
            )
        amp = self.ev.amp
        if amp is not None and amp.skip_steps:
            yield Candidate(
                "hold-scheduler",
                Intervention("the scheduler held on skipped steps", overrides_patch(hold_scheduler_on_skip=True)),
            )

    def _tied_cap(self) -> tuple[int, float] | None:
        """The schedule event the LR stage tied the trouble to, and the cap its pause took the steps at (the rate
        before the event, or before the growth where that one held)."""
        peak = self.ev.lr_peak
        pause = peak.pause if peak is not None else None
        if pause is None or pause.lr_cap is None:
            return None
        return pause.pause_step, pause.lr_cap

    def _trouble_step(self) -> int | None:
        for summary in (self.ev.fp32, self.ev.amp):
            if summary is not None and not summary.finite:
                steps = [s for s in (summary.first_nonfinite_loss, summary.first_nonfinite_grads) if s is not None]
                if steps:
                    return min(steps)
        return self.ev.localisation.step if self.ev.localisation is not None else None

    def _clipping(self) -> Iterator[Candidate]:
        amp = self.ev.amp
        if amp is not None and any(c.get("scaled") for c in amp.clip_calls):
            yield Candidate(
                "unscale-before-clip",
                Intervention("unscaling the gradients before clipping", overrides_patch(unscale_before_clip=True)),
                screen="range" if self.codes & RANGE_SYMPTOMS else "none",
            )

    def _data(self, extreme_rows: bool = False) -> Iterator[Candidate]:
        """The data without its non-finite rows, or an extreme field standardised; ``extreme_rows``: where a few
        rows hold the extreme values (an outlier, a sentinel), first without those rows."""
        for scan in self.ev.data:
            if scan.nonfinite:
                yield Candidate(
                    "drop-nonfinite-rows",
                    Intervention(
                        f"the batches without the rows where '{scan.field}' is non-finite",
                        batches=drop_rows(scan.field),
                    ),
                )
            elif scan.floating and scan.abs_max >= EXTREME_INPUT:
                if extreme_rows and scan.extreme_share <= EXTREME_ROWS_SHARE:
                    yield Candidate(
                        "drop-extreme-rows",
                        Intervention(
                            f"the batches without the rows where '{scan.field}' reaches {EXTREME_INPUT:g} in magnitude",
                            batches=drop_rows(scan.field, limit=EXTREME_INPUT),
                        ),
                    )
                yield Candidate(
                    "standardise", Intervention(f"'{scan.field}' standardised", batches=standardise(scan.field))
                )

    def _bf16(self) -> Candidate:
        patch = bf16_patch(self.ev.config.sharding)
        return Candidate("bf16", Intervention("bfloat16 instead of float16", patch), screen="range")

    def _forward_overflow(self, modules: list[str]) -> bool:
        """Whether the AMP run's forward outputs of ``modules`` (or of modules inside them) left fp16's range."""
        loc = self.ev.localisation

        def inside(name: str) -> bool:
            return any(name == m or name.startswith(m + ".") for m in modules)

        if loc is not None and loc.phase == "forward" and loc.module and inside(loc.module):
            return loc.overflowed  # the traced culprit says: a NaN made inside fp16's range is rounding's
        amp = self.ev.amp
        table = amp.tables.get(Table.FORWARD) if amp is not None else None
        if table is None or table.empty:
            return False
        rows = table[table[Reading.MODULE].map(inside)]
        if loc is not None and "step" in rows:
            rows = rows[rows[Column.STEP] <= loc.step]  # after a non-finite update every later forward is NaN
        made = (rows[Reading.NAN] + rows[Reading.POSINF] + rows[Reading.NEGINF]) > 0
        if Reading.INPUTS_FINITE in rows:
            made &= rows[Reading.INPUTS_FINITE].astype(bool)  # made here, not carried in
        return bool(made.any() or (rows[Reading.ABS_MAX] > FP16_MAX).any())  # an fp32 output beyond fp16's range
