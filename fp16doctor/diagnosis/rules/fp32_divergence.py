"""The FP32 baseline goes non-finite (or fails) too: not a mixed-precision problem.

Evidence: the fp32 probe's first non-finite step, localised to its module and
operator (a log of zero, a division by zero, a learning rate too high), or the
exception the training raised in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...measure.records import ExceptionInfo
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix
from . import Rule


@dataclass(frozen=True)
class Fp32ExceptionEvidence(EvidenceRecord):
    """The exception the training raised in the FP32 baseline."""

    exception: ExceptionInfo


@dataclass(frozen=True)
class Fp32NonfiniteEvidence(EvidenceRecord):
    """The FP32 baseline's first non-finite step, where the localisation did not run."""

    step: int
    """The first step whose loss or gradients are non-finite."""
    loss_first_nonfinite: int | None
    grads_first_nonfinite: int | None


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
        return [
            self.finding(
                f"FP32 training goes non-finite at step {step}{where}: the data, learning rate or model is at fault, not precision",
                evidence,
                Fix(summary, code=code),
            )
        ]
