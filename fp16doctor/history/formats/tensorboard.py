"""TensorBoard event files, read with TensorBoard's own event reader (the optional ``fp16doctor[tensorboard]``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from ...errors import HistoryError
from ..records import HistoryBuilder, HistoryRow, Quantity
from . import Reader, Reading
from .names import keyed_carries, pick

EVENTS_PREFIX = "events.out.tfevents."
EXTRA_HINT = "TensorBoard event files need TensorBoard's reader: pip install 'fp16doctor[tensorboard]'."


def event_loader() -> Any:
    """TensorBoard's streaming reader of one event file, or a clear error naming the extra to install."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    except ImportError as exc:
        raise HistoryError("reading TensorBoard event files needs the tensorboard package.", hint=EXTRA_HINT) from exc
    return EventFileLoader


def scalars(path: Path) -> Iterator[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the file: ``simple_value`` (``SummaryWriter.add_scalar``) or a
    0-dim float tensor (TF2 summaries)."""
    loader = event_loader()(str(path))
    try:
        for event in loader.Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    yield value.tag, int(event.step), float(value.simple_value)
                elif kind == "tensor" and value.tensor.float_val:
                    yield value.tag, int(event.step), float(value.tensor.float_val[0])
                elif kind == "tensor" and value.tensor.double_val:
                    yield value.tag, int(event.step), float(value.tensor.double_val[0])
    except Exception as exc:  # noqa: BLE001 - the reader raises its own (and protobuf's) errors on a damaged file
        if isinstance(exc, HistoryError):
            raise
        raise HistoryError(f"'{path}' is not a readable TensorBoard event file ({type(exc).__name__}: {exc}).") from exc


class TensorBoardEvents(Reader):
    """Scalars by tag; the values of one step (tags written apart) are merged into one row."""

    name = "tensorboard"
    title = "TensorBoard event files (`events.out.tfevents.*`, or a folder of them)"
    source = (
        "tensorboard `tensorboard/backend/event_processing/event_file_loader.py` (the reader used); tags as the "
        "writers name them: transformers `integrations/integration_utils.py` (`TensorBoardCallback`), DeepSpeed "
        "`deepspeed/runtime/engine.py` (`Train/Samples/...`), Megatron-LM `megatron/training/training.py`"
    )
    steps = "the event's `step` as the writer gave it (DeepSpeed's monitor writes samples seen, not steps)"
    carries: ClassVar[dict[Quantity, str]] = keyed_carries()

    @classmethod
    def recognises(cls, path: Path) -> bool:
        return path.is_file() and path.name.startswith(EVENTS_PREFIX)

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        by_step: dict[int, dict[str, float]] = {}
        for tag, step, value in scalars(path):
            by_step.setdefault(step, {})[tag] = value
        tags = {tag for values in by_step.values() for tag in values}
        keys = pick(sorted(tags))
        if not keys:
            return Reading(notes=[f"{path.name}: no scalar the doctor reads (tags: {', '.join(sorted(tags)[:12])})"])
        previous = 0
        for step in sorted(by_step):
            values = by_step[step]
            if not any(key in values for key in keys.values()):
                continue
            skipped = values.get(keys.get(Quantity.SKIPPED, ""))
            builder.add(
                HistoryRow(
                    step=step,
                    steps=max(step - previous, 1),
                    loss=values.get(keys.get(Quantity.LOSS, "")),
                    loss_scale=values.get(keys.get(Quantity.LOSS_SCALE, "")),
                    skipped=None if skipped is None else int(skipped),
                    grad_norm=values.get(keys.get(Quantity.GRAD_NORM, "")),
                    lr=values.get(keys.get(Quantity.LR, "")),
                )
            )
            previous = step
        return Reading(notes=[f"tags read: {', '.join(f'{q.value}={k}' for q, k in keys.items())}"])
