"""The diagnosis as data: evidence in, findings out. Rendering lives elsewhere."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from ..config import DoctorConfig
from ..files import jsonable
from ..measure.datascan import FieldScan
from ..measure.records import ExceptionInfo, Localisation, ScaleWindow
from ..measure.symptoms import Symptom, exception_of, first_step

SEVERITIES = ("error", "warning", "info")


@dataclass
class Fix:
    """What to change: a sentence, a code snippet for the permanent edit, and a config patch to try it now."""

    summary: str
    code: str = ""
    config_patch: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary, "code": self.code, "config_patch": self.config_patch}


@dataclass
class Verification:
    """What trying one fix measured (:meth:`fp16doctor.diagnosis.verify.Verifier.verify`): the intervention
    tried, the symptoms before and after, and the share removed. Untried: ``tried`` is None and ``reason``
    says why."""

    tried: str | None
    """The intervention in words; None when there was nothing to try."""
    symptoms_before: list[str]
    symptoms_after: list[str] | None
    """None when nothing was tried."""
    removed_share: float | None
    """The share of ``symptoms_before`` gone after; None when there was nothing to remove (or nothing tried)."""
    repaired: bool
    """Every measured symptom gone (and there was one)."""
    size: float = math.inf
    """How big a change it is (:meth:`fp16doctor.diagnosis.verify.Intervention.size`); ranks, never printed."""
    reason: str = ""
    """Untried: why there was nothing to try."""
    config_patch: dict[str, Any] = field(default_factory=dict)
    """Tried: the patch the probe ran with."""
    summary: str = ""
    """Tried: the probe's outcome in a sentence (:meth:`fp16doctor.diagnosis.verify.Outcome.summary`)."""
    amp_records: pd.DataFrame | None = field(default=None, repr=False)
    """Tried: the AMP probe's record with the fix applied (for the plots); not in the JSON."""

    def to_json(self) -> dict[str, Any]:
        """The documented shape: an untried record has ``reason`` and no ``config_patch``/``summary``."""
        if self.tried is None:
            return {
                "tried": None,
                "reason": self.reason,
                "symptoms_before": self.symptoms_before,
                "symptoms_after": self.symptoms_after,
                "removed_share": self.removed_share,
                "repaired": self.repaired,
            }
        return {
            "tried": self.tried,
            "config_patch": self.config_patch,
            "symptoms_before": self.symptoms_before,
            "symptoms_after": self.symptoms_after,
            "removed_share": self.removed_share,
            "repaired": self.repaired,
            "summary": self.summary,
        }


@dataclass
class CorrectedConfig:
    """The verified fixes' config patches together, checked once more (or the top fix's own verification when
    it alone repaired everything): what ``--fix-config`` writes and ``train`` runs."""

    config_patch: dict[str, Any]
    from_findings: list[str]
    """The causes whose patches it merges, in rank order."""
    symptoms_before: list[str]
    symptoms_after: list[str]
    summary: str
    needs_data_changes: list[str] = field(default_factory=list)
    """Error causes whose tried fix is a data change, which no config patch carries."""
    amp_records: pd.DataFrame | None = field(default=None, repr=False)
    """The AMP probe's record with the corrected config (the plots draw it); not in the JSON."""

    @property
    def healthy_after(self) -> bool:
        return not self.symptoms_after

    def to_json(self) -> dict[str, Any]:
        return {
            "config_patch": self.config_patch,
            "from_findings": self.from_findings,
            "symptoms_before": self.symptoms_before,
            "symptoms_after": self.symptoms_after,
            "healthy_after": self.healthy_after,
            "summary": self.summary,
            "needs_data_changes": self.needs_data_changes,
        }


@dataclass
class Finding:
    """One cause, with the measurements that point at it."""

    cause: str
    severity: str
    title: str
    evidence: dict[str, Any]
    fix: Fix
    confidence: float = 1.0
    """0..1: how directly the evidence shows the cause (ranking within the same severity and causal order)."""
    order: int = 0
    """Causal order of the cause (data before model before precision settings); set by the rule."""
    rank: int = 0
    verification: Verification | None = None
    """What trying the fix measured (:mod:`.verify`): tried, symptoms before/after, share removed."""
    demoted: bool = False
    """An error whose fix, tried, changed nothing: now a warning, and it explains no symptom."""
    needs_search: bool = False
    """The rule recognised the pattern but has no change to propose (no small set of modules in fp32 closes a
    precision gap): a warning that explains no symptom, so the intervention search looks for the repair, and the
    cause it names takes this finding's evidence (:func:`fp16doctor.diagnosis.engine.adopt_repair`)."""
    found_by: str = "rule"
    """``rule``: a rule matched the evidence; ``intervention``: the intervention search tried the doctor's
    interventions and this cause is named from the one that repaired the training (:mod:`.interventions`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "cause": self.cause,
            "severity": self.severity,
            "found_by": self.found_by,
            "title": self.title,
            "evidence": jsonable(self.evidence),
            "fix": self.fix.to_json(),
            "confidence": round(self.confidence, 3),
            "verification": jsonable(self.verification.to_json()) if self.verification else None,
        }


@dataclass
class Repair:
    """An intervention the search tried that removed the symptoms it was tried for: what the rules read to
    name the cause (:meth:`fp16doctor.diagnosis.rules.Rule.names_repair`)."""

    kind: str
    """What was changed (:data:`fp16doctor.diagnosis.interventions.KINDS`): ``fp32-modules``, ``loss-fp32``,
    ``fp32-weights``, ``scaler-scale``, ``scaler-growth``, ``lr-cap``, ``hold-scheduler``,
    ``unscale-before-clip``, ``drop-nonfinite-rows``, ``standardise``, ``drop-empty-targets``, ``bf16``."""
    description: str
    """The intervention in words, as the verification names it."""
    config_patch: dict[str, Any] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    """For ``fp32-modules``: the modules kept in fp32."""
    scope: str = ""
    """For ``fp32-modules``: ``module`` (the localised one), ``class`` (every module of its class), ``role`` (for a
    library module, the one in its place in every module of its parent's class: every FFN's ``wo``), ``parent``,
    ``relocalised`` (grown by localising again after a partial repair) or ``gap-set`` (the precision-gap search's)."""
    module_class: str | None = None
    """For a ``class`` scope: the class every kept module is an instance of."""
    symptoms: list[str] = field(default_factory=list)
    """The measured symptoms it removed."""
    forward_overflow: bool = False
    """Whether the AMP run's forward outputs of the kept modules left fp16's range (inf/NaN or past 65504)."""
    verification: Verification | None = None
    """The full probe's verification record (:meth:`fp16doctor.diagnosis.verify.Verifier.verify`)."""
    also: str = ""
    """What the repair changed besides its kind, in words (``an initial loss scale of 2048``): a partial repair
    that left only the loss scale's calibration skips, completed with the sweep's recommended scale."""


@dataclass
class StageReport:
    """One triage stage: ran or skipped (and why), and what it found in a sentence."""

    name: str
    status: str
    summary: str
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "summary": self.summary,
            "seconds": round(self.seconds, 2),
            "details": jsonable(self.details),
        }


@dataclass
class ProbeSummary:
    """A probe's record with the instruments' tables and what the step traces observed."""

    mode: str
    records: pd.DataFrame
    tables: dict[str, pd.DataFrame]
    precision: pd.DataFrame
    clip_calls: list[dict[str, Any]]
    loss_dtypes: list[str]
    first_nonfinite_forward: dict[str, Any] | None
    scaler_enabled: bool
    scaler_called: bool = True
    """Whether the training step called scaler.scale() (a hand-rolled loop may not)."""
    scaler_calls: list[list[str]] = field(default_factory=list)
    """Per iteration, the GradScaler calls the loop made, in order (``scale``, ``unscale_``, ``step``, ``update``)."""
    optimizer_calls: list[list[str]] = field(default_factory=list)
    """Per iteration, the GradScaler and optimizer calls naming the optimizer each acts on (``step(D)``, ``D.step()``)."""
    skips_by_optimizer: dict[str, int] = field(default_factory=dict)
    """Steps the scaler skipped, per optimizer (by the probe's name for it)."""

    @property
    def exception(self) -> ExceptionInfo | None:
        """The exception the training raised in this probe (it stopped there), or None."""
        return exception_of(self.records)

    def first_step(self, column: str) -> int | None:
        return first_step(self.records, self.records[column])

    @property
    def first_nonfinite_loss(self) -> int | None:
        return self.first_step("nonfinite_loss")

    @property
    def first_nonfinite_grads(self) -> int | None:
        return self.first_step("nonfinite_grads")

    @property
    def finite(self) -> bool:
        return self.first_nonfinite_loss is None and self.first_nonfinite_grads is None and self.exception is None

    @property
    def skip_steps(self) -> list[int]:
        """The steps whose optimizer step was skipped (a scaler's inf check); not a step that raised: that step ended
        the probe, and neither the optimizer nor the scheduler stepped on it."""
        rows = self.records
        skipped = rows["skipped"].astype(bool)
        if "exception_type" in rows:
            skipped &= rows["exception_type"].isna()
        return [int(s) for s in rows.loc[skipped, "step"]]


@dataclass
class LrSchedule:
    """The LR schedule's dry run: the rate per step, its peak and its largest jump (the ratio to the step before)."""

    lrs: list[float]
    peak_step: int
    peak_lr: float
    jump_step: int
    jump_ratio: float


@dataclass
class LrPause:
    """One step taken twice from the same snapshot: at the schedule's rate and at the rate of the step before
    (each with the step after it, where an update's damage shows)."""

    pause_step: int
    finite_at_peak: bool
    finite_before_peak: bool
    update_to_weight_at_peak: float
    update_to_weight_before_peak: float
    activation_max_at_peak: float
    activation_max_before_peak: float


@dataclass
class LrPeak:
    """What the LR-peak stage measured: the schedule, and the pause when there was trouble to pause at."""

    schedule: LrSchedule
    pause: LrPause | None = None

    def to_json(self) -> dict[str, Any]:
        """The stage's documented details: one flat object of the schedule's fields and, once paused, the pause's."""
        return {**asdict(self.schedule), **(asdict(self.pause) if self.pause is not None else {})}


@dataclass
class ModuleGap:
    """One module's share of a same-state gap: the relative error its output adds over its input's, AMP
    against fp32 on the same weights and batch."""

    module: str
    added_error: float
    output_error: float
    input_error: float

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "added_error": self.added_error,
            "output_error": self.output_error,
            "input_error": self.input_error,
        }


@dataclass
class GapTrial:
    """One fp32 module set the search tried, and the same-state gap left with it."""

    fp32_modules: list[str]
    gap: float

    def to_json(self) -> dict[str, Any]:
        return {"fp32_modules": self.fp32_modules, "gap": self.gap}


@dataclass
class GapSearch:
    """What the precision-gap stage measured: AMP against fp32 from the same states, and (past tolerance) the
    modules ranked by the error they add and the smallest fp32 set that closes the gap."""

    same_state_rel_dev: dict[int, float]
    """Per FP32 trajectory step compared, AMP's relative loss deviation from fp32's."""
    worst_step: int
    gap: float
    """The largest deviation (at ``worst_step``)."""
    tolerance: float
    gap_without_loss_scaling: float | None = None
    """The gap again with the GradScaler off (measured when the gap is past tolerance under fp16 scaling)."""
    scale_leak: bool = False
    """The gap closes with scaling off: the loss scale leaks into the loss (scaler misuse, not precision)."""
    ranked_modules: list[ModuleGap] | None = None
    """The searched modules, the largest added error first (at most eight); None when no search ran."""
    closing_set: list[str] | None = None
    """The smallest set kept in fp32 that brings the gap within tolerance; None when none did (or no search)."""
    closed_gap: float | None = None
    tried: list[GapTrial] | None = None
    """The module sets tried, in order; None when no search ran."""
    absorbed_overflow: Localisation | None = None
    """The first forward operator of AMP's step at ``worst_step`` that made a result past fp16's range which no
    module output shows (an infinity divided away: ``x / inf = 0``): the gap is then range, not rounding. None when
    the traced step made none (or no search ran)."""

    @property
    def exceeded(self) -> bool:
        """The gap is past tolerance."""
        return self.gap > self.tolerance

    def to_json(self) -> dict[str, Any]:
        """The stage's documented details: the measured gap, then what each later part of the stage found (a part
        that did not run leaves its keys out)."""
        out: dict[str, Any] = {
            "same_state_rel_dev": self.same_state_rel_dev,
            "worst_step": self.worst_step,
            "gap": self.gap,
            "tolerance": self.tolerance,
        }
        if self.gap_without_loss_scaling is not None:
            out["gap_without_loss_scaling"] = self.gap_without_loss_scaling
        if self.scale_leak:
            out["scale_leak"] = True
        if self.ranked_modules is not None:
            out["ranked_modules"] = [m.to_json() for m in self.ranked_modules]
        if self.tried is not None:
            out.update(
                {
                    "closing_set": self.closing_set,
                    "closed_gap": self.closed_gap,
                    "tried": [t.to_json() for t in self.tried],
                }
            )
        if self.absorbed_overflow is not None:
            out["absorbed_overflow"] = self.absorbed_overflow.to_json()
        return out


@dataclass
class Evidence:
    """Everything the stages measured; rules read it, nothing else."""

    config: DoctorConfig
    device: str
    steps: int
    has_scheduler: bool
    has_train_step: bool
    uses_default_loss: bool = False
    """The probes computed the doctor's default loss: the file defines neither ``loss()`` nor ``train_step()``."""
    near_misses: dict[str, dict[str, str]] = field(default_factory=dict)
    """The file's callables named like a contract function it lacks (``loss_fn`` for ``loss``), by that name,
    with their signatures (:attr:`fp16doctor.userfile.spec.TrainingSpec.near_misses`): ignored by the loader."""
    recorded_loss_finding: str | None = None
    """A capsule's: its watch saw a finite loss whose gradient w.r.t. the model's outputs was non-finite, or a
    non-finite loss, made in the loss computation that the capsule does not
    hold (its replay counts those entries as 0)."""
    data: list[FieldScan] = field(default_factory=list)
    fp32: ProbeSummary | None = None
    amp: ProbeSummary | None = None
    bf16: ProbeSummary | None = None
    localisation: Localisation | None = None
    localisation_deterministic: bool | None = None
    fp32_localisation: Localisation | None = None
    window: ScaleWindow | None = None
    """The loss scales that keep FP32's gradients representable in fp16 (the loss-scale stage)."""
    predicted_underflow: pd.DataFrame | None = None
    observed_underflow: pd.DataFrame | None = None
    sweep: pd.DataFrame | None = None
    recommended_scaler: dict[str, Any] | None = None
    lr_peak: LrPeak | None = None
    gap: GapSearch | None = None
    bf16_supported: bool = True
    symptoms: list[Symptom] = field(default_factory=list)
    """The measured symptoms (:class:`fp16doctor.measure.symptoms.Symptom`) of the AMP probe against FP32."""
    explained: dict[str, list[str]] = field(default_factory=dict)
    """Per symptom code, the causes whose error findings explain it (empty: the ``unexplained`` finding)."""


@dataclass
class UnexplainedException:
    """An exception a probe raised that no finding accounts for: the report says to fix the code there."""

    probe: str
    """The probe's mode (``fp32``, ``amp``)."""
    exception: ExceptionInfo

    def to_json(self) -> dict[str, Any]:
        return {"probe": self.probe, "exception": self.exception.to_json()}


@dataclass
class Diagnosis:
    """The ranked findings, the stages, and the evidence behind them."""

    findings: list[Finding]
    stages: list[StageReport]
    evidence: Evidence
    notes: list[str] = field(default_factory=list)
    """How the doctor ran the training file (e.g. a torch.compile'd model run uncompiled)."""
    corrected: CorrectedConfig | None = None
    """The verified fixes' config patches together, checked once more: patch, symptoms before and after."""

    @property
    def unexplained(self) -> list[UnexplainedException]:
        """Exceptions the training raised in a probe that no finding accounts for (never "healthy")."""
        explained = {
            json_key(f.evidence.get("exception"))
            for f in self.findings
            if f.evidence.get("exception") and (f.cause != "unexplained" or f.found_by == "intervention")
        }
        out = []
        for summary in (self.evidence.fp32, self.evidence.amp):
            if summary is not None and summary.exception is not None and json_key(summary.exception) not in explained:
                out.append(UnexplainedException(summary.mode, summary.exception))
        return out

    @property
    def healthy(self) -> bool:
        return not any(f.severity == "error" for f in self.findings) and not self.unexplained

    @property
    def verdict(self) -> str:
        return "healthy" if self.healthy else "unhealthy"

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "findings": [f.to_json() for f in self.findings],
            "stages": [s.to_json() for s in self.stages],
            "unexplained": jsonable(self.unexplained),
            "symptoms": [
                jsonable(dict(s.to_json(), explained_by=self.evidence.explained.get(s.code, [])))
                for s in self.evidence.symptoms
            ],
            "notes": self.notes,
            "corrected": jsonable(self.corrected.to_json()) if self.corrected is not None else None,
        }


def json_key(value: Any) -> str:
    return json.dumps(jsonable(value), sort_keys=True)
