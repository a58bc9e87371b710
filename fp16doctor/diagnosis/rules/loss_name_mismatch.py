"""The training file names its loss (or its training step) differently from the contract, so the doctor
ignored it and trained with its own default.

Evidence: the file defines no ``loss(model, batch)`` (or no ``train_step``) but defines, at its top level,
a callable named like one (``loss_fn``, ``compute_loss``, ``criterion``, ``get_loss``, any function with
"loss" in its name; ``training_step``, ``train_one_step``, ``step``): the loader reads the contract's names
only (:data:`fp16doctor.userfile.spec.NEAR_MISSES`). The probes then computed the default loss,
``cross_entropy(model(x), y)`` for ``(x, y)`` batches (``model(**batch).loss`` for dicts), which on a
regression model is not the training's loss at all (on one output it is 0 at every step). A warning: the
diagnosis measured a training, only not necessarily the user's. A file with a ``train_step`` computes its
loss there, so a loss near miss beside it is not reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix, Severity, omitted_when_none
from . import Rule

DEFAULT_LOSS = "cross_entropy(model(x), y) for (x, y) batches, model(**batch).loss for dicts"
"""The doctor's default loss (:func:`fp16doctor.userfile.loop.default_loss`), as the finding names it."""


@dataclass(frozen=True)
class NearMissEvidence(EvidenceRecord):
    """A top-level callable named like a contract function the file lacks, which the loader ignored."""

    ignored: str
    """The callable's name (the first of the near misses)."""
    signature: str
    also_ignored: list[str]
    """The other near misses of the same contract function."""
    contract: str
    """The contract function the loader looked for, with its parameters."""


@dataclass(frozen=True)
class LossNearMissEvidence(NearMissEvidence):
    """A callable named like ``loss`` in a file without ``loss()`` or ``train_step()``: the default loss ran."""

    default_loss: str
    """The doctor's default loss, which the probes computed instead."""


@dataclass(frozen=True)
class StepNearMissEvidence(NearMissEvidence):
    """A callable named like ``train_step`` in a file without one: the doctor's own training step ran."""

    default_loss: str | None = omitted_when_none()
    """The doctor's default loss, when the file has no ``loss()`` either."""


class LossNameMismatch(Rule):
    code = "loss-name-mismatch"
    severity = Severity.WARNING
    """The file ran, with the doctor's loss in place of the one it meant: nothing precision-related to fix."""
    order = 5
    evidence_type: ClassVar[type[EvidenceRecord]] = LossNearMissEvidence
    verifiable = False
    fires_on = (
        lambda: fx.evidence(uses_default_loss=True, near_misses={"loss": {"loss_fn": "(model, batch)"}}),
        lambda: fx.evidence(uses_default_loss=True, near_misses={"loss": {"criterion": "(input, target)"}}),
        lambda: fx.evidence(
            uses_default_loss=True,
            near_misses={"train_step": {"training_step": "(model, batch, optimizer, scaler, autocast)"}},
        ),
    )
    quiet_on = (
        lambda: fx.evidence(uses_default_loss=True),  # nothing named like a loss: the default was meant
        lambda: fx.evidence(has_train_step=True, near_misses={"loss": {"loss_fn": "(model, batch)"}}),
    )  # train_step computes it

    nothing_to_try = "the fix is renaming a function in the training file"

    def check(self, ev: Evidence) -> list[Finding]:
        findings = []
        losses = ev.near_misses.get("loss") or {}
        if losses and not ev.has_train_step:
            findings.append(self._loss_finding(losses))
        steps = ev.near_misses.get("train_step") or {}
        if steps and not ev.has_train_step:
            findings.append(self._step_finding(steps, ev))
        return findings

    def _loss_finding(self, found: dict[str, str]) -> Finding:
        name, signature = next(iter(found.items()))
        if _parameters(signature) == ["model", "batch"]:  # the contract's function under another name
            code = f"def loss(model, batch):          # was: def {name}{signature}"
            how = f"Rename `{name}` to `loss`"
        else:
            code = f"def loss(model, batch):\n    x, y = batch\n    return {name}(model(x), y)"
            how = f"Define `loss(model, batch)` that calls `{name}`"
        others = [n for n in found if n != name]
        return self.finding(
            f"The training file defines `{name}{signature}` but no `loss(model, batch)`: the doctor ignored it and "
            f"trained with its default loss ({DEFAULT_LOSS}), which may not be the loss you meant",
            LossNearMissEvidence(
                ignored=name,
                signature=signature,
                also_ignored=others,
                contract="loss(model, batch)",
                default_loss=DEFAULT_LOSS,
            ),
            Fix(
                f"{how}: the doctor reads only the name `loss` (with `train_step` it reads none). Then diagnose "
                "again: every measurement so far was of the default loss.",
                code=code,
            ),
        )

    def _step_finding(self, found: dict[str, str], ev: Evidence) -> Finding:
        name, signature = next(iter(found.items()))
        loss = f"its default loss ({DEFAULT_LOSS})" if ev.uses_default_loss else "the file's loss()"
        what = f"its own training step with {loss}"
        return self.finding(
            f"The training file defines `{name}{signature}` but no `train_step(model, batch, optimizer, scaler, autocast)`: "
            f"the doctor ignored it and ran {what}",
            StepNearMissEvidence(
                ignored=name,
                signature=signature,
                also_ignored=[n for n in found if n != name],
                contract="train_step(model, batch, optimizer, scaler, autocast)",
                default_loss=DEFAULT_LOSS if ev.uses_default_loss else None,
            ),
            Fix(
                f"Rename `{name}` to `train_step` (its arguments: model, batch, optimizer, scaler, autocast), then "
                "diagnose again.",
                code=f"def train_step(model, batch, optimizer, scaler, autocast):   # was: {name}",
            ),
        )


def _parameters(signature: str) -> list[str]:
    """The parameter names of a signature string such as ``(model, batch) -> torch.Tensor``."""
    inside = signature[1 : signature.find(")")] if signature.startswith("(") else ""
    names = [p.split(":")[0].split("=")[0].strip().lstrip("*") for p in inside.split(",")]
    return [n for n in names if n and n != "/"]
