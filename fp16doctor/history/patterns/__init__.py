"""The patterns an expert reads off a run's history, one per module, each naming the doctor's own symptom and
cause codes where the history carries the signal.

A pattern returns :class:`LogFinding` records: the steps, how sure the logs alone can make it
(:class:`Certainty`), and its evidence as a frozen record declared beside it. The next command is added by
:func:`classify` from what was found beside the logs (a capsule, the checkpoint nearest before the trouble).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, ClassVar

from ...files import jsonable
from ..records import History
from ._series import nonfinite_steps

MAX_STEPS_LISTED = 30
"""Steps a finding lists (the first ones); ``first_step`` and ``last_step`` bound them all."""


class Certainty(StrEnum):
    """How sure a finding can be from the logs alone."""

    SHOWN = "shown"
    """The log states it: the numbers are in the rows (a scale at its minimum, skips in a row)."""
    LIKELY = "likely"
    """The pattern matches what the cause leaves in a log; another cause could leave it too."""
    POSSIBLE = "possible"
    """A coincidence in time the logs cannot confirm: measuring it (``diagnose``) can."""


@dataclass(frozen=True)
class PatternEvidence:
    """The numbers a pattern read off the history: each pattern's own record, whose fields are the keys of the
    finding's ``evidence`` (listed per pattern under "Evidence by pattern")."""

    def to_json(self) -> dict[str, Any]:
        return {k: jsonable(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class LogFinding:
    """One pattern in the history: where, what it means in the doctor's codes, how sure, and what to run next."""

    pattern: str
    """The pattern's name (the logs page lists them)."""
    title: str
    """The finding in a sentence, with its numbers."""
    cause: str | None
    """The doctor's cause code this pattern points at (the causes reference); null: the logs cannot name one."""
    symptoms: list[str]
    """The doctor's symptom codes the history shows."""
    steps: list[int]
    """The steps the pattern covers (the first 30)."""
    first_step: int
    """The first step of the trouble (the steps listed may stop before ``last_step``)."""
    last_step: int
    """The last step of the trouble."""
    certainty: Certainty
    reason: str
    """Why it is as sure as it is, and what the logs cannot tell."""
    evidence: PatternEvidence
    """The pattern's own record of the numbers it read (per pattern: "Evidence by pattern")."""
    next_command: str = ""
    """What to run next: ``diagnose --capsule`` for a capsule's history, ``diagnose --from-checkpoint`` with the
    checkpoint nearest before ``first_step`` when one is beside the logs, else ``watch``."""
    next_reason: str = ""
    """Why that command."""

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "title": self.title,
            "cause": self.cause,
            "symptoms": self.symptoms,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "certainty": self.certainty.value,
            "reason": self.reason,
            "evidence": self.evidence.to_json(),
            "next_command": self.next_command,
            "next_reason": self.next_reason,
        }


class Pattern:
    """One pattern: ``check`` reads the history and returns its findings (none when it is not there)."""

    name: ClassVar[str]
    evidence_type: ClassVar[type[PatternEvidence]]
    needs: ClassVar[tuple[str, ...]]
    """The quantities the history must carry for the pattern to be looked for."""
    subsumed_by: ClassVar[tuple[str, ...]] = ()
    """Patterns whose finding over the same steps already says this one's (a collapse holds its skip streak)."""

    def check(self, history: History) -> list[LogFinding]:
        raise NotImplementedError

    @classmethod
    def doc(cls) -> str:
        import inspect

        return inspect.getdoc(inspect.getmodule(cls)) or ""

    def applies(self, history: History) -> bool:
        return all(history.has(q) for q in self.needs)

    def finding(
        self,
        title: str,
        steps: list[int],
        certainty: Certainty,
        reason: str,
        evidence: PatternEvidence,
        cause: str | None = None,
        symptoms: tuple[str, ...] = (),
    ) -> LogFinding:
        return LogFinding(
            pattern=self.name,
            title=title,
            cause=cause,
            symptoms=list(symptoms),
            steps=steps[:MAX_STEPS_LISTED],
            first_step=min(steps),
            last_step=max(steps),
            certainty=certainty,
            reason=reason,
            evidence=evidence,
        )


def all_patterns() -> list[Pattern]:
    from .fp32_reference import BehindFp32
    from .grad_norm_growth import GradNormGrowth
    from .lr_peak import LrPeakTrouble
    from .nonfinite_loss import NonfiniteLoss
    from .pinned_stall import PinnedStall
    from .recurring_overflow import RecurringOverflow
    from .scale_collapse import ScaleCollapse
    from .skip_streak import SkipStreak

    return [
        ScaleCollapse(),
        RecurringOverflow(),
        SkipStreak(),
        LrPeakTrouble(),
        GradNormGrowth(),
        PinnedStall(),
        NonfiniteLoss(),
        BehindFp32(),
    ]


def _covered(finding: LogFinding, by: LogFinding, nonfinite: set[int]) -> bool:
    """``by`` already explains where ``finding`` starts (a NaN loss inside a collapse, a streak inside it); a
    non-finite loss explains only skips at its own steps (``nonfinite``), not others between two NaNs."""
    if by.pattern == "nonfinite-loss":
        return finding.first_step in nonfinite
    return by.first_step <= finding.first_step <= by.last_step


def classify(history: History, reference: History | None = None) -> list[LogFinding]:
    """Every pattern's findings, in the order trouble starts; a finding another pattern's covers is left out."""
    found: list[LogFinding] = []
    for pattern in all_patterns():
        if isinstance(pattern, ReferencePattern):
            if reference is not None and pattern.applies(history) and reference.has("loss"):
                found += pattern.compare(history, reference)
        elif pattern.applies(history):
            found += pattern.check(history)
    by_name = {type(p).name: p for p in all_patterns()}

    def depth(name: str) -> int:
        return 1 + max((depth(o) for o in by_name[name].subsumed_by), default=-1)

    kept: list[LogFinding] = []
    nonfinite = set(nonfinite_steps(history))
    # a finding is left out only for one that is kept: those that may cover others are decided first
    for f in sorted(found, key=lambda f: depth(f.pattern)):
        if not any(o.pattern in by_name[f.pattern].subsumed_by and _covered(f, o, nonfinite) for o in kept):
            kept.append(f)
    return sorted(kept, key=lambda f: (f.first_step, f.pattern))


class ReferencePattern(Pattern):
    """A pattern read against an FP32 run's history (``--reference``)."""

    def check(self, history: History) -> list[LogFinding]:
        return []

    def compare(self, history: History, reference: History) -> list[LogFinding]:
        raise NotImplementedError


def with_next(finding: LogFinding, command: str, reason: str) -> LogFinding:
    return replace(finding, next_command=command, next_reason=reason)
