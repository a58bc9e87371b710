"""Running the triage and turning its evidence into ranked findings."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import DoctorConfig, apply_patch, build_config, merge, whole_lists
from ..engine.kept import StateBlockMapping, StateKeeper, earlier_objects_frozen, release_memory
from ..engine.probe import Workbench
from ..engine.progress import ProbeStepHook, StepProgress
from ..engine.records import Reading, Table
from ..errors import MemoryLimitError, one_line, smaller_run_hint
from ..measure.symptoms import Symptom
from ..tensors import OUT_OF_MEMORY
from ..userfile.spec import TrainingSpec, notes_under
from .findings import (
    SEVERITIES,
    CapsuleReplay,
    CorrectedConfig,
    Diagnosis,
    Evidence,
    Finding,
    Fix,
    LocalisedAt,
    Repair,
    Severity,
    StageName,
    StageReport,
    StageStatus,
    Verification,
)
from .interventions import InterventionSearch, SearchResult
from .memory import memory_plan
from .rules import UnexplainedEvidence
from .rules.fp32_divergence import FP32_NONFINITE, Fp32Divergence, TriedOnFp32
from .sharded import as_sharded
from .stages import STAGES, Stage, StageContext, measured_symptoms, same_state_gap
from .verify import Verifier, repair_rank, with_recommended_scale

UNEXPLAINED = "unexplained"
"""The cause code of symptoms that no rule explains (an error finding: never healthy)."""
FP32_DIVERGENCE = Fp32Divergence.code
UNEXPLAINED_ORDER = 95
"""Ranks after every specific cause of the same severity."""

CI_STEPS = 20
"""--ci: probes this long (a smoke check, under a minute per model on 2 cores)."""


VERIFYING = StageName.VERIFYING
SEARCHING = StageName.INTERVENTION_SEARCH


def stage_names() -> list[StageName]:
    """What ``on_stage`` is told, in order: every stage, then the fix verification and (when a symptom is
    left unexplained) the intervention search."""
    return [stage.name for stage in STAGES] + [VERIFYING, SEARCHING]


@dataclass
class DiagnoseOptions:
    ci: bool = False
    """The CI smoke check: fewer steps, narrower sweeps and searches."""
    scan_batches: int | None = None
    """Scan this many batches in stage 1 (default: the batches the probes use)."""
    max_memory: int | None = None
    """Bytes the diagnosis may hold (--max-memory; None: one probe in memory, every kept state on disk, see :mod:`.memory`)."""
    recorded_loss_finding: str | None = None
    """A capsule's: what its watch recorded about the loss computation the replay cannot run (a finite loss whose
    gradient w.r.t. the model's outputs was non-finite, a non-finite loss).
    Evidence the rules read (``loss-in-half``)."""
    capsule: CapsuleReplay | None = None
    """A capsule's: what its watch recorded about the state the replayed step starts from (``capsule-state``); the
    diagnosis adds which entries of that state are not finite."""
    plots: bool = False
    """The report's plots will be drawn (``--report``, ``--html``): the AMP probe also records the activation
    gradients' ranges and the parameter gradients' underflow mass they show (:data:`PLOT_INSTRUMENTS`). Off, those
    tables are empty and :func:`fp16doctor.output.plots.diagnosis_figures` leaves what they show out (the
    activation-range plot's backward series, the underflow heatmap)."""
    nproc: int = 1
    """Ranks for the parallel stage (``--nproc``): the training parallelised under torchrun, as ``parallelize()``
    wraps it (DDP by default); 1 skips it."""
    rank_timeout: float = 300.0
    """Seconds the parallel stage waits while no rank moves (``--rank-timeout``) before it stops the run."""
    own_process: bool = False
    """The process is the diagnosis's own (the CLI's command): it may set glibc's mmap threshold to the model's
    tensor size (:func:`~fp16doctor.engine.kept.state_block_threshold`). A library caller's allocator is left alone."""


def diagnose(
    spec: TrainingSpec,
    config: DoctorConfig,
    options: DiagnoseOptions | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_probe_step: ProbeStepHook | None = None,
) -> Diagnosis:
    """Run every stage in order, then every rule; return the ranked diagnosis.

    ``on_stage`` is told each stage's name as it starts (then "verifying fixes", and "intervention search"
    when it runs); ``on_probe_step`` every probe step the diagnosis takes, as ``(mode, step, steps)``: the
    step within the stage (from 0) and the steps the stage planned so far (see :mod:`fp16doctor.engine.progress`).
    A caller's progress display, nothing the diagnosis depends on.
    """
    options = options or DiagnoseOptions()
    if options.ci and config.steps > CI_STEPS:
        config = build_config(merge(config.to_dict(), {"steps": CI_STEPS}))
    # FP32 probes may split their batches: the diagnosis stays within the AMP training's activation memory.
    bench = Workbench(spec, config, batch_count=max(config.steps, options.scan_batches or 0), micro_batching=True)
    bench.progress = StepProgress(on_probe_step)  # every probe of the bench reports its steps there
    plan = memory_plan(bench, options.max_memory)
    # Before the first probe: its weights, gradients and moments get their own mappings (the CLI's process only).
    mapping = StateBlockMapping(bench.parameter_shapes) if options.own_process else None
    with (
        earlier_objects_frozen(),  # each stage's collection walks only what the diagnosis made
        mapping or contextlib.nullcontext(),
        StateKeeper(plan.kept_budget) as keeper,
        bench.reference_kept_in(keeper.kept()),
    ):  # the folder goes, however the run ends
        ctx = StageContext(
            bench=bench,
            config=config,
            evidence=Evidence(
                config=config,
                device=bench.device.type,
                steps=config.steps,
                has_scheduler=spec.scheduler is not None,
                has_train_step=spec.train_step is not None,
                uses_default_loss=spec.loss is None and spec.train_step is None,
                near_misses={name: dict(found) for name, found in spec.near_misses.items()},
                recorded_loss_finding=options.recorded_loss_finding,
                capsule=with_nonfinite_state(options.capsule, bench) if options.capsule is not None else None,
            ),
            ci=options.ci,
            plots=options.plots,
            nproc=options.nproc,
            rank_timeout=options.rank_timeout,
            states=keeper.kept(),
            fault_snapshots=keeper.kept(),
            amp_snapshots=keeper.kept(),
        )
        return _triage(ctx, spec, on_stage, mapping)


def with_nonfinite_state(capsule: CapsuleReplay, bench: Workbench) -> CapsuleReplay:
    """The capsule's record with the entries of the state its replay starts from that hold inf or NaN."""
    state = bench.initial_state
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    return replace(capsule, nonfinite_state=bad)


def activation_bytes(forward: Any) -> list[int]:
    """The sizes a probe's module outputs take in fp32 and in half precision (the forward table's ``numel``)."""
    if forward is None or len(forward) == 0 or "numel" not in forward:
        return []
    return [int(n) * width for n in forward[Reading.NUMEL].unique() for width in (2, 4)]


ESSENTIAL_STAGES = (StageName.FP32, StageName.AMP)
"""Without these two probes there is nothing to diagnose: out of memory there, the diagnosis stops (exit 2)."""


def run_stage(stage: Stage, ctx: StageContext) -> StageReport:
    """Run one stage, then release what it held (its probes are closed; a full collection frees any cycle left).

    A stage that runs out of memory reports so and the diagnosis goes on without it: the memory is the
    diagnosis's problem, not a finding about the training. The FP32 and AMP probes are the exception: a
    verdict without them would be a guess, so their running out of memory is a :class:`MemoryLimitError`.
    """
    start = time.perf_counter()
    try:
        report = stage.run(ctx)
    except OUT_OF_MEMORY as exc:
        reason = one_line(exc)
        if stage.name in ESSENTIAL_STAGES:
            raise MemoryLimitError(
                f"the {stage.name} probe ran out of memory ({reason}); the diagnosis needs it.",
                hint=smaller_run_hint("Diagnose"),
            ) from exc
        report = StageReport(
            stage.name, StageStatus.SKIPPED, f"did not fit in memory ({reason}); the diagnosis goes on without it"
        )
    finally:
        release_memory(ctx.bench.device)
    return report.timed(time.perf_counter() - start)


def _triage(
    ctx: StageContext,
    spec: TrainingSpec,
    on_stage: Callable[[str], None] | None,
    mapping: StateBlockMapping | None = None,
) -> Diagnosis:
    """Every stage, then the rules, the fixes' verification and (for what no rule explains) the search.
    ``mapping``: the allocator setting the first probes' activation sizes may put back (CLI runs only)."""
    config, evidence = ctx.config, ctx.evidence

    def announce(name: str) -> None:
        ctx.progress.begin()  # the steps of each stage are counted from 0 against that stage's plan
        if on_stage is not None:
            on_stage(name)

    stages: list[StageReport] = []
    for stage in STAGES:
        announce(stage.name)
        stages.append(run_stage(stage, ctx))
        probed = {StageName.FP32: evidence.fp32, StageName.AMP: evidence.amp}.get(stage.name)
        if mapping is not None and probed is not None:  # the first two probes show the steps' activation sizes
            mapping.saw_activations(activation_bytes(probed.tables.get(Table.FORWARD)))
    announce(VERIFYING)  # measuring the symptoms may replay AMP aligned on the steps taken: the verification's work
    start = time.perf_counter()
    skips = len(evidence.amp.skip_steps) if evidence.amp is not None else 0
    with ctx.progress.planned(
        evidence.steps + skips if skips else 0
    ):  # the AMP run aligned on the steps taken, if a drift needs it
        evidence.symptoms = measured_symptoms(
            ctx, config, evidence.amp, evidence.fp32, evidence.gap.gap if evidence.gap else None
        )
    if evidence.only_compiled_fails():
        assert evidence.compiled is not None
        evidence.symptoms = list(evidence.compiled.compiled_symptoms)  # the training as it runs: compiled
    evidence.symptoms = with_parallel_symptoms(evidence)
    findings, suppressors = evaluate_rules(evidence)
    settled = settled_by(suppressors)
    findings = [f for f in findings if f.cause not in settled]
    verifier = Verifier(ctx, measure_gap=lambda cfg, step: same_state_gap(ctx, cfg, step))
    findings = verify_findings(findings, evidence, verifier, hidden_by(suppressors))
    fixes_tried = [f for f in findings if f.verification is not None and f.verification.tried]
    release_memory(ctx.bench.device)
    findings = demote_unrepairing(findings)
    # A root cause hides its symptoms' findings, unless its own fix, tried, changed nothing (a cause is what an
    # intervention repairs), or trying a hidden finding's fix repaired the training.
    hidden = hidden_by(suppressors, standing={f.cause for f in findings if not f.demoted})
    findings = [f for f in findings if f.cause not in hidden or repair_rank(f) == 0]
    findings, unexplained = explain_symptoms(findings, evidence)
    search, search_unfit, searched = None, None, time.perf_counter()
    if unexplained and not parallel_only(evidence):  # the search's probes run in this one process
        announce(SEARCHING)
        try:
            search = InterventionSearch(ctx, verifier, unexplained).run()
        except OUT_OF_MEMORY as exc:  # the diagnosis's limit, not the training's: the symptoms stay unexplained
            search_unfit = one_line(exc)
        finally:
            release_memory(ctx.bench.device)
        if search is not None and search.repair is not None:
            findings, unexplained = adopt_repair(findings, search.repair, evidence, unexplained)
    findings, unexplained = settle_fp32_divergence(findings, evidence, unexplained, tried_on_fp32(fixes_tried, search))
    search_stage = (
        search_report(search, len(evidence.symptoms))
        if search_unfit is None
        else StageReport(
            StageName.INTERVENTION_SEARCH,
            StageStatus.SKIPPED,
            f"did not fit in memory ({search_unfit}); the diagnosis goes on without it",
        )
    ).timed(time.perf_counter() - searched)
    if unexplained:
        findings.append(unexplained_finding(unexplained, evidence, search))
    if evidence.only_eager_fails():
        findings = only_eager_fails(findings, evidence)
    findings = [as_sharded(f, evidence.config.sharding) for f in rank(findings)]
    corrected = verify_corrected(findings, evidence, verifier)
    ran = corrected is not None or any(f.verification is not None and f.verification.tried for f in findings)
    stages.append(
        StageReport(
            StageName.FIX_VERIFICATION,
            StageStatus.RAN if ran else StageStatus.SKIPPED,  # an untried record is no run
            _verification_sentence(findings, corrected),
            seconds=time.perf_counter() - start - search_stage.seconds,
            details={"corrected": corrected},
        )
    )
    stages.append(search_stage)
    notes = notes_under(spec.notes, config.compile.enabled)
    return Diagnosis(findings=findings, stages=stages, evidence=evidence, notes=notes, corrected=corrected)


def with_parallel_symptoms(evidence: Evidence) -> list[Symptom]:
    """The symptoms the diagnosis stands on: the single-process ones, and what only the parallel training shows."""
    parallel = evidence.parallel
    if parallel is None:
        return evidence.symptoms
    seen = {s.code for s in evidence.symptoms}
    return [*evidence.symptoms, *(s for s in parallel.symptoms if s.code not in seen)]


def parallel_only(evidence: Evidence) -> bool:
    """Only the parallel training fails: the single-process probes the search tries fixes on are healthy."""
    return evidence.parallel is not None and evidence.parallel.parallel_only


def verify_findings(findings: list[Finding], ev: Evidence, verifier: Verifier, hidden: set[str]) -> list[Finding]:
    """The findings with their fixes tried: every error finding's intervention, and every warning's that explains a
    measured symptom.

    The findings a root cause hides are tried only when no visible finding's fix repaired the training:
    then one of them may hold the fix, and it must not stay hidden.
    """
    from .rules import rules_by_code

    rules = rules_by_code()
    measured = {s.code for s in ev.symptoms}
    candidates = [
        i
        for i, f in enumerate(findings)
        if f.severity == Severity.ERROR or (f.severity == Severity.WARNING and measured & set(rules[f.cause].explains))
    ]
    interventions = {i: rules[findings[i].cause].intervention(findings[i], ev) for i in candidates}
    out = list(findings)
    with verifier.ctx.progress.planned(sum(verifier.planned_steps(i) for i in interventions.values())):
        visible = [i for i in candidates if findings[i].cause not in hidden]
        for group in (visible, [i for i in candidates if findings[i].cause in hidden]):
            if group and findings[group[0]].cause in hidden and any(repair_rank(out[i]) == 0 for i in candidates):
                return out
            for i in group:
                rule = rules[findings[i].cause]
                tried = replace(out[i], verification=verifier.verify(interventions[i], rule.nothing_to_try))
                out[i] = complete_with_scale(tried, interventions[i], ev, verifier)
    return out


def complete_with_scale(finding: Finding, intervention: Any, ev: Evidence, verifier: Verifier) -> Finding:
    """A fix that removed the fault but left a loss scale settling from far too high is tried once more with the
    sweep's recommended scale (:func:`~.verify.with_recommended_scale`); where that repairs the training, the
    finding's fix and its verification are the completed ones, and the fix says what was added."""
    completion = (
        with_recommended_scale(intervention, finding.verification, ev, verifier.ctx.config) if intervention else None
    )
    if completion is None:
        return finding
    completed, also = completion
    with verifier.ctx.progress.planned(verifier.planned_steps(completed)):
        verification = verifier.verify(completed, "")
    if not verification.repaired:
        return finding
    summary = finding.fix.summary + (
        f" Together with {also}: with the fix alone, GradScaler still halves its scale step "
        "after skipped step down to what the repaired gradients need (measured)."
    )
    return replace(
        finding,
        verification=verification,
        fix=replace(finding.fix, summary=summary, config_patch=dict(completed.config_patch)),
        title=finding.title + f" (together with {also})",
    )


def only_eager_fails(findings: list[Finding], ev: Evidence) -> list[Finding]:
    """The compiled training, as it runs, is healthy where only the eager one fails: what the triage found in eager
    is said as warnings (where the eager path would fail, and its fix), and the symptoms are marked eager's."""
    for symptom in ev.symptoms:
        symptom.measured["eager_only"] = True
    return [
        replace(f, severity=Severity.WARNING, title=f"eager only: {f.title} (the compiled training is healthy)")
        if f.severity == Severity.ERROR or (f.severity == Severity.WARNING and _explains_measured(f, ev))
        else f
        for f in findings
    ]


def _explains_measured(finding: Finding, ev: Evidence) -> bool:
    """The warning stands on eager's measurements: symptoms were tied to it, or its rule names measured causes
    (an error unless, as measured, its fix fell short) and explains a measured symptom. A static fact's warning
    (half-precision weights) holds compiled too."""
    from .rules import rules_by_code

    if finding.symptoms:
        return True
    rule = rules_by_code()[finding.cause]
    measured = {s.code for s in ev.symptoms}
    return rule.severity == Severity.ERROR and bool(measured & set(rule.explains))


def demote_unrepairing(findings: list[Finding]) -> list[Finding]:
    """An error whose fix, tried, removed none of the measured symptoms becomes a warning that says so (and so
    does a warning that was tried because it explains a symptom: it is not promoted to an error)."""
    return [
        replace(
            f,
            severity=Severity.WARNING,
            demoted=True,
            title=f.title + f" (tried: {f.verification.tried}; it did not change the outcome)",
        )
        if f.severity in (Severity.ERROR, Severity.WARNING) and f.verification and repair_rank(f) == 3
        else f
        for f in findings
    ]


def verify_corrected(findings: list[Finding], ev: Evidence, verifier: Verifier) -> CorrectedConfig | None:
    """The corrected config and its measured before/after: the top-ranked fix alone when, tried, it repaired
    everything (the smallest change that works), else every verified config patch together, checked once more."""
    from .verify import Intervention

    usable = [f for f in findings if f.severity == Severity.ERROR and f.fix.config_patch and repair_rank(f) != 3]
    if usable and usable[0] is findings[0] and repair_rank(usable[0]) == 0:
        usable = usable[:1]
    data = [
        f.cause
        for f in findings
        if f.severity == Severity.ERROR and f.verification and f.verification.tried and not f.fix.config_patch
    ]
    if not usable:
        return None
    patch: dict[str, Any] = {}
    for finding in usable:
        patch = apply_patch(patch, finding.fix.config_patch)
    single = usable[0].verification if len(usable) == 1 else None
    if single is not None and single.tried and single.config_patch == patch:
        after, summary, records = list(single.symptoms_after or []), single.summary, single.amp_records
    else:
        try:
            outcome = verifier.run(Intervention("the corrected config", config_patch=patch))
        except OUT_OF_MEMORY:  # each finding's own verification stands; the combination is left unverified
            release_memory(verifier.ctx.bench.device)
            return None
        after, summary, records = [s.code for s in outcome.symptoms], outcome.summary(), outcome.amp
    code = [
        f.cause for f in findings if f.severity == Severity.ERROR and not f.fix.config_patch and f.cause not in data
    ]
    corrected = CorrectedConfig(
        # the lists whole, as --fix-config writes them: merged by "a list replaces a list", it keeps the user's own
        config_patch=whole_lists(verifier.ctx.config.to_dict(), patch),
        from_findings=[f.cause for f in usable],
        symptoms_before=[s.code for s in ev.symptoms],
        symptoms_after=after,
        summary=summary,
        needs_data_changes=data,
        needs_code_changes=code if ev.parallel is not None else [],
        amp_records=records,
    )
    return _on_the_ranks(corrected, findings, verifier, patch) if ev.parallel is not None else corrected


def _on_the_ranks(
    corrected: CorrectedConfig, findings: list[Finding], verifier: Verifier, patch: dict[str, Any]
) -> CorrectedConfig:
    """The corrected config measured where the training runs: on its ranks. A fix measured in one process can leave
    the ranks failing, from what only the ranks compute: where the diagnosis found the reduction in half precision
    breaking gradients, the ranks run it with the reduction in fp32 too, and that change joins the corrected
    config's code changes where it is what repairs the ranks."""
    from .stages.parallel import corrected_on_ranks

    reduction = any(f.cause == "half-precision-reduce" and f.severity != Severity.INFO for f in findings)
    found = corrected_on_ranks(verifier.ctx, patch, reduce_in_fp32=reduction)
    if isinstance(found, str):
        return replace(corrected, ranks_not_rerun=True, ranks_summary=f"not measured on the ranks: {found}")
    world = verifier.ctx.nproc
    as_run = [s.code for s in found["as_run"]]
    summary = f"with {world} ranks: " + (", ".join(as_run) if as_run else "no symptom left")
    if not as_run or "fp32_reduce" not in found:
        return replace(corrected, ranks_symptoms_after=as_run, ranks_summary=summary)
    reduced = [s.code for s in found["fp32_reduce"]]
    summary += "; with its reduction in fp32 too: " + (", ".join(reduced) if reduced else "no symptom left")
    if reduced:  # the reduction's change did not repair the ranks either: what the corrected config leaves
        return replace(corrected, ranks_symptoms_after=as_run, ranks_summary=summary)
    code = [*corrected.needs_code_changes, "half-precision-reduce"]
    code = list(dict.fromkeys(code))
    return replace(corrected, ranks_symptoms_after=[], ranks_summary=summary, needs_code_changes=code)


def _verification_sentence(findings: list[Finding], corrected: CorrectedConfig | None) -> str:
    tried: list[tuple[str, Verification]] = [
        (f.cause, f.verification) for f in findings if f.verification is not None and f.verification.tried
    ]
    if not tried and corrected is None:
        return "no fix to try"
    parts = [
        f"{cause}: "
        + (
            "repaired"
            if v.repaired
            else f"removed {v.removed_share:.0%} of the symptoms{_appeared(v)}"
            if v.removed_share is not None
            else "no measured symptom to remove"
        )
        for cause, v in tried
    ]
    if corrected is not None:
        parts.append("corrected config: " + corrected.summary)
    return "; ".join(parts)


def _appeared(v: Verification) -> str:
    """The symptoms a tried fix left that were not there before it (a fix can remove every symptom it was tried
    for and still leave the training unrepaired)."""
    new = [c for c in (v.symptoms_after or []) if c not in (v.symptoms_before or [])]
    return f", but {', '.join(new)} appeared" if new else ""


def explain_symptoms(findings: list[Finding], ev: Evidence) -> tuple[list[Finding], list[Symptom]]:
    """Tie every symptom to the findings that explain it: the findings with their symptoms, and the symptoms no
    finding explains (the intervention search's targets; what it cannot repair becomes the ``unexplained`` error).

    A warning whose rule explains a measured symptom becomes an error: the
    verdict follows the symptoms, the rules only say why. A finding with no fix to
    propose (``needs_search``) or whose fix, tried, changed nothing (``demoted``)
    explains nothing: its symptoms go to the intervention search.
    """
    from .rules import rules_by_code

    explains = {code: rule.explains for code, rule in rules_by_code().items()}
    out = list(findings)
    unexplained = []
    for symptom in ev.symptoms:
        candidates = [
            i
            for i, f in enumerate(out)
            if symptom.code in explains.get(f.cause, ()) and not (f.demoted or f.needs_search)
        ]
        errors = [i for i in candidates if out[i].severity == Severity.ERROR]
        if not errors:
            warnings_ = sorted(
                (i for i in candidates if out[i].severity == Severity.WARNING),
                key=lambda i: (out[i].order, -out[i].confidence),
            )
            if warnings_:
                out[warnings_[0]] = replace(out[warnings_[0]], severity=Severity.ERROR)
                errors = warnings_[:1]
        for i in errors:
            out[i] = out[i].with_symptom(symptom.code)
        ev.explained[symptom.code] = [out[i].cause for i in errors]
        if not errors:
            unexplained.append(symptom)
    return out, unexplained


def adopt_repair(
    findings: list[Finding], repair: Repair, ev: Evidence, unexplained: list[Symptom]
) -> tuple[list[Finding], list[Symptom]]:
    """The findings with the one named from what the intervention search repaired, tied to the symptoms it removed
    (a rule's finding of the same cause, whose own fix did not repair, gives it its evidence and leaves); and the
    symptoms still unexplained."""
    from .rules import name_repair

    named = name_repair(repair, ev)
    adopted = [
        f for f in findings if f.cause == named.cause and (f.demoted or f.needs_search or f.severity != Severity.ERROR)
    ]
    removed = tuple(s.code for s in unexplained if s.code in repair.symptoms)
    named = replace(
        named,
        adopted=(*named.adopted, *(record for f in adopted for record in f.evidence_records())),
        symptoms=removed,
    )
    for code in removed:
        ev.explained[code] = [named.cause]
    kept = [f for f in findings if not any(f is a for a in adopted)]
    return [*kept, named], [s for s in unexplained if s.code not in repair.symptoms]


def settle_fp32_divergence(
    findings: list[Finding], ev: Evidence, unexplained: list[Symptom], tried: list[TriedOnFp32]
) -> tuple[list[Finding], list[Symptom]]:
    """FP32 failing is a symptom: the findings and unexplained symptoms once the search has looked for what repairs
    FP32 as well. Where a finding's fix (a rule's, or the search's repair), tried, removed FP32's failure, the
    ``fp32-divergence`` finding goes; where none did, it stands as the error for the symptoms it explains, listing
    what was tried."""
    from .rules import rules_by_code

    pending = [f for f in findings if f.cause == FP32_DIVERGENCE and f.needs_search]
    if not pending:
        return findings, unexplained
    rest = [f for f in findings if not any(f is p for p in pending)]
    if any(removes_fp32_failure(f) for f in rest):
        return rest, unexplained  # a cause whose fix repairs FP32 accounts for its failure
    rule = rules_by_code()[FP32_DIVERGENCE]
    assert isinstance(rule, Fp32Divergence)
    tied = [s for s in unexplained if s.code in rule.explains]
    settled = rule.settled(pending[0], tried)
    for symptom in tied:
        settled = settled.with_symptom(symptom.code)
        ev.explained[symptom.code] = [settled.cause]
    return [*rest, settled], [s for s in unexplained if not any(s is t for t in tied)]


def removes_fp32_failure(finding: Finding) -> bool:
    """Whether the finding's fix, tried, removed the FP32 baseline's failure."""
    v = finding.verification
    return (
        v is not None
        and bool(v.tried)
        and FP32_NONFINITE in (v.symptoms_before or [])
        and FP32_NONFINITE not in (v.symptoms_after or [])
    )


def tried_on_fp32(fixes: list[Finding], search: SearchResult | None) -> list[TriedOnFp32]:
    """What was tried on a training whose FP32 baseline fails: each finding's fix tried, then the search's trials."""
    out = [
        TriedOnFp32(f.verification.tried or "", f.cause, "not screened", list(f.verification.symptoms_after or []))
        for f in fixes
        if f.verification is not None and f.cause != FP32_DIVERGENCE
    ]
    for trial in search.trials if search is not None else []:
        after = trial.symptoms_after if trial.passed_screen is not False else None
        out.append(TriedOnFp32(trial.candidate.intervention.description, trial.candidate.kind, trial.screen, after))
    return out


def search_report(search: SearchResult | None, symptoms: int = 0) -> StageReport:
    """The intervention search as a stage of the report: what was tried, and what repaired."""
    if search is None:
        return StageReport(
            StageName.INTERVENTION_SEARCH,
            StageStatus.SKIPPED,
            "every measured symptom is explained by a rule's finding" if symptoms else "no measured symptom to repair",
        )
    tried = "; ".join(
        f"{t.candidate.intervention.description}: "
        + ("repaired" if t.repaired else t.screen if t.passed_screen is False else f"symptoms left {t.symptoms_after}")
        for t in search.trials
    )
    head = (
        f"repaired by {search.repair.description}"
        if search.repair is not None
        else "no intervention repaired the training"
    )
    found = f"{head} ({len(search.trials)} tried: {tried})" if search.trials else "no intervention applies: none tried"
    return StageReport(
        StageName.INTERVENTION_SEARCH,
        StageStatus.RAN,
        found,
        details={"trials": [t.to_json() for t in search.trials], "fault_is_intrinsic": search.fault_is_intrinsic},
    )


def unexplained_finding(symptoms: list[Symptom], ev: Evidence, search: SearchResult | None = None) -> Finding:
    """The honest finding for symptoms no rule explains: what was measured, where it starts, what to look at."""
    loc = ev.localisation
    exc = ev.amp.exception if ev.amp is not None else None
    tried = search.trials if search is not None else []
    evidence = UnexplainedEvidence(
        symptoms=list(symptoms),
        localisation=LocalisedAt.of(loc) if loc is not None else None,
        exception=exc,
        interventions_tried=[t.to_json() for t in tried] or None,
    )
    where = f"; it starts in {loc.place} at {loc.operator}, step {loc.step}, batch {loc.batch_index}" if loc else ""
    if exc is not None:
        where += f"; AMP raised {exc.type} at {exc.location}"
    inspect = ["re-run `fp16doctor compare FILE --fp32 --amp --steps N` to see where the curves part"]
    if loc is not None:
        inspect.insert(
            0,
            f"print the inputs and output of {loc.operator} in {loc.place} at step {loc.step} (batch {loc.batch_index}) under AMP and FP32",
        )
    if search is not None and search.trials:
        inspect.insert(
            0,
            "no intervention the doctor can apply removed it (tried: "
            + "; ".join(
                f"{t.candidate.intervention.description} -> "
                + (
                    t.screen
                    if t.passed_screen is False
                    else f"symptoms left: {', '.join(t.symptoms_after or []) or 'none'}"
                )
                for t in search.trials
            )
            + ")",
        )
    codes = {s.code for s in symptoms}
    if "skips" in codes or "nonfinite" in codes:
        inspect.append("try a lower scaler.init_scale and bf16 to tell range from precision trouble")
    if codes & {"same-state-gap", "trajectory-drift", "lost-updates"}:
        inspect.append("keep the suspect modules in fp32 (overrides.fp32_modules) one at a time")
    return Finding(
        cause=UNEXPLAINED,
        severity=Severity.ERROR,
        title="Measured under AMP, explained by no rule or intervention: "
        + "; ".join(s.description for s in symptoms)
        + where,
        evidence=evidence,
        fix=Fix("No rule recognises this pattern. Inspect next: " + "; ".join(inspect) + "."),
        confidence=0.5,
        order=UNEXPLAINED_ORDER,
    )


def evaluate_rules(evidence: Evidence) -> tuple[list[Finding], dict[str, tuple[str, ...]]]:
    """Every rule's findings, and for each root cause found as an error the causes it marks as its symptoms
    (:func:`hidden_by`).

    A warning that explains a measured symptom counts as the error it will become (a static fact such as
    half weights is reported as a warning until a symptom stands on it). A finding that leaves its symptoms to the
    intervention search (``needs_search``: FP32 failing too, before the search looked for what repairs it) hides
    nothing.
    """
    from .rules import all_rules

    rules = all_rules()
    measured = {s.code for s in evidence.symptoms}
    findings: list[Finding] = []
    suppressors: dict[str, tuple[str, ...]] = {}
    for rule in rules:
        found = rule.check(evidence)
        findings.extend(found)
        if any(
            (f.severity == Severity.ERROR or (f.severity == Severity.WARNING and measured & set(rule.explains)))
            and not f.needs_search  # a symptom the search goes on from hides nothing
            for f in found
        ):
            suppressors[rule.code] = rule.suppresses
    return findings, suppressors


def settled_by(suppressors: dict[str, tuple[str, ...]]) -> set[str]:
    """The causes hidden whatever their fixes would measure: those hidden by a root whose rule
    ``settles_suppressed``."""
    from .rules import rules_by_code

    rules = rules_by_code()
    return hidden_by(suppressors, standing={root for root in suppressors if rules[root].settles_suppressed})


def hidden_by(suppressors: dict[str, tuple[str, ...]], standing: set[str] | None = None) -> set[str]:
    """The causes the root causes hide (``standing``: only those roots, e.g. the ones whose fix was not tried in
    vain)."""
    return {
        code
        for root, codes in suppressors.items()
        if standing is None or root in standing
        for code in codes
        if code != root
    }


def rank(findings: list[Finding]) -> list[Finding]:
    """The findings ranked (new records, ``rank`` from 1): severity; then what the fix, tried, repaired (all symptoms, some, nothing measured, none); then the
    smaller change; then a root cause before the causes it names as its symptoms (``suppresses``); then
    causal order (data, model, precision settings); then confidence."""
    from .rules import rules_by_code

    rules = rules_by_code()
    symptoms_of_others = {
        code for f in findings if f.severity == Severity.ERROR for code in rules[f.cause].suppresses if code != f.cause
    }

    def size(f: Finding) -> float:
        return f.verification.size if f.verification is not None else math.inf

    ordered = sorted(
        findings,
        key=lambda f: (
            SEVERITIES.index(f.severity),
            repair_rank(f),
            size(f),
            f.cause in symptoms_of_others,
            f.order,
            -f.confidence,
        ),
    )
    return [replace(finding, rank=index) for index, finding in enumerate(ordered, 1)]


def fixed_config(user_layers: dict[str, Any], diagnosis: Diagnosis) -> dict[str, Any]:
    """The user's config with the verified corrected patch (else every non-info finding's patch) applied."""
    if diagnosis.corrected is not None:
        return apply_patch(dict(user_layers), diagnosis.corrected.config_patch)
    out = dict(user_layers)
    for finding in diagnosis.findings:
        if finding.severity == Severity.INFO:
            continue  # advice, not a fix: bf16 changes the training's precision
        out = apply_patch(out, finding.fix.config_patch)
    return out
