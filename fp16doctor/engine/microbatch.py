"""Micro-batched FP32 probes: the FP32 baseline within the AMP training's activation memory.

The FP32 baseline holds fp32 activations where the AMP training holds fp16 ones: about twice the AMP run's
activation memory. On a model whose activations dominate (a transformer at long sequences) that alone puts
the diagnosis far above the training it diagnoses (the memory target: at most 1.5x). An FP32 probe can
instead cut each batch into k micro-batches and add up their gradients: for a loss that is a mean over the
batch's rows it is the same update up to summation order, with one k-th of the activations alive at a time.

:func:`plan_micro_batches` decides k once per workbench, from measurements, never from a guess:

1. **Whether it matters.** The activation bytes autograd saves in one forward and loss of the first batch,
   in FP32 and in AMP, measured on a quarter of its rows (so the measurement never needs the full FP32
   activations) and scaled to the batch. Only where the FP32 activations exceed AMP's by a clear share of
   the training's memory (``MARGIN`` of its model copies plus AMP's activations) is the batch split; else
   k = 1 and the probe is bit for bit what it always was: most files diagnose exactly as before.
2. **How much.** The smallest power of two k (at most ``MAX_MICRO_BATCHES`` and the batch's rows) with the
   FP32 activations / k within AMP's.
3. **Whether it is the same update.** Only if the loss decomposes over rows: the loss and gradients of a
   chunk of the batch, whole and in two halves, must agree (the halves' weighted mean, to fp32 summation
   order). BatchNorm in training mode (statistics over the batch), in-batch contrastive losses, a loss
   normalised by a count over the batch, and dropout (other masks) fail it: k stays 1 and the reason is
   recorded, for the FP32 stage's summary to say.

A file with its own ``train_step`` owns its loop and is never split, nor is a batch whose tensors do not
all share one leading dimension. Planning runs on throw-away probes (built, measured and closed one at a
time, every random generator restored after), so the probes the diagnosis measures are untouched by it; it
runs the file's loss a few extra times on part of the first batch, which is why a workbench plans only
when its caller asked for it (the diagnosis, whose memory target this is).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from ..errors import first_line
from ..precision.autocast_policy import SEES_LOW_PRECISION_SAVES
from ..userfile.batches import batch_rows, first_rows, row_counts, split_rows
from .rng import callers_rng_kept, rng_state, set_rng_state

Measured = TypeVar("Measured")

TRAINING_COPIES = 4
"""Model-sized tensors the AMP training holds before activations: weights, gradients, two Adam moments."""
MARGIN = 0.1
"""Split only when the FP32 activations exceed AMP's by more than this share of the training's memory
(``TRAINING_COPIES`` model copies plus AMP's activations): below it splitting saves too little to be worth
a changed summation order."""
MIN_SAVING = 2**20
"""Nor when the FP32 activations exceed AMP's by under 1 MiB: on a small model that is a fraction of what any
process holds, and not worth a changed summation order (the share test alone splits tiny models)."""
MAX_MICRO_BATCHES = 8
"""More micro-batches save little more (the model copies stay) and cost a forward each."""
MEASURED_SHARE = 4
"""The activations are measured on the first 1/4 of the batch's rows (and on half of that): a line through
the two gives the bytes per row and the bytes that do not grow with the rows (AMP's low-precision copies of
the weights), so the measurement never needs the whole batch's FP32 activations."""
LOSS_RTOL = 1e-5
"""Whole against halves, loss: fp32 means of a few thousand values agree to about 1e-7."""
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
"""Whole against halves, gradients: element-wise, with the absolute part relative to the gradient's norm
(elements that cancel to near zero have no relative precision)."""


class LossProbe(Protocol):
    """What planning needs of a probe: its model, its loss as its step computes it, and a way to let it go."""

    model: torch.nn.Module

    def loss_of(self, batch: Any) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MicroBatchPlan:
    """How an FP32 probe cuts its batches, and why."""

    count: int = 1
    """Micro-batches per batch (1: the batch whole, as always)."""
    reason: str = ""
    """Why this count: the measurement, or why the batch is not split."""
    fp32_bytes: int | None = None
    """Activation bytes one FP32 forward and loss of the first batch saves (None: not measured)."""
    amp_bytes: int | None = None
    """The same in AMP."""
    needed: bool = False
    """The FP32 activations exceed AMP's by more than ``MARGIN``: splitting was wanted (with ``count == 1``: refused)."""
    detail: str = ""
    """What the reason rests on (a refusal's numbers: the chunk's loss whole and from its halves)."""

    @property
    def split(self) -> bool:
        return self.count > 1

    @property
    def ratio(self) -> float | None:
        """FP32's activation bytes over AMP's."""
        if self.fp32_bytes is None or not self.amp_bytes:
            return None
        return self.fp32_bytes / self.amp_bytes

    def pieces(self, batch: Any) -> list[tuple[Any, float]]:
        """``batch`` as ``(micro-batch, its share of the rows)`` pairs: ``count`` of them, fewer for a batch with
        fewer rows (a short last batch), the batch whole for one that cannot be split."""
        counts = self.piece_rows(batch)
        if counts is None or len(counts) == 1:
            return [(batch, 1.0)]
        rows = sum(counts)
        return [(piece, count / rows) for piece, count in zip(split_rows(batch, counts), counts)]

    def piece_rows(self, batch: Any) -> list[int] | None:
        """The rows of each of :meth:`pieces`, in order, without cutting the batch (one count for a batch taken
        whole; None for one whose rows cannot be counted)."""
        rows, _ = batch_rows(batch)
        if rows is None:
            return None
        if self.count <= 1 or rows < 2:
            return [rows]
        return row_counts(rows, min(self.count, rows))

    def sentence(self) -> str | None:
        """What the FP32 stage's summary says: the split, or why a wanted split was refused; None otherwise."""
        ratio = f"{self.ratio:.1f}x" if self.ratio is not None else "above"
        if self.split:
            return f"fp32 probes split each batch into {self.count} micro-batches: fp32 activations {ratio} AMP's"
        if self.needed:
            return f"fp32 probes not split although their activations are {ratio} AMP's: {self.reason}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "reason": self.reason,
            "detail": self.detail,
            "fp32_activation_bytes": self.fp32_bytes,
            "amp_activation_bytes": self.amp_bytes,
            "needed": self.needed,
        }


UNSPLIT = MicroBatchPlan(reason="not planned")
"""The plan of every probe that is not an FP32 probe of a planning workbench (and of the planner's own probes)."""


CHECKED_BATCHES = 4
"""The decomposition is checked on this many of the drawn batches (the first, the last, evenly between): a loss
normalised by a count over the batch (tokens that are not padding) can pass on one chunk whose rows happen to
hold equal counts."""


def plan_micro_batches(
    batch: Any, model_bytes: int, owns_loop: bool, probe: Callable[[str], LossProbe], others: Sequence[Any] = ()
) -> MicroBatchPlan:
    """The plan for FP32 probes whose first batch is ``batch`` (see the module docstring); ``probe(mode)``
    builds a throw-away probe of that mode; ``others``: further batches the decomposition is checked on (those
    that split like the first). Whatever planning does, every random generator continues as the caller left
    it; a file whose loss fails here is planned unsplit (its probes then report the failure)."""
    if owns_loop:
        return MicroBatchPlan(reason="the file's train_step() owns its loop")
    rows, why = batch_rows(batch)
    if rows is None:
        return MicroBatchPlan(reason=f"the batch cannot be split: {why}")
    if rows < 2:
        return MicroBatchPlan(reason="the batch has a single row")
    with callers_rng_kept():
        try:
            amp = _on_probe(probe, "amp", lambda amp_probe: ActivationBytes.of(amp_probe, batch, rows)).at(rows)
            fp32_line = _on_probe(probe, "fp32", lambda fp32_probe: ActivationBytes.of(fp32_probe, batch, rows))
            fp32 = fp32_line.at(rows)
            count = micro_batch_count(fp32_line, amp, rows, model_bytes)
            if count == 1:
                return MicroBatchPlan(
                    reason="the fp32 activations are not much above AMP's next to the model",
                    fp32_bytes=fp32,
                    amp_bytes=amp,
                )
            checked = [batch] + [b for b in others if batch_rows(b)[0] == rows]
            refusal = _on_probe(
                probe,
                "fp32",
                lambda fp32_probe: next(
                    (
                        why
                        for why in (decomposition_refusal(fp32_probe, b, rows, count) for b in checked)
                        if why is not None
                    ),
                    None,
                ),
            )
        except Exception as exc:  # noqa: BLE001 - the probes meet the same failure and report it as the file's
            return MicroBatchPlan(reason=f"the measurement failed: {type(exc).__name__}: {first_line(exc)}")
    if refusal is not None:
        return MicroBatchPlan(reason=refusal[0], detail=refusal[1], fp32_bytes=fp32, amp_bytes=amp, needed=True)
    return MicroBatchPlan(count, f"fp32 activations {fp32 / max(amp, 1):.1f}x AMP's", fp32, amp, needed=True)


@dataclass(frozen=True)
class ActivationBytes:
    """Saved activation bytes as a line in the rows of a batch: ``fixed + per_row * rows``."""

    fixed: float
    per_row: float

    def at(self, rows: int) -> int:
        return round(self.fixed + self.per_row * rows)

    @classmethod
    def of(cls, probe: LossProbe, batch: Any, rows: int) -> ActivationBytes:
        """Measured with ``probe``'s forward and loss on the batch's first rows: ``rows / MEASURED_SHARE`` of
        them and half as many (at least 2 and 1; a batch of 2 or 3 rows is measured on 2 and 1)."""
        large = min(rows, max(2, rows // MEASURED_SHARE))
        small = large // 2
        model = probe.model
        exclude = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        measured = [
            saved_activation_bytes(functools.partial(probe.loss_of, first_rows(batch, n)), exclude)
            for n in (small, large)
        ]
        per_row = max(0.0, (measured[1] - measured[0]) / (large - small))
        return cls(max(0.0, measured[1] - per_row * large), per_row)


def _on_probe(probe: Callable[[str], LossProbe], mode: str, use: Callable[[LossProbe], Measured]) -> Measured:
    """``use`` on a throw-away probe of ``mode``, closed and gone before the next one is built: planning never
    holds two models (nor one beside the probe it plans for, which it runs before)."""
    built = probe(mode)
    try:
        return use(built)
    finally:
        built.close()
        del built


def micro_batch_count(fp32: ActivationBytes, amp_bytes: int, rows: int, model_bytes: int) -> int:
    """The smallest power of two k (at most ``MAX_MICRO_BATCHES`` and ``rows``) whose micro-batches' FP32
    activations are within ``amp_bytes``; 1 when FP32's exceed AMP's by little next to the training's memory
    (``MARGIN``) or by little at all (``MIN_SAVING``)."""
    excess = fp32.at(rows) - amp_bytes
    if excess <= MARGIN * (TRAINING_COPIES * model_bytes + amp_bytes) or excess < MIN_SAVING:
        return 1
    count = 2
    while count * 2 <= min(rows, MAX_MICRO_BATCHES) and fp32.fixed + fp32.per_row * rows / count > amp_bytes:
        count *= 2
    return count


def saved_activation_bytes(run: Callable[[], Any], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run()`` runs (its result dropped):
    the activations a step holds at the end of its forward. Storages in ``exclude`` (by data pointer: the
    model's parameters and buffers, counted as the model) are left out."""
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in seen and pointer not in exclude:
            seen.add(pointer)
            total += storage.nbytes()
        # A detached alias keeps the storage alive (so no later tensor reuses its address while the graph
        # stands) without the tensor's own grad_fn: a saved output returned as itself would make a cycle
        # through the graph that nothing collects, and every measured activation would outlive planning.
        return t.detach()

    setattr(pack, SEES_LOW_PRECISION_SAVES, True)  # an AMP probe's emulated products keep half-precision inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    del result  # the graph goes with it: nothing is backpropagated
    return total


def decomposition_refusal(probe: LossProbe, batch: Any, rows: int, count: int) -> tuple[str, str] | None:
    """None when the loss decomposes over the batch's rows: on a chunk of one micro-batch's rows (at least
    two), the loss and the gradients of the chunk whole equal the row-weighted mean of those of its two
    halves, both drawing from the same random state. Else why not. The model's gradients are left as they
    were (``autograd.grad``: nothing accumulates into ``.grad``). A refusal is (reason, what it rests on)."""
    size = min(rows, max(2, rows // count))
    chunk = first_rows(batch, size)
    params = [p for p in probe.model.parameters() if p.requires_grad]
    guess = _why_not_decomposable(probe.model)
    start = rng_state()
    whole_loss, whole_grads = _loss_and_grads(probe, chunk, params)
    set_rng_state(start)  # the halves draw what the whole drew (dropout would still mask other elements)
    halves = row_counts(size, 2)
    split_loss = 0.0
    split_grads: list[torch.Tensor | None] = [None] * len(params)
    for piece, n in zip(split_rows(chunk, halves), halves):
        try:
            loss, grads = _loss_and_grads(probe, piece, params)
        except Exception as exc:  # noqa: BLE001 - e.g. BatchNorm refusing a single row: not decomposable either
            return (
                f"the loss does not decompose over rows ({guess})",
                f"on {n} row(s) it raised {type(exc).__name__}: {first_line(exc)}",
            )
        share = n / size
        split_loss += share * loss
        split_grads = [
            g if g is None else (g * share if s is None else s + g * share) for s, g in zip(split_grads, grads)
        ]
    if not math.isclose(whole_loss, split_loss, rel_tol=LOSS_RTOL, abs_tol=1e-8) and not (
        math.isnan(whole_loss) and math.isnan(split_loss)
    ):
        return (
            f"the loss does not decompose over rows ({guess})",
            f"loss {whole_loss:.7g} on {size} rows, {split_loss:.7g} from its halves",
        )
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in whole_grads if g is not None))
    for param_index, (whole, split) in enumerate(zip(whole_grads, split_grads)):
        if (whole is None) != (split is None):
            return (
                f"the loss does not decompose over rows ({guess})",
                f"parameter {param_index} has a gradient only one way",
            )
        if (
            whole is not None
            and split is not None
            and not torch.allclose(split, whole, rtol=GRAD_RTOL, atol=GRAD_ATOL * norm)
        ):
            worst = float((split - whole).abs().max())
            return (
                f"the loss does not decompose over rows ({guess})",
                f"parameter {param_index}'s gradient differs by up to {worst:.3g} (gradient norm {norm:.3g})",
            )
    return None


def _loss_and_grads(
    probe: LossProbe, batch: Any, params: Sequence[torch.Tensor]
) -> tuple[float, list[torch.Tensor | None]]:
    loss = probe.loss_of(batch)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return float(loss.detach().float()), [g.detach() if g is not None else None for g in grads]


def _why_not_decomposable(model: torch.nn.Module) -> str:
    """The likeliest reason a loss does not decompose over rows, from what the model holds."""
    modules = list(model.modules())
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in modules):
        return "BatchNorm in training mode"
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in modules):
        return "dropout draws other masks"
    return "a loss normalised over the batch, or one comparing its rows?"
