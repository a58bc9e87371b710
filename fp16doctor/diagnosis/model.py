"""The diagnosis as data: evidence in, findings out. Rendering lives elsewhere."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

import pandas as pd

from ..config import DoctorConfig
from ..measure.datascan import FieldScan
from ..measure.records import ExceptionInfo, Localisation
from ..measure.symptoms import exception_of, first_step

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
    verification: dict[str, Any] | None = None
    """What trying the fix measured (:mod:`.verify`): tried, symptoms before/after, share removed."""
    demoted: bool = False
    """An error whose fix, tried, changed nothing: now a warning, and it explains no symptom."""
    found_by: str = "rule"
    """``rule``: a rule matched the evidence; ``intervention``: the intervention search tried the doctor's
    interventions and this cause is named from the one that repaired the training (:mod:`.interventions`)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "cause": self.cause, "severity": self.severity, "found_by": self.found_by, "title": self.title,
            "evidence": jsonable(self.evidence), "fix": self.fix.to_json(), "confidence": round(self.confidence, 3),
            "verification": jsonable({k: v for k, v in public(self.verification).items() if k != "size"}) if self.verification else None,
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
    """For ``fp32-modules``: ``module`` (the localised one), ``class`` (every module of its class), ``parent``,
    ``relocalised`` (grown by localising again after a partial repair) or ``gap-set`` (the precision-gap search's)."""
    module_class: str | None = None
    """For a ``class`` scope: the class every kept module is an instance of."""
    symptoms: list[str] = field(default_factory=list)
    """The measured symptoms it removed."""
    forward_overflow: bool = False
    """Whether the AMP run's forward outputs of the kept modules left fp16's range (inf/NaN or past 65504)."""
    verification: dict[str, Any] | None = None
    """The full probe's verification record (:meth:`fp16doctor.diagnosis.verify.Verifier.verify`)."""


@dataclass
class StageReport:
    """One triage stage: ran or skipped (and why), and what it found in a sentence."""

    name: str
    status: str
    summary: str
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary,
                "seconds": round(self.seconds, 2), "details": jsonable(self.details)}


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
        return [int(s) for s in self.records.loc[self.records["skipped"].astype(bool), "step"]]


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
class Evidence:
    """Everything the stages measured; rules read it, nothing else."""

    config: DoctorConfig
    device: str
    steps: int
    has_scheduler: bool
    has_train_step: bool
    data: list[FieldScan] = field(default_factory=list)
    fp32: ProbeSummary | None = None
    amp: ProbeSummary | None = None
    bf16: ProbeSummary | None = None
    localisation: Localisation | None = None
    localisation_deterministic: bool | None = None
    fp32_localisation: Localisation | None = None
    window: Any = None
    predicted_underflow: pd.DataFrame | None = None
    observed_underflow: pd.DataFrame | None = None
    sweep: pd.DataFrame | None = None
    recommended_scaler: dict[str, Any] | None = None
    lr_peak: LrPeak | None = None
    gap: dict[str, Any] | None = None
    bf16_supported: bool = True
    symptoms: list[Any] = field(default_factory=list)
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
    corrected: dict[str, Any] | None = None
    """The verified fixes' config patches together, checked once more: patch, symptoms before and after."""

    @property
    def unexplained(self) -> list[UnexplainedException]:
        """Exceptions the training raised in a probe that no finding accounts for (never "healthy")."""
        explained = {json_key(f.evidence.get("exception")) for f in self.findings
                     if f.evidence.get("exception") and (f.cause != "unexplained" or f.found_by == "intervention")}
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
            "symptoms": [jsonable(dict(s.to_json(), explained_by=self.evidence.explained.get(s.code, [])))
                         for s in self.evidence.symptoms],
            "notes": self.notes,
            "corrected": jsonable(public(self.corrected)),
        }


def public(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """A record without its private entries (``_``-prefixed: data kept for plots, not for JSON)."""
    return None if record is None else {k: v for k, v in record.items() if not k.startswith("_")}


def json_key(value: Any) -> str:
    return json.dumps(jsonable(value), sort_keys=True)


def jsonable(value: Any) -> Any:
    """Plain JSON types only; non-finite floats become strings ("inf", "nan") in evidence."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if is_dataclass(value) and not isinstance(value, type) and hasattr(value, "to_json"):
        return jsonable(value.to_json())  # a record inside evidence: its own documented shape
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            return str(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
    return str(value)
