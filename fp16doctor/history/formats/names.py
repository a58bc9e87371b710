"""The names frameworks log each quantity under, for the formats that store whatever the training logs by name
(Lightning's CSVLogger, TensorBoard event files, W&B's history).

Each list is in order of preference; the first name a history holds is read. Where each name comes from:

* Hugging Face ``Trainer`` (its TensorBoard and W&B callbacks prefix ``train/``): ``loss``, ``grad_norm``,
  ``learning_rate``;
* Lightning: whatever ``self.log`` is given (``train_loss``, ``loss``; ``_step`` when logged per step and per
  epoch), ``LearningRateMonitor``'s ``lr-<Optimizer>``, ``grad_norm()``'s ``grad_2.0_norm_total``;
* DeepSpeed's monitor: ``Train/Samples/train_loss``, ``Train/Samples/lr``, ``Train/Samples/loss_scale``;
* Megatron-LM's TensorBoard writer: ``lm loss``, ``learning-rate``, ``loss-scale``, ``grad-norm``;
* fairseq's TensorBoard writer: ``loss``, ``lr``, ``gnorm``, ``loss_scale``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..records import Quantity

NAMES: dict[Quantity, tuple[str, ...]] = {
    Quantity.LOSS: (
        "train/loss",
        "train_loss_step",
        "train_loss",
        "loss_step",
        "loss",
        "train/train_loss",
        "Train/Samples/train_loss",
        "lm loss",
        "training_loss",
    ),
    Quantity.LOSS_SCALE: (
        "train/loss_scale",
        "loss_scale",
        "loss-scale",
        "Train/Samples/loss_scale",
        "scale",
        "grad_scale",
    ),
    Quantity.SKIPPED: ("train/skipped", "skipped", "skipped_steps"),
    Quantity.GRAD_NORM: (
        "train/grad_norm",
        "grad_norm",
        "grad_2.0_norm_total",
        "grad-norm",
        "gnorm",
        "train/gnorm",
        "grad_norm_step",
    ),
    Quantity.LR: ("train/learning_rate", "learning_rate", "lr", "learning-rate", "Train/Samples/lr", "train/lr"),
}

LR_MONITOR = re.compile(r"^lr-[A-Za-z0-9_]+$")
"""Lightning's ``LearningRateMonitor`` names the LR ``lr-<Optimizer class>`` (``lr-AdamW``; ``/pg1`` per group)."""

STEP_NAMES = ("train/global_step", "trainer/global_step", "global_step", "step", "_step")
"""The step column, in order of preference (W&B's own ``_step`` counts its log calls, not optimizer steps)."""


def pick(keys: Iterable[str]) -> dict[Quantity, str]:
    """Which of ``keys`` holds each quantity (the first name of its list that is there)."""
    available = list(keys)
    present = set(available)
    chosen: dict[Quantity, str] = {}
    for quantity, names in NAMES.items():
        found = next((n for n in names if n in present), None)
        if found is None and quantity is Quantity.LR:
            found = next((k for k in available if LR_MONITOR.match(k)), None)
        if found is not None:
            chosen[quantity] = found
    return chosen


IF_LOGGED = "when logged, under "
"""How a format that stores whatever the training logs by name declares a quantity (the reference's "if logged")."""


def logged_as(quantity: Quantity) -> str:
    """A keyed format's declaration of ``quantity``: carried when logged, under these names."""
    return IF_LOGGED + names_text(quantity)


def names_text(quantity: Quantity) -> str:
    """The names, for the formats reference."""
    extra = ", ``lr-<Optimizer>``" if quantity is Quantity.LR else ""
    return ", ".join(f"``{n}``" for n in NAMES[quantity]) + extra


def keyed_carries() -> dict[Quantity, str]:
    """What a format of named scalars (a CSV's columns, TensorBoard's tags, W&B's keys) carries: every quantity
    logged under one of its names, the skips also read off a logged scale falling."""
    carries = {quantity: logged_as(quantity) for quantity in KEYED_QUANTITIES}
    carries[Quantity.SKIPPED] += "; else read off a logged scale falling"
    return carries


KEYED_QUANTITIES = (Quantity.LOSS, Quantity.LOSS_SCALE, Quantity.SKIPPED, Quantity.GRAD_NORM, Quantity.LR)
