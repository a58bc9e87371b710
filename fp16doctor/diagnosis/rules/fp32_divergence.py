"""The FP32 baseline goes non-finite (or fails) too, and nothing the doctor can apply repairs it.

FP32 failing is a symptom, not the answer: the intervention search then runs
on the FP32 probe, and the cause is what repairs FP32 as well (the learning
rate capped before a schedule event, the data without its offending rows, the
loss computed in float64 where FP32's first non-finite value is in the loss).
This finding stands only where none of them repairs: the data, learning rate
or model is at fault in a way the doctor cannot change (a log of a value that
is exactly 0, a division by zero), and it lists what was tried.

Evidence: the fp32 probe's first non-finite step, localised to its module and
operator, with the interventions tried on FP32 and what each left; or the
exception the training raised in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from ...measure.records import OMITTED_WHEN_NONE, ExceptionInfo
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix
from . import Rule

FP32_NONFINITE = "fp32-nonfinite"
"""The symptom of the FP32 baseline's own failure."""


@dataclass(frozen=True)
class Fp32ExceptionEvidence(EvidenceRecord):
    """The exception the training raised in the FP32 baseline."""

    exception: ExceptionInfo


@dataclass(frozen=True)
class TriedOnFp32(EvidenceRecord):
    """One intervention tried on the failing FP32 training (by the intervention search, or a finding's fix), and
    what it left."""

    intervention: str
    """The intervention in words."""
    kind: str
    """The search's kind of intervention (``lr-cap``, ``drop-nonfinite-rows``, ``loss-fp64``...), or the cause
    whose fix it was."""
    screen: str
    """What its screen on FP32's failing step found (``not screened``: it ran the full probes)."""
    symptoms_after: list[str] | None
    """The symptoms the full probes measured with it; None when the screen stopped it."""


@dataclass(frozen=True)
class Fp32NonfiniteEvidence(EvidenceRecord):
    """The FP32 baseline's first non-finite step, where the localisation did not run."""

    step: int
    """The first step whose loss or gradients are non-finite."""
    loss_first_nonfinite: int | None
    grads_first_nonfinite: int | None
    tried: list[TriedOnFp32] | None = field(default=None, kw_only=True, metadata={OMITTED_WHEN_NONE: True})
    """What was tried on FP32, none of which repaired it (once the search has run)."""


@dataclass(frozen=True)
class Fp32LocalisedNonfiniteEvidence(Fp32NonfiniteEvidence):
    """The FP32 baseline's first non-finite step, with where the FP32 localisation found the first non-finite value."""

    module: str | None
    """The culprit's module; None outside the model (the data, the optimizer)."""
    operator: str
    phase: str
    batch: int
    operator_input_ranges: list[tuple[float, float]]
    output: str


class Fp32Divergence(Rule):
    code = "fp32-divergence"
    order = 30
    evidence_type: ClassVar[type[EvidenceRecord]] = Fp32LocalisedNonfiniteEvidence
    explains = (
        "fp32-nonfinite",
        "nonfinite",
        "skips",
        "amp-exception",
        "lost-updates",
        "same-state-gap",
        "trajectory-drift",
    )
    verifiable = False
    triggers = ("log_of_zero.py",)
    fires_on = (lambda: fx.evidence(fp32=fx.probe("fp32", fx.records(nonfinite_loss=[3, 4]))),)
    quiet_on = (lambda: fx.evidence(amp=fx.probe(record=fx.records(nonfinite_loss=[3]))),)
    suppresses = (
        "scale-overflow",
        "scale-growth",
        "activation-overflow",
        "loss-in-half",
        "grad-underflow",
        "lr-schedule-peak",
        "precision-gap",
        "scheduler-skip-drift",
        "bf16-advice",
        "clip-before-unscale",
        "fp32-loss-rises",
    )

    nothing_to_try = (
        "FP32 fails too (it goes non-finite or raises): the fix is in the training code, the data or the "
        "learning rate, and no precision setting can make it"
    )

    def settled(self, finding: Finding, tried: list[TriedOnFp32]) -> Finding:
        """The finding once nothing tried on FP32 repaired it: the error that explains FP32's failure, with what
        was tried in its evidence and its verification."""
        if not tried:
            return replace(finding, needs_search=False)
        listed = "; ".join(
            f"{t.intervention} -> "
            + (t.screen if t.symptoms_after is None else f"symptoms left: {', '.join(t.symptoms_after) or 'none'}")
            for t in tried
        )
        verification = finding.verification
        if verification is not None:
            verification = replace(
                verification,
                reason=f"FP32 fails too, and nothing the doctor can apply repaired it (tried on FP32: {listed}): "
                "the fix is in the training code, the data or the learning rate",
            )
        evidence = finding.evidence
        if isinstance(evidence, Fp32NonfiniteEvidence):
            evidence = replace(evidence, tried=list(tried))
        return replace(
            finding,
            needs_search=False,
            evidence=evidence,
            verification=verification,
            title=finding.title + f" (tried on FP32, none repaired it: {'; '.join(t.intervention for t in tried)})",
        )

    def check(self, ev: Evidence) -> list[Finding]:
        fp32 = ev.fp32
        if fp32 is None or fp32.finite:
            return []
        if fp32.exception is not None:
            exc = fp32.exception
            return [
                self.finding(
                    f"The training raises {exc.type} in FP32 too, at step {exc.step}",
                    Fp32ExceptionEvidence(exception=exc),
                    Fix(f"Fix the training code at {exc.location}: {exc.type}: {exc.message}"),
                )
            ]
        step = min(s for s in (fp32.first_nonfinite_loss, fp32.first_nonfinite_grads) if s is not None)
        loc = ev.fp32_localisation
        where = f" at {loc.operator} in {loc.place}" if loc else ""
        evidence: Fp32NonfiniteEvidence
        if loc:
            evidence = Fp32LocalisedNonfiniteEvidence(
                step=step,
                loss_first_nonfinite=fp32.first_nonfinite_loss,
                grads_first_nonfinite=fp32.first_nonfinite_grads,
                module=loc.module,
                operator=loc.operator,
                phase=loc.phase,
                batch=loc.batch_index,
                operator_input_ranges=loc.input_ranges,
                output=loc.output,
            )
        else:
            evidence = Fp32NonfiniteEvidence(
                step=step,
                loss_first_nonfinite=fp32.first_nonfinite_loss,
                grads_first_nonfinite=fp32.first_nonfinite_grads,
            )
        code = ""
        summary = f"Fix the model or learning rate{where}, then diagnose again; mixed-precision settings cannot help."
        if loc and loc.operator in ("aten::log", "aten::log2", "aten::log10"):
            code = "x = torch.log(x.clamp_min(1e-12))   # log(0) = -inf"
        elif loc and loc.operator in ("aten::div", "aten::reciprocal", "aten::rsqrt"):
            code = "y = x / (d + 1e-12)   # guard the denominator"
        elif loc and "infinite inputs" in loc.note and "softmax" in loc.operator:
            summary = (
                f"A softmax{where} met a row that is -inf everywhere (every key masked): its output is NaN. "
                "Keep at least one unmasked key per query (drop or fix the empty rows), or mask with a finite "
                "value; mixed-precision settings cannot help."
            )
            code = "scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)"
        found = self.finding(
            f"FP32 training goes non-finite at step {step}{where}: the data, learning rate or model is at fault, not precision",
            evidence,
            Fix(summary, code=code),
        )
        # a symptom, not yet the answer: the intervention search looks for what repairs FP32 as well
        return [replace(found, needs_search=True)]
