"""The canonical AMP training step, and the default loss.

Every probe, and later the corrected training run, uses this step unless the
training file brings its own ``train_step``. Each line sits where it does for
a reason, stated beside it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..errors import BatchError

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The contract's default: ``model(**batch).loss`` for dicts, ``cross_entropy(model(x), y)`` for pairs (the
    output's ``logits`` for a Hugging Face style output)."""
    if isinstance(batch, Mapping):
        _check_keywords(model, batch)
        loss = output_field(model(**batch), "loss")
        if loss is None:
            raise BatchError(
                "the batch is a dict but the model's output has no `.loss`.",
                hint="Define loss(model, batch) in the training file to say how the loss is computed.",
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        inputs, targets = batch
        return F.cross_entropy(_logits(model(inputs)), targets)
    raise BatchError(
        f"no default loss for a batch of type {type(batch).__name__}"
        + (f" with {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        + ".",
        hint="Define loss(model, batch) in the training file (the default handles (x, y) pairs and Hugging Face style dicts).",
    )


def output_field(output: Any, name: str) -> Any:
    """A named field of a model's output, Hugging Face style: a mapping's key (``ModelOutput`` is a dict),
    else an attribute; None when it has none."""
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def _logits(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, or the ``logits`` of a Hugging Face style output."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output_field(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    raise BatchError(
        f"the batch is an (x, y) pair, so the default loss is cross_entropy(model(x), y), but the model returned "
        f"a {type(output).__name__}, not logits.",
        hint="Define loss(model, batch) in the training file to say how the loss is computed.",
    )


def _check_keywords(model: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """A dict batch is passed as keyword arguments: a forward that cannot take them is a contract
    mismatch (bad input), not an exception of the training to diagnose."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return  # a builtin or wrapped forward: let the call speak
    try:
        signature.bind(**batch)
    except TypeError as exc:
        raise BatchError(
            f"the batch is a dict, so the default loss calls model(**batch).loss, but {type(model).__name__}.forward "
            f"cannot take the keys {sorted(batch)}: {exc}.",
            hint="Define loss(model, batch) in the training file to say how the loss is computed.",
        ) from exc


def canonical_step(
    model: torch.nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    autocast: Callable[[], Any],
    loss_fn: LossFn = default_loss,
    max_grad_norm: float | None = None,
) -> torch.Tensor:
    """One AMP step in PyTorch's documented order."""
    # Clear last step's gradients first (set_to_none frees them): clearing at the start rather
    # than the end keeps this step's gradients readable by the instruments after it returns.
    optimizer.zero_grad(set_to_none=True)
    # Forward and loss under autocast: matmuls/convolutions run in low precision, the ops on
    # autocast's fp32 list (softmax, log, losses) in fp32. Parameters stay fp32 master weights.
    with autocast():
        loss = loss_fn(model, batch)
    # Backward on the scaled loss, outside autocast (backward ops run in the forward's dtypes):
    # scaling lifts small fp16 gradients above 2^-24 so they do not flush to zero.
    scaler.scale(loss).backward()
    # Unscale in place before anything reads gradient magnitudes: clipping scaled gradients would
    # use a threshold off by the scale factor. This also records inf/NaN for the skip decision.
    scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    # Steps the optimizer unless inf/NaN was found; then the step is skipped (silently).
    scaler.step(optimizer)
    # Adjusts the scale once per iteration: halve after a skip, grow after growth_interval clean steps.
    scaler.update()
    return loss


def micro_batched_step(
    model: torch.nn.Module,
    micro_batches: list[tuple[Any, float]],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    autocast: Callable[[], Any],
    loss_fn: LossFn = default_loss,
    max_grad_norm: float | None = None,
    after_backward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """:func:`canonical_step` with the batch cut into micro-batches, ``(micro-batch, its share of the rows)``:
    the same update up to summation order, for a loss that is a mean over the batch's rows (the FP32
    probes use it to hold one micro-batch's activations at a time, see :mod:`fp16doctor.engine.microbatch`)."""
    if not micro_batches:
        raise ValueError("a step needs at least one micro-batch")
    # Clear last step's gradients once, before the first micro-batch: every backward below adds to them.
    optimizer.zero_grad(set_to_none=True)
    total: torch.Tensor | None = None
    for batch, share in micro_batches:
        # Forward and loss under autocast, as in the whole step (in the FP32 baseline autocast is off).
        with autocast():
            loss = loss_fn(model, batch)
        # Backward on the loss weighted by this micro-batch's share of the rows: the mean over the whole
        # batch is the weighted sum of the micro-batch means, so the summed gradients are the whole
        # batch's. Backward frees this micro-batch's graph before the next forward builds its own.
        scaler.scale(loss * share).backward()
        # The reported loss is the same weighted sum, detached: no graph outlives its micro-batch.
        part = loss.detach() * share
        total = part if total is None else total + part
        # Whoever watches the step (the probe's instruments) takes this micro-batch's statistics now, so
        # that its tensors go too.
        if after_backward is not None:
            after_backward()
    # From here on, once per step, as in the whole step: unscale before anything reads gradient
    # magnitudes (clipping), then step (skipped on inf/NaN), then adjust the scale.
    scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    return cast(torch.Tensor, total)
