"""A capsule's watched run broke in an update before anything overflowed: its loss jumped and stayed up.

The watch records every step's loss, whether the scaler skipped it and its
learning rate; the capsule keeps the last of them. Where that history shows the
loss at least ``LOSS_JUMP`` times the median of the steps before, right after a
step the optimizer applied with a finite loss, before any skip or non-finite
loss, and the loss stays that high on the batches that follow (skipped steps
leave the weights as they are: the same weights failing on other batches), the
update broke the model, not fp16's range. A loss can also jump for reasons of its
own (a term switched on, more micro-batches summed): so the capsule's FP32
replay must show the updates running away too, its loss moving ``LOSS_JUMP``
times its start over its few steps from the captured state (a step that size
moves the model's outputs by orders of magnitude, in full precision). Then the
skips, overflows and gaps the replay measures are what the broken model's
gradients do: no loss-scale or precision setting repairs them (a learning rate
too high for the model, no warm-up, a gradient not clipped).

The capsule holds the state after the jump, so its replay cannot run the update
that made it: this finding is not verified, and it hides the findings measured
on that state (a precision gap, an overflow, a scale). Only a run from before
the jump can try a lower learning rate: ``diagnose`` on a training file runs the
FP32 twin from the start, or the watch again from a checkpoint before it.

Evidence: the watch's history, as the capsule's manifest keeps it: the step
whose update preceded the jump, its learning rate and gradient norm, the losses
before, at and after the jump, and the steps after it that were skipped; and the
FP32 replay's first and last loss. A fresh scaler's leading skips (its
calibration: the weights did not move) are not the trouble the jump must precede.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import ClassVar

from ...engine.records import Column
from ...measure.thresholds import LOSS_JUMP, SPIKE_BASELINE_ROWS
from .. import rule_cases as fx
from ..findings import CapsuleReplay, Evidence, EvidenceRecord, Finding, Fix, WatchedStep
from . import Rule


@dataclass(frozen=True)
class LossJumpEvidence(EvidenceRecord):
    """Where the watched run's loss jumped, read off the capsule's history."""

    capsule_step: int
    """The optimizer step the capsule holds."""
    update_step: int
    """The step whose update (applied, its loss finite) the jump came right after."""
    jump_step: int
    """The first step whose loss jumped."""
    lr: float | None
    """The learning rate of that update (None: not recorded)."""
    grad_norm: float | None
    """That update's unscaled gradient norm (None: not read at that step)."""
    loss_before: float
    """The median loss of the steps before the jump (at most 20)."""
    loss_at_jump: float
    loss_after: float
    """The median finite loss from the jump to the capsule's step: the jump held."""
    steps_after: int
    """Steps from the jump to the capsule's, the jump's included."""
    skipped_after: int
    """Of those, the ones the scaler skipped: the same weights, on other batches."""
    first_update: bool
    """The update was the watched run's first applied one, the watch having begun at its start: no warm-up."""
    fp32_replay_losses: list[float]
    """The capsule's FP32 replay's first and last loss: it moved at least ``LOSS_JUMP`` times its start."""


def jump_case(losses: list[float], skipped: list[int], lr: float = 0.3, fp32: list[float] | None = None) -> Evidence:
    """A capsule whose history holds ``losses`` (one per step from 0), ``skipped`` the steps the scaler skipped;
    ``fp32``: its FP32 replay's losses (by default running away, as an update too large makes them)."""
    history = [WatchedStep(step, loss, step in skipped, lr=lr) for step, loss in enumerate(losses)]
    replay = CapsuleReplay(step=len(losses) - 1, history_finite=True, history=history)
    amp = fx.probe(record=fx.records(steps=4, skipped=[0, 1, 3]))
    replayed = fx.records(steps=4, losses=fp32 or [251.0, -3e3, -4e4, -1.8e5])
    return fx.evidence(amp=amp, fp32=fx.probe("fp32", replayed), capsule=replay)


class LossJump(Rule):
    code = "loss-jump"
    order = 28
    evidence_type: ClassVar[type[EvidenceRecord]] = LossJumpEvidence
    explains = (
        "skips",
        "nonfinite",
        "amp-exception",
        "fp32-nonfinite",
        "trajectory-drift",
        "same-state-gap",
        "lost-updates",
    )
    verifiable = False
    settles_suppressed = True
    capsule_only = True
    fires_on = (
        lambda: jump_case([5.0, 249.8, 247.0, 253.1, 251.2, 251.4], skipped=[1, 2, 3, 4, 5]),
        lambda: jump_case([2.1, 2.0, 1.9, 2.0, 41.0, 38.0, 40.0], skipped=[5, 6], lr=1e-3),
        # a fresh scaler's calibration skips first: the trouble is what follows the first applied update
        lambda: jump_case([5.0, 5.0, 5.0, 249.8, 247.0, 253.1], skipped=[0, 1, 3, 4, 5]),
    )
    quiet_on = (
        # one bad batch: the loss comes back on the next ones
        lambda: jump_case([2.1, 2.0, 1.9, 2.0, 41.0, 2.0, 1.9], skipped=[4]),
        # the skips began first: the jump is theirs, not the update's
        lambda: jump_case([2.1, 2.0, 1.9, 2.0, 41.0, 38.0], skipped=[3, 4, 5]),
        # a loss that only rises a little
        lambda: jump_case([2.1, 2.0, 1.9, 5.0, 6.0, 5.5], skipped=[4, 5]),
        # a non-finite loss before the jump
        lambda: jump_case([2.1, math.nan, 1.9, 2.0, 41.0, 38.0], skipped=[1, 5]),
        # the loss jumped (a term switched on, more micro-batches summed), but FP32's updates do not run away
        lambda: jump_case([2.1, 2.0, 1.9, 2.0, 41.0, 38.0, 40.0], skipped=[5, 6], fp32=[40.0, 39.5, 39.2, 38.8]),
    )
    suppresses = (
        "fp32-divergence",
        "fp32-loss-rises",
        "divisor-underflow",
        "activation-overflow",
        "backward-overflow",
        "scale-overflow",
        "grad-underflow",
        "scale-growth",
        "precision-gap",
        "bf16-advice",
    )
    nothing_to_try = "the capsule holds the state after the jump, not the update that made it: no intervention on its replay can tell"

    def check(self, ev: Evidence) -> list[Finding]:
        replayed = fp32_replay_losses(ev)
        if ev.capsule is None or replayed is None:
            return []
        jump = loss_jump(ev.capsule, replayed)
        if jump is None:
            return []
        return [self.finding(self._title(jump), jump, self._fix(jump))]

    @staticmethod
    def _title(j: LossJumpEvidence) -> str:
        held = f"and stayed there through step {j.capsule_step}" + (
            f" ({j.skipped_after} of those {j.steps_after} steps skipped: the same weights, on other batches)"
            if j.skipped_after
            else ""
        )
        lr = f" (lr {j.lr:.3g})" if j.lr is not None else ""
        return (
            f"The watched run's loss jumped {j.loss_at_jump / j.loss_before:.0f}x ({j.loss_before:.4g} to "
            f"{j.loss_at_jump:.4g}) at step {j.jump_step}, right after step {j.update_step}'s update{lr}, {held}: the "
            f"update broke the model before anything overflowed, and what the replay of step {j.capsule_step} "
            f"measures follows from it"
        )

    @staticmethod
    def _fix(j: LossJumpEvidence) -> Fix:
        lr = f" (it ran at lr {j.lr:.3g})" if j.lr is not None else ""
        first = " It was the run's first update: warm the rate up from a small fraction." if j.first_update else ""
        again = "from its start" if j.first_update else f"from a checkpoint before step {j.update_step}"
        return Fix(
            f"Make the update smaller: lower the learning rate{lr}, warm it up, or clip the gradient norm after "
            f"scaler.unscale_(optimizer).{first} No loss-scale or precision setting repairs a model an update "
            f"broke. Not verified: the capsule holds the state after the jump, so its replay cannot run the update "
            f"that made it; diagnose the training file itself (its FP32 twin runs from the start), or watch it again "
            f"{again}.",
            code="# a tenth of the rate, warmed up over the first 100 steps\n"
            "scheduler = torch.optim.lr_scheduler.LambdaLR(\n"
            "    optimizer, lambda step: 0.1 * min(1.0, (step + 1) / 100))\n"
            "...\n"
            "scaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()\n"
            "scheduler.step()",
        )


def fp32_replay_losses(ev: Evidence) -> list[float] | None:
    """The FP32 replay's first and last loss where its loss moved at least ``LOSS_JUMP`` times its start (the
    updates run away in full precision too); else None."""
    if ev.fp32 is None or ev.fp32.records.empty:
        return None
    losses = [float(v) for v in ev.fp32.records[Column.LOSS]]
    first, last = losses[0], losses[-1]
    if not math.isfinite(first) or first == 0:
        return None
    ran_away = not math.isfinite(last) or abs(last - first) >= LOSS_JUMP * abs(first)
    return [first, last] if ran_away else None


def loss_jump(capsule: CapsuleReplay, replayed: list[float]) -> LossJumpEvidence | None:
    """The first jump in the capsule's history right after an applied update (a fresh scaler's leading skips are
    its calibration: nothing moved), before any later skip or non-finite loss, and that held."""
    rows = sorted(capsule.history, key=lambda r: r.step)
    applied = next((i for i, r in enumerate(rows) if not r.skipped), None)
    if applied is None:
        return None
    rows_after = rows[applied:]
    trouble = next((i for i, r in enumerate(rows_after) if r.skipped or _finite(r.loss) is None), len(rows_after))
    for at in range(1, min(trouble + 1, len(rows_after))):
        update, loss = rows_after[at - 1], _finite(rows_after[at].loss)
        before = _finite_losses(rows_after[max(0, at - SPIKE_BASELINE_ROWS) : at])
        baseline = statistics.median(before) if before else 0.0
        if baseline <= 0 or loss is None or loss < LOSS_JUMP * baseline:
            continue
        after = _finite_losses(rows_after[at:])
        held = statistics.median(after)
        if len(after) < 2 or held < LOSS_JUMP * baseline:
            return None  # the first jump came back down: one batch, not the weights
        return LossJumpEvidence(
            capsule_step=capsule.step,
            update_step=update.step,
            jump_step=rows_after[at].step,
            lr=update.lr,
            grad_norm=update.grad_norm,
            loss_before=baseline,
            loss_at_jump=loss,
            loss_after=held,
            steps_after=len(rows_after) - at,
            skipped_after=sum(r.skipped for r in rows_after[at:]),
            first_update=at == 1 and rows[0].step == 0,
            fp32_replay_losses=replayed,
        )
    return None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _finite_losses(rows: list[WatchedStep]) -> list[float]:
    return [loss for loss in (_finite(r.loss) for r in rows) if loss is not None]
