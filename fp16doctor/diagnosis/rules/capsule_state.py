"""A capsule's replay is non-finite in FP32 from its first step, though the watched run was finite up to the alarm.

That is first a question about the capsule, not about FP32: the replay starts
from the state the capsule holds, and a model that writes to itself in its
forward (a memory module's buffers, a cache on a module attribute) leaves in
that state what the failing forward wrote, NaN where that forward overflowed.
The watch keeps such state as the step found it and puts it back in the
capsule; what it could not put back (written in place where it held no copy,
a list or dict changed) its manifest lists. This finding names that state, or
the entries of the replay's starting state that hold inf or NaN, instead of
blaming FP32.

Evidence: the watch's record (its history finite before the alarm, the state
restored and not captured), the FP32 replay's first step non-finite, the
non-finite entries of the state the replay starts from, and batches that hold
no inf or NaN themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import rule_cases as fx
from ..findings import CapsuleReplay, Evidence, EvidenceRecord, Finding, Fix
from . import Rule


@dataclass(frozen=True)
class CapsuleStateEvidence(EvidenceRecord):
    """What the capsule holds of the state its step started from, and the FP32 replay that fails from its start."""

    capsule_step: int
    """The optimizer step the capsule holds (the watched run was finite before it)."""
    fp32_first_nonfinite_step: int
    """The FP32 replay's first non-finite step: its first."""
    uncaptured: list[str]
    """State the model's forward changed that the watch could not put back (``module.attribute``)."""
    nonfinite_state: list[str]
    """Entries of the model state the replay starts from that hold inf or NaN."""
    restored: list[str]
    """State the forward wrote that the capsule did put back as the step started."""


def capsule_case(uncaptured: list[str], nonfinite: list[str], history_finite: bool = True) -> Evidence:
    """A capsule whose FP32 replay is NaN from its first step."""
    replay = CapsuleReplay(
        step=6, history_finite=history_finite, uncaptured=uncaptured, nonfinite_state=nonfinite, restored=[]
    )
    return fx.evidence(
        fp32=fx.probe("fp32", fx.records(steps=4, nonfinite_loss=[0, 1, 2, 3])),
        amp=fx.probe(record=fx.records(steps=4, nonfinite_loss=[0, 1, 2, 3])),
        capsule=replay,
    )


class CapsuleState(Rule):
    code = "capsule-state"
    order = 2
    evidence_type: ClassVar[type[EvidenceRecord]] = CapsuleStateEvidence
    explains = ("fp32-nonfinite", "nonfinite", "skips", "amp-exception", "trajectory-drift", "same-state-gap")
    verifiable = False
    capsule_only = True
    fires_on = (
        lambda: capsule_case(uncaptured=["bank.queue"], nonfinite=[]),
        lambda: capsule_case(uncaptured=[], nonfinite=["memory.memory"]),
    )
    quiet_on = (
        lambda: capsule_case(uncaptured=[], nonfinite=[]),  # the state is whole: FP32's failure is FP32's
        lambda: capsule_case(uncaptured=["bank.queue"], nonfinite=[], history_finite=False),
    )
    suppresses = (
        "fp32-divergence",
        "unstable-loss",
        "scale-overflow",
        "scale-growth",
        "activation-overflow",
        "loss-in-half",
        "grad-underflow",
        "lr-schedule-peak",
        "precision-gap",
        "scheduler-skip-drift",
        "bf16-advice",
        "fp32-loss-rises",
    )
    nothing_to_try = "the capsule lacks the state the step started from: no intervention on its replay can tell"

    def check(self, ev: Evidence) -> list[Finding]:
        capsule, fp32 = ev.capsule, ev.fp32
        if capsule is None or not capsule.history_finite or fp32 is None or fp32.finite or fp32.exception:
            return []
        first = min(s for s in (fp32.first_nonfinite_loss, fp32.first_nonfinite_grads) if s is not None)
        suspects = [*capsule.uncaptured, *(s for s in capsule.nonfinite_state if s not in capsule.uncaptured)]
        if first != 0 or not suspects or any(f.nonfinite for f in ev.data):
            return []  # a replay that fails later, or on a batch holding NaN itself, is the training's
        what = ", ".join(f"'{s}'" for s in suspects[:5])
        return [
            self.finding(
                f"The capsule's FP32 replay of optimizer step {capsule.step} is non-finite from its first step, though "
                f"the watched run was finite before it: the capsule does not hold the state the step started from "
                f"({what}), so the replay cannot blame FP32",
                CapsuleStateEvidence(
                    capsule_step=capsule.step,
                    fp32_first_nonfinite_step=first,
                    uncaptured=list(capsule.uncaptured),
                    nonfinite_state=list(capsule.nonfinite_state),
                    restored=list(capsule.restored),
                ),
                Fix(
                    f"The model's forward writes to {what}, and the watch could not keep it as the step found it (it "
                    "keeps buffers and tensor attributes, not lists or dicts it would have to copy): keep that state "
                    "in a registered buffer (a preallocated tensor written in place), then watch again; or diagnose "
                    "the training file itself, from its start.",
                    code="# a memory bank kept in a buffer the watch can copy, not in a Python list\n"
                    "self.register_buffer('queue', torch.zeros(size, dim))\n"
                    "self.queue[self.ptr : self.ptr + n] = feats.detach()",
                ),
            )
        ]
