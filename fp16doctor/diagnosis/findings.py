"""The diagnosis as data: the measured evidence in, immutable findings out. Rendering lives in ``output``.

The codes a report prints and a JSON reader compares (severity, stage status and name, repair kind) are
enums whose members are their strings: ``Severity.ERROR == "error"`` and they serialise as the string.
A rule's evidence is a frozen :class:`EvidenceRecord` of its own, declared in the rule's file; its fields are
the keys of the finding's ``evidence`` object in the JSON (:func:`evidence_json`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from typing import Any, TypeVar

import pandas as pd

from ..config import DoctorConfig
from ..engine.emulated_ranks import ReductionReading
from ..engine.records import Column
from ..files import jsonable
from ..measure.datascan import FieldScan
from ..measure.graph_nodes import TracedNode
from ..measure.records import OMITTED_WHEN_NONE, ExceptionInfo, Localisation, OperatorAttribution, ScaleWindow
from ..measure.symptoms import Symptom, exception_of, first_step


class Code(str, Enum):
    """A stable code: equal to its string, printed and serialised as it (``f"{Severity.ERROR}"`` is ``error``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Severity(Code):
    """How a finding weighs, most severe first (the ranking's first key)."""

    ERROR = "error"
    """A cause of a measured symptom: never healthy."""
    WARNING = "warning"
    """A pattern that can lead to trouble, with no measured symptom it explains (or a fix that changed nothing)."""
    INFO = "info"
    """Advice (bf16 where the hardware has it)."""


SEVERITIES: tuple[Severity, ...] = tuple(Severity)
"""Most severe first."""


class StageStatus(Code):
    RAN = "ran"
    SKIPPED = "skipped"
    """Not run, and the stage's summary says why (nothing to measure, out of memory)."""


class StageName(Code):
    """The triage's stages, in order, as the report and the progress display name them."""

    DATA = "data scan"
    FP32 = "fp32 baseline"
    AMP = "amp as configured"
    LOCALISATION = "localisation"
    LOSS_SCALE = "loss-scale sweep"
    LR_PEAK = "LR schedule peak"
    PRECISION_GAP = "precision-gap search"
    BF16 = "bf16 check"
    COMPILED = "compiled"
    PARALLEL = "parallel"
    VERIFYING = "verifying fixes"
    """What the progress display shows while the fixes are tried (the report names it ``fix verification``)."""
    FIX_VERIFICATION = "fix verification"
    INTERVENTION_SEARCH = "intervention search"


class RepairKind(Code):
    """What an intervention of the search changes (a :class:`Repair`'s ``kind``)."""

    FP32_MODULES = "fp32-modules"
    LOSS_FP32 = "loss-fp32"
    FP32_WEIGHTS = "fp32-weights"
    SCALER_SCALE = "scaler-scale"
    SCALER_GROWTH = "scaler-growth"
    LR_CAP = "lr-cap"
    LR_LOWER = "lr-lower"
    HOLD_SCHEDULER = "hold-scheduler"
    UNSCALE_BEFORE_CLIP = "unscale-before-clip"
    DROP_NONFINITE_ROWS = "drop-nonfinite-rows"
    DROP_EXTREME_ROWS = "drop-extreme-rows"
    STANDARDISE = "standardise"
    LOSS_FP64 = "loss-fp64"
    DROP_EMPTY_TARGETS = "drop-empty-targets"
    BF16 = "bf16"


class FoundBy(Code):
    RULE = "rule"
    """A rule matched the evidence."""
    INTERVENTION = "intervention"
    """The intervention search tried the doctor's interventions and this cause is named from the one that repaired
    the training."""


_OMITTED_WHEN_NONE = OMITTED_WHEN_NONE


def omitted_when_none(default: Any = None) -> Any:
    """An evidence field whose key the JSON leaves out while it is None (a measurement that did not apply);
    a plain field keeps its key, ``null`` included."""
    return field(default=default, metadata={_OMITTED_WHEN_NONE: True})


@dataclass(frozen=True)
class EvidenceRecord:
    """A finding's evidence: what was measured that points at its cause. Subclasses are frozen dataclasses
    declared in their rule's file; each field is a key of the finding's JSON ``evidence`` object."""

    def to_json(self) -> dict[str, Any]:
        return evidence_json(self)


def evidence_json(record: EvidenceRecord) -> dict[str, Any]:
    """The one serialiser of evidence: field by field, in declaration order, as plain JSON values (a record
    inside, a :class:`~fp16doctor.measure.records.Localisation` say, in its own documented shape)."""
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.metadata.get(_OMITTED_WHEN_NONE):
            continue
        out[f.name] = jsonable(value)
    return out


E = TypeVar("E", bound=EvidenceRecord)


def evidence_of(finding: Finding, kind: type[E]) -> E:
    """A finding's evidence as the record its rule made (a rule reading back its own finding)."""
    if not isinstance(finding.evidence, kind):
        raise TypeError(f"{finding.cause}: evidence is {type(finding.evidence).__name__}, not {kind.__name__}")
    return finding.evidence


@dataclass(frozen=True)
class LocalisedAt(EvidenceRecord):
    """Where the localisation found the first non-finite value, as a finding's evidence repeats it."""

    module: str | None
    operator: str
    phase: str
    step: int
    batch: int

    @classmethod
    def of(cls, loc: Localisation) -> LocalisedAt:
        return cls(loc.module, loc.operator, loc.phase, loc.step, loc.batch_index)


@dataclass(frozen=True)
class LocalisedOutputAt(LocalisedAt):
    """The localisation with the culprit's output range (a repair's evidence)."""

    output: Any = None

    @classmethod
    def of(cls, loc: Localisation) -> LocalisedOutputAt:
        return cls(loc.module, loc.operator, loc.phase, loc.step, loc.batch_index, loc.output)


@dataclass(frozen=True)
class RepairEvidence(EvidenceRecord):
    """A cause named from what the intervention search repaired: the intervention and what it removed."""

    intervention: str
    symptoms_removed: list[str]
    fp32_modules: list[str] | None = omitted_when_none()
    """The modules kept in fp32, for a module repair."""
    exception: ExceptionInfo | None = omitted_when_none()
    """AMP's exception, where the repair removed it (the finding then accounts for it)."""
    localisation: LocalisedOutputAt | None = omitted_when_none()


@dataclass(frozen=True)
class Fix:
    """What to change: a sentence, a code snippet for the permanent edit, and a config patch to try it now."""

    summary: str
    """The fix in a sentence."""
    code: str = ""
    """A code snippet for the permanent edit (empty when there is none)."""
    config_patch: dict[str, Any] = field(default_factory=dict)
    """Config keys, nested as in the config, that make the fix in the doctor's loop at once (``--config``); empty when no setting can make it (data, code)."""

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
    """The symptom codes measured before the fix."""
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
    """The verified fixes' config patches merged, each list whole (the config's own items, then the fixes')."""
    from_findings: list[str]
    """The causes whose patches it merges, in rank order."""
    symptoms_before: list[str]
    """The symptom codes measured before the fixes."""
    symptoms_after: list[str]
    """The symptom codes measured with the corrected config."""
    summary: str
    """What the corrected config measured, in a sentence."""
    needs_data_changes: list[str] = field(default_factory=list)
    """Error causes whose tried fix is a data change, which no config patch carries."""
    needs_code_changes: list[str] = field(default_factory=list)
    """Where the training runs on ranks (``--nproc``): error causes whose fix changes the training's code (the
    policy in ``parallelize()``), which no config patch carries."""
    ranks_not_rerun: bool = False
    """The training runs on ranks (``--nproc``) and the corrected config could not be run on them (``ranks_summary``
    says why): measured in one process only."""
    ranks_symptoms_after: list[str] | None = None
    """Where the training runs on ranks: the symptoms its ranks show with the corrected config and the code changes
    ``needs_code_changes`` names for the ranks (a reduction in fp32); None where not measured there."""
    ranks_summary: str | None = None
    """What the ranks measured with it, in words."""
    amp_records: pd.DataFrame | None = field(default=None, repr=False)
    """The AMP probe's record with the corrected config (the plots draw it); not in the JSON."""

    @property
    def healthy_after(self) -> bool:
        """No symptom is left with the corrected config (on the ranks too, where they were measured)."""
        return not self.symptoms_after and not self.ranks_symptoms_after

    def to_json(self) -> dict[str, Any]:
        return {
            "config_patch": self.config_patch,
            "from_findings": self.from_findings,
            "symptoms_before": self.symptoms_before,
            "symptoms_after": self.symptoms_after,
            "healthy_after": self.healthy_after,
            "summary": self.summary,
            "needs_data_changes": self.needs_data_changes,
            "needs_code_changes": self.needs_code_changes,
            "ranks_not_rerun": self.ranks_not_rerun,
            "ranks_symptoms_after": self.ranks_symptoms_after,
            "ranks_summary": self.ranks_summary,
        }

    @property
    def caveats(self) -> str:
        """What the corrected config alone does not cover, as a clause (empty: nothing)."""
        parts = []
        if self.needs_data_changes:
            parts.append(f"also needs data changes: {', '.join(self.needs_data_changes)}")
        if self.needs_code_changes:
            parts.append(f"also needs code changes: {', '.join(self.needs_code_changes)}")
        if self.ranks_summary and (self.ranks_symptoms_after or self.ranks_not_rerun):
            parts.append(self.ranks_summary)
        return "; ".join(parts)


@dataclass(frozen=True)
class Finding:
    """One cause, with the measurements that point at it. Immutable: the triage's steps (tying symptoms,
    verifying, demoting, ranking) each return new findings (:func:`dataclasses.replace`)."""

    cause: str
    """The cause code (the causes reference lists them)."""
    severity: Severity
    title: str
    """The finding in a sentence, as the report heads it."""
    evidence: EvidenceRecord
    """The rule's own record of what was measured (the JSON ``evidence``, with ``symptoms``)."""
    fix: Fix
    """What to change, and the config patch that tries it."""
    confidence: float = 1.0
    """0..1: how directly the evidence shows the cause (ranking within the same severity and causal order)."""
    order: int = 0
    """Causal order of the cause (data before model before precision settings); set by the rule."""
    rank: int = 0
    """1 for the top cause, then in rank order."""
    verification: Verification | None = None
    """What trying the fix measured (:mod:`.verify`): tried, symptoms before/after, share removed."""
    demoted: bool = False
    """An error whose fix, tried, changed nothing: now a warning, and it explains no symptom."""
    needs_search: bool = False
    """The rule recognised the pattern but has no change to propose (no small set of modules in fp32 closes a
    precision gap): a warning that explains no symptom, so the intervention search looks for the repair, and the
    cause it names takes this finding's evidence (:func:`fp16doctor.diagnosis.triage.adopt_repair`)."""
    found_by: FoundBy = FoundBy.RULE
    symptoms: tuple[str, ...] | None = None
    """The measured symptoms (codes) this finding explains, once the triage tied them (the JSON evidence's
    ``symptoms``); None before, and for a finding that explains none."""
    adopted: tuple[EvidenceRecord, ...] = ()
    """The evidence of a rule's findings of the same cause that this one (named by the intervention search) took
    over, the first adopted first: its own evidence wins a shared key, then the earlier adopted."""

    def evidence_json(self) -> dict[str, Any]:
        """The JSON ``evidence`` object: the adopted records' keys under the finding's own, then ``symptoms``."""
        out: dict[str, Any] = {}
        for record in (*reversed(self.adopted), self.evidence):
            out.update(record.to_json())
        if self.symptoms is not None:
            out["symptoms"] = list(self.symptoms)
        return out

    def evidence_records(self) -> Iterable[EvidenceRecord]:
        return (self.evidence, *self.adopted)

    @property
    def exception(self) -> ExceptionInfo | None:
        """The probe exception this finding accounts for (in its own or an adopted evidence), or None."""
        for record in self.evidence_records():
            exc = getattr(record, "exception", None)
            if isinstance(exc, ExceptionInfo):
                return exc
        return None

    def with_symptom(self, code: str) -> Finding:
        return replace(self, symptoms=(*(self.symptoms or ()), code))

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "cause": self.cause,
            "severity": self.severity,
            "found_by": self.found_by,
            "title": self.title,
            "evidence": jsonable(self.evidence_json()),
            "fix": self.fix.to_json(),
            "confidence": round(self.confidence, 3),
            "verification": jsonable(self.verification.to_json()) if self.verification else None,
        }


@dataclass
class Repair:
    """An intervention the search tried that removed the symptoms it was tried for: what the rules read to
    name the cause (:meth:`fp16doctor.diagnosis.rules.Rule.names_repair`)."""

    kind: RepairKind
    """What was changed."""
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


@dataclass(frozen=True)
class StageReport:
    """One triage stage: ran or skipped (and why), and what it found in a sentence."""

    name: StageName
    status: StageStatus
    summary: str
    """What the stage found, or why it was skipped, in a sentence."""
    seconds: float = 0.0
    """The stage's wall time, to 0.01 s in the JSON."""
    details: dict[str, Any] = field(default_factory=dict)
    """The stage's own measurements."""

    def timed(self, seconds: float) -> StageReport:
        return replace(self, seconds=seconds)

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
    emulated_reduction: ReductionReading | None = None
    """What the emulated ranks' gradient reductions did (``config.sharding``, a sharded run's capsule); None where
    no rank was emulated."""

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
        skipped = rows[Column.SKIPPED].astype(bool)
        if "exception_type" in rows:
            skipped &= rows[Column.EXCEPTION_TYPE].isna()
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
class LrTrajectory:
    """The trouble a schedule event is tied to: one probe's gradient norm and loss per step, from before the event
    (or before the growth, where it began earlier) up to that probe's first non-finite step."""

    mode: str
    """The probe whose trouble it is (``amp``, else ``fp32``)."""
    event_step: int
    """The schedule's peak or jump the trouble follows."""
    trouble_step: int
    """The probe's first step it did not survive (a non-finite loss or update, or the skip that tells the fault)."""
    growth_step: int | None
    """The first step of the growth that runs up to ``trouble_step`` (each step's value above the one before, by
    ``growth`` in all); None where neither the gradient norm nor the loss grew that much."""
    growth: float
    """How many times the growing quantity's last value before the trouble is its value before the growth."""
    growing: str | None
    """Which quantity grew: ``grad_norm`` or ``loss`` (None: neither)."""
    steps: list[int]
    """The steps the two lists below cover: from before the event (or the growth) to ``trouble_step``."""
    grad_norms: list[float]
    losses: list[float]


@dataclass
class LrPause:
    """The steps from the schedule's event to the trouble (two at least: an update's damage shows in the next
    forward), taken twice from the same state: at the schedule's rate, and with the rate capped (at the rate of the
    step before the event; where the growth began during the climb to a peak and that cap does not hold, at half
    of it, a quarter, down to a sixteenth, from the first step whose rate passes the cap to the probe's end)."""

    pause_step: int
    finite_at_peak: bool
    finite_before_peak: bool
    """The capped steps stayed finite."""
    update_to_weight_at_peak: float
    update_to_weight_before_peak: float
    activation_max_at_peak: float
    activation_max_before_peak: float
    lr_cap: float | None = None
    """The cap of the capped steps (None: the rate of the step before ``pause_step``)."""
    capped_from: int | None = None
    """The step the capped steps start at: the first whose rate passes the cap (None: ``pause_step``)."""
    paused_steps: int = 2
    """How many steps each of the two takes."""
    mode: str = "amp"
    """The probe they are taken in."""


@dataclass
class LrPeak:
    """What the LR-peak stage measured: the schedule, the trajectory its trouble grew along, and the pause when
    there was trouble to pause at."""

    schedule: LrSchedule
    pause: LrPause | None = None
    trajectory: LrTrajectory | None = None

    def to_json(self) -> dict[str, Any]:
        """The stage's documented details: one flat object of the schedule's fields and, once paused, the pause's,
        with the trajectory under ``trajectory``."""
        out = {**asdict(self.schedule), **(asdict(self.pause) if self.pause is not None else {})}
        if self.trajectory is not None:
            out["trajectory"] = asdict(self.trajectory)
        return out


class CompiledOutcome(Code):
    """How the compiled training's AMP probe compares with the eager one (stage ``compiled``)."""

    AGREE = "agree"
    """Both healthy, or both unhealthy: the diagnosis stands for both."""
    EAGER_ONLY = "eager-only"
    """Only eager fails: the compiled training, as it runs, is healthy (the compiler's fp32 registers remove it)."""
    COMPILED_ONLY = "compiled-only"
    """Only the compiled training fails or drifts: ``compiled-divergence``."""


@dataclass(frozen=True)
class BackendTrial:
    """The compiled AMP probe with one backend (or setting) instead of the training's."""

    backend: str
    """``eager`` (dynamo's graph, run eagerly), ``aot_eager`` (and AOT autograd's), ``inductor``, or a setting."""
    symptoms: list[str]
    """The symptom codes it measured against FP32 (empty: healthy)."""
    config_patch: dict[str, Any] = field(default_factory=dict)
    """The config patch it ran with."""
    parameter_share: float | None = None
    """For a region run eagerly: the share of the model's parameters it holds (None for a backend or a setting)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "symptoms": self.symptoms,
            "config_patch": self.config_patch,
            "parameter_share": self.parameter_share,
        }


@dataclass(frozen=True)
class CompilerBisection:
    """What PyTorch's compiler bisector (``torch._inductor.compiler_bisector``) found, running the compiled AMP probe
    again and again: the backend that makes the fault, then the subsystem (a group of passes, a setting, the
    lowerings), then how many of its applications it takes."""

    backend: str | None
    """The first backend of ``eager``, ``aot_eager``, ``aot_eager_decomp_partition``, ``inductor`` that fails; None
    where the bisector found every one healthy (the fault did not recur)."""
    subsystem: str | None = None
    """Within it: ``lowerings``, ``post_grad_passes``, a setting such as ``emulate_precision_casts`` ...; None where
    it could not tell."""
    application: int | None = None
    """The subsystem's application that makes the fault (its n-th lowering, its n-th pass); None for a setting."""
    applied_to: str | None = None
    """What that application worked on: the graph node a lowering lowered (its name, ``rsqrt_1``), or the pass."""
    operator: str | None = None
    """For a lowering, its ATen operator where the node's name says it (``aten.rsqrt``)."""
    runs: int = 0
    """The compiled probes the bisection ran."""
    seconds: float = 0.0
    not_run: str | None = None
    """Why no bisection ran (this torch has no bisector, the bisector's own error); None where it ran."""

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "subsystem": self.subsystem,
            "application": self.application,
            "applied_to": self.applied_to,
            "operator": self.operator,
            "runs": self.runs,
            "seconds": round(self.seconds, 2),
            "not_run": self.not_run,
        }


@dataclass
class CompiledComparison:
    """What the compiled stage measured: the compiled AMP probe beside the eager one, against the same FP32."""

    compiled_with: dict[str, Any]
    """How model() compiles (backend, mode, dynamic, fullgraph, options) as torch.compile was called."""
    outcome: CompiledOutcome
    eager_symptoms: list[Symptom]
    compiled_symptoms: list[Symptom]
    compiled: ProbeSummary
    """The compiled probe's records (no instruments: a compiled graph hides the modules)."""
    probe_seconds: float
    """The compiled probe's wall time, its compilation included."""
    compile_seconds: float
    """Its first step's time beyond the median of the others: what compiling the forward and backward took."""
    backends: list[BackendTrial] = field(default_factory=list)
    """Only the compiled training fails: the backends tried, from the least compiled up, to localise the fault."""
    bisection: CompilerBisection | None = None
    """Only inductor fails (``aot_eager`` healthy): where in inductor, by PyTorch's compiler bisector."""
    graph_trace: GraphTraceReport | None = None
    """Only a custom backend's program makes a non-finite value: the first node of its graph that makes one."""

    def to_json(self) -> dict[str, Any]:
        return {
            "compiled_with": self.compiled_with,
            "outcome": str(self.outcome),
            "eager_symptoms": [s.code for s in self.eager_symptoms],
            "compiled_symptoms": [s.code for s in self.compiled_symptoms],
            "probe_seconds": round(self.probe_seconds, 2),
            "compile_seconds": round(self.compile_seconds, 2),
            "backends": [b.to_json() for b in self.backends],
            "bisection": self.bisection.to_json() if self.bisection is not None else None,
            "graph_trace": self.graph_trace.to_json() if self.graph_trace is not None else None,
        }


@dataclass(frozen=True)
class GraphTraceReport:
    """The custom backend's graphs run node by node on the compiled probe's steps (:mod:`fp16doctor.measure.graph_nodes`)."""

    first_nonfinite: TracedNode | None
    """The first node that made an inf or NaN out of finite values; None: none did (or nothing could be traced)."""
    opaque: list[str] = field(default_factory=list)
    """What the backend returned that is not an FX graph, by type: those programs could not be looked into."""
    failed: str | None = None
    """The trace's own failure (its exception, in a line); None: it ran."""
    first_difference: TracedNode | None = None
    """The first node whose output differs from dynamo's graph run eagerly on the same values, on a graph's first
    call (where the backend drifts without an inf or NaN); None: every compared node agreed, or none was compared."""

    def to_json(self) -> dict[str, Any]:
        return {
            "first_nonfinite": self.first_nonfinite.to_json() if self.first_nonfinite is not None else None,
            "first_difference": self.first_difference.to_json() if self.first_difference is not None else None,
            "opaque": self.opaque,
            "failed": self.failed,
        }


HALF_DTYPES = ("float16", "bfloat16")

REDUCTION_ERROR_WORTH_SAYING = 1e-2
"""A reduction whose result is further than this from the same reduction in fp32 (relative, in a parameter's
gradient) loses more than rounding does: fp16's own rounding of a gradient is 2^-11 (about 5e-4)."""


@dataclass(frozen=True)
class ReductionAtWorld:
    """The as-run reduction's worst parameter at one world size: the reduction's growth with the ranks."""

    world: int
    parameter: str = ""
    """The parameter whose reduced gradient strays furthest from the fp32 reduction at this world size."""
    module: str = ""
    relative_error: float = 0.0
    """Its worst step's relative error against the fp32 reduction (inf: the reduction made an inf or NaN)."""
    nonfinite_steps: int = 0
    local_max: float = 0.0
    """The largest |local gradient| a rank handed to the reduction (scaled, as reduced)."""
    not_measured: str | None = None
    """Why this world size was not measured (the machine, or the run's own error); None where it was."""

    @classmethod
    def of(cls, world: int, worst: pd.Series) -> ReductionAtWorld:
        return cls(
            world,
            str(worst["name"]),
            str(worst["module"]),
            float(worst["relative_error"]),
            int(worst["nonfinite_steps"]),
            float(worst["local_max"]),
        )

    def to_json(self) -> dict[str, Any]:
        if self.not_measured is not None:
            return {"not_measured": self.not_measured}
        return {
            "parameter": self.parameter,
            "module": self.module,
            "relative_error": _plain(self.relative_error),
            "nonfinite_steps": self.nonfinite_steps,
            "local_max": self.local_max,
        }


@dataclass
class ParallelComparison:
    """What the parallel stage measured under torchrun: the training as it runs parallelised (``as_run``), the same
    with its gradient reduction made in fp32 (``fp32_reduce``), both against the FP32 baseline in that topology."""

    world: int
    topology: str
    """The class of what ``parallelize()`` returns (``DistributedDataParallel`` by default)."""
    parallelized_by: str
    """``parallelize()`` (the training file's), or ``DistributedDataParallel`` (the doctor's default)."""
    hooks: list[str]
    """The communication hooks the training registers (empty: DDP's default all-reduce, in the gradients' dtype)."""
    policy: dict[str, Any] | None
    """FSDP's mixed-precision policy, its dtypes by name (``reduce_dtype``: "float16"); None for DDP."""
    symptoms: list[Symptom]
    """What the parallel AMP training, as it runs, measured against the parallel FP32 baseline."""
    repaired_symptoms: list[Symptom]
    """The same with the reduction made in fp32."""
    single_process_symptoms: list[str]
    """What the single-process triage measured (the codes): a fault there too shows everywhere."""
    reduction: pd.DataFrame
    """Per parameter of the as-run pass: ``name``, ``module``, ``numel``, ``relative_error`` (the worst step's
    ‖reduced − fp32 reduced‖ / ‖fp32 reduced‖; inf where it made an inf or NaN), ``nonfinite_steps``,
    ``first_nonfinite_step`` and ``local_max`` (the largest |local gradient| handed to it, scaled as reduced).
    Empty where the topology's reduction is not measured (FSDP1's flat parameters)."""
    ranks_agree: bool
    """Every rank ended every pass with the same parameters (sum and absolute sum), loss scale and skips."""
    records: dict[str, pd.DataFrame] = field(default_factory=dict)
    """The passes' step records (``fp32``, ``as_run``, ``fp32_reduce``; rank 0's, the loss averaged over ranks)."""
    seconds: float = 0.0
    scaler_enabled: bool | None = None
    """Whether the parallel AMP pass scaled its loss (the doctor's GradScaler: fp16 with ``scaler.enabled``)."""
    growth: dict[int, ReductionAtWorld] = field(default_factory=dict)
    """The as-run reduction's worst parameter per world size: ``world``'s own and the other of 2 and 4, where the
    reduction is in half precision and the machine runs that many ranks."""
    loss_dtypes: list[str] = field(default_factory=list)
    """The dtypes the as-run pass's loss came out in (empty: not recorded): a loss in fp32 was computed from
    outputs it cast up."""

    @property
    def half_precision_reduction(self) -> str | None:
        """What makes the reduction in half precision, in words: a compression hook, FSDP's ``reduce_dtype``, or
        its ``param_dtype`` where ``reduce_dtype`` is unset (FSDP then reduces the gradients in their dtype)."""
        half = [h for h in self.hooks if "fp16" in h or "bf16" in h]
        if half:
            return " and ".join(half)
        policy = self.policy or {}
        if policy.get("reduce_dtype") in HALF_DTYPES:
            return f"reduce_dtype=torch.{policy['reduce_dtype']}"
        if policy.get("reduce_dtype") is None and policy.get("param_dtype") in HALF_DTYPES:
            return f"param_dtype=torch.{policy['param_dtype']} with reduce_dtype unset"
        return None

    @property
    def reduce_dtype(self) -> str | None:
        """The dtype the gradients are reduced in, by name: a compression hook's, FSDP's ``reduce_dtype`` (or its
        ``param_dtype`` where unset); None: the gradients' own (fp32 master gradients)."""
        for hook in self.hooks:
            for short, name in (("fp16", "float16"), ("bf16", "bfloat16")):
                if short in hook:
                    return name
        policy = self.policy or {}
        return policy.get("reduce_dtype") or policy.get("param_dtype")

    @property
    def micro_batches(self) -> int:
        """Backward passes per optimizer step in the parallel AMP pass (1: no gradient accumulation)."""
        records = self.records.get("as_run")
        if records is None or not len(records) or Column.MICRO_STEP not in records:
            return 1
        attempted = int((~records[Column.MICRO_STEP].astype(bool)).sum())
        return max(1, round(len(records) / attempted)) if attempted else len(records)

    @property
    def parallel_only(self) -> bool:
        """The parallel training fails where the single-process one is healthy: the fault needs the ranks."""
        return bool(self.symptoms) and not self.single_process_symptoms

    @property
    def measured_reduction(self) -> bool:
        return len(self.reduction) > 0

    def worst(self) -> pd.Series | None:
        """The parameter whose reduction strays furthest from fp32 (None: not measured)."""
        if not self.measured_reduction:
            return None
        ordered = self.reduction.sort_values(["nonfinite_steps", "relative_error"], ascending=False, kind="stable")
        return ordered.iloc[0]

    @property
    def reduction_faulty(self) -> bool:
        worst = self.worst()
        return worst is not None and (
            worst["nonfinite_steps"] > 0 or worst["relative_error"] > REDUCTION_ERROR_WORTH_SAYING
        )

    def to_json(self) -> dict[str, Any]:
        worst = self.worst()
        return {
            "world": self.world,
            "topology": self.topology,
            "parallelized_by": self.parallelized_by,
            "hooks": self.hooks,
            "policy": self.policy,
            "symptoms": [s.code for s in self.symptoms],
            "repaired_symptoms": [s.code for s in self.repaired_symptoms],
            "parallel_only": self.parallel_only,
            "ranks_agree": self.ranks_agree,
            "reduction_measured": self.measured_reduction,
            "worst_reduction": None
            if worst is None
            else {k: _plain(worst[k]) for k in ("name", "module", "relative_error", "nonfinite_steps", "local_max")},
            "scaler_enabled": self.scaler_enabled,
            "micro_batches": self.micro_batches,
            "growth": {str(world): self.growth[world].to_json() for world in sorted(self.growth)},
            "loss_dtypes": self.loss_dtypes,
            "seconds": round(self.seconds, 2),
        }


def _plain(value: Any) -> Any:
    """A pandas scalar as JSON takes it (an inf relative error stays a string: JSON has no inf)."""
    if isinstance(value, str):
        return value
    number = float(value)
    return number if math.isfinite(number) else str(number)


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
class LineTrial:
    """One set of source lines the search ran in fp32 (``overrides.fp32_lines``), and the same-state gap left."""

    fp32_lines: list[str]
    gap: float

    def to_json(self) -> dict[str, Any]:
        return {"fp32_lines": self.fp32_lines, "gap": self.gap}


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
    compared_loss_scale: float | None = None
    """The loss scale AMP's step at ``worst_step`` was compared at, where an optimizer's skip at the configured
    scale changed what a later optimizer of the iteration saw (the step is retaken at the scale calibration lowers
    to); None when the configured scale was used."""
    skipped_in_comparison: list[str] = field(default_factory=list)
    """The optimizers the scaler still skipped in AMP's compared step at ``worst_step``: a loss after their skip is
    not comparable with FP32's. Empty when none skipped."""
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
    operators: OperatorAttribution | None = None
    """Where no module set closed the gap: every operator AMP's step at ``worst_step`` ran in half precision,
    recomputed in fp32, its error weighted by the loss's gradient, summed by the line of your code that called it
    (:mod:`fp16doctor.measure.attribution`). None when the module search closed the gap (or no search ran)."""
    closing_lines: list[str] | None = None
    """The smallest set of source lines whose operators in fp32 (``overrides.fp32_lines``) bring the gap within
    tolerance; None when none tried did (or none was tried)."""
    lines_closed_gap: float | None = None
    """The gap left with ``closing_lines`` in fp32."""
    lines_tried: list[LineTrial] | None = None
    """The line sets tried, in order; None when the operator-level attribution did not run."""

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
        if self.compared_loss_scale is not None:
            out["compared_loss_scale"] = self.compared_loss_scale
        if self.skipped_in_comparison:
            out["skipped_in_comparison"] = self.skipped_in_comparison
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
        if self.operators is not None:
            out["operators"] = self.operators.to_json()
        if self.lines_tried is not None:
            out.update(
                {
                    "closing_lines": self.closing_lines,
                    "lines_closed_gap": self.lines_closed_gap,
                    "lines_tried": [t.to_json() for t in self.lines_tried],
                }
            )
        return out


@dataclass(frozen=True)
class WatchedStep:
    """One optimizer step of the watched run, as its watch recorded it (a capsule's history)."""

    step: int
    loss: float | None
    """The step's loss (None: not seen)."""
    skipped: bool
    """The scaler skipped the step: the weights did not change."""
    lr: float | None = None
    grad_norm: float | None = None
    """The unscaled gradient norm (None: not read at this step)."""

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> WatchedStep | None:
        """A manifest's history row; None for one that is not (a capsule of another version)."""
        if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
            return None
        return cls(
            step=entry["step"],
            loss=_number_or_none(entry.get("loss")),
            skipped=bool(entry.get("skipped")),
            lr=_number_or_none(entry.get("lr")),
            grad_norm=_number_or_none(entry.get("grad_norm")),
        )


def _number_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class CapsuleReplay:
    """What a capsule's watch recorded about the step its replay starts from (its manifest)."""

    step: int
    """The optimizer step the capsule holds."""
    history_finite: bool
    """Every step the watch checked before it had a finite loss."""
    restored: list[str] = field(default_factory=list)
    """State the model's forward wrote (``module.attribute``) that the capsule put back as the step started."""
    uncaptured: list[str] = field(default_factory=list)
    """State the model's forward changed that the watch could not put back (written in place without a copy, a list
    or dict changed): the replay starts from what the failing forward left there."""
    nonfinite_state: list[str] = field(default_factory=list)
    """Entries of the model state the replay starts from that hold inf or NaN (measured when the diagnosis loads
    the capsule)."""
    skipped_before: int = 0
    """The optimizer steps the watched run skipped in a row just before the capsule's: the replay's scaler resumes
    that streak, its leading skips are no calibration."""
    history: list[WatchedStep] = field(default_factory=list)
    """The watched run's last steps up to the capsule's (at most 50), as its watch measured them."""


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
    capsule: CapsuleReplay | None = None
    """A capsule's diagnosis: what its watch recorded about the state the replayed step starts from."""
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
    compiled: CompiledComparison | None = None
    """The compiled training beside the eager one, where the training compiles."""
    parallel: ParallelComparison | None = None
    """The training parallelised under torchrun (``--nproc``), beside the single-process triage."""
    bf16_supported: bool = True
    symptoms: list[Symptom] = field(default_factory=list)
    """The measured symptoms (:class:`fp16doctor.measure.symptoms.Symptom`) of the AMP probe against FP32."""
    explained: dict[str, list[str]] = field(default_factory=dict)
    """Per symptom code, the causes whose error findings explain it (empty: the ``unexplained`` finding)."""

    def only_compiled_fails(self) -> bool:
        """The training compiles, and only its compiled AMP probe fails or drifts (eager is healthy)."""
        return self.compiled is not None and self.compiled.outcome == CompiledOutcome.COMPILED_ONLY

    def only_eager_fails(self) -> bool:
        """The training compiles, and only its eager AMP probe fails: healthy as it runs, compiled."""
        return self.compiled is not None and self.compiled.outcome == CompiledOutcome.EAGER_ONLY


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
    """The findings in rank order, the top cause first."""
    stages: list[StageReport]
    """The triage's stages in order, each run or skipped (and why)."""
    evidence: Evidence
    """Everything the stages measured (not in the JSON as a whole: the findings and stages carry it)."""
    notes: list[str] = field(default_factory=list)
    """How the doctor ran the training file (e.g. a torch.compile'd model run uncompiled)."""
    corrected: CorrectedConfig | None = None
    """The verified fixes' config patches together, checked once more: patch, symptoms before and after."""
    user_layers: dict[str, Any] = field(default_factory=dict, repr=False)
    """The user's own config layers merged (the file's ``CONFIG``, a YAML file, the caller's keys; no defaults):
    what the corrected config is written from. Not in the JSON."""

    def with_user_layers(self, layers: dict[str, Any]) -> Diagnosis:
        return replace(self, user_layers=dict(layers))

    @property
    def unexplained(self) -> list[UnexplainedException]:
        """Exceptions the training raised in a probe that no finding accounts for (never "healthy")."""
        explained = {
            json_key(f.exception)
            for f in self.findings
            if f.exception is not None and (f.cause != "unexplained" or f.found_by == FoundBy.INTERVENTION)
        }
        out = []
        for summary in (self.evidence.fp32, self.evidence.amp):
            if summary is not None and summary.exception is not None and json_key(summary.exception) not in explained:
                out.append(UnexplainedException(summary.mode, summary.exception))
        return out

    @property
    def healthy(self) -> bool:
        return not any(f.severity == Severity.ERROR for f in self.findings) and not self.unexplained

    @property
    def only_eager_fails(self) -> bool:
        """The training compiles, and only its eager AMP probe fails: healthy as it runs, compiled."""
        return self.evidence.only_eager_fails()

    @property
    def verdict(self) -> str:
        """``healthy`` when no finding is an error and ``unexplained`` is empty; else ``unhealthy``."""
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
