"""W&B's ``wandb-history.jsonl``: one JSON object per ``wandb.log`` call, in a run's ``files/`` folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

from ...errors import HistoryError
from ..records import HistoryBuilder, HistoryRow, Quantity
from . import Reader, Reading
from .names import STEP_NAMES, keyed_carries, pick

HISTORY_FILE = "wandb-history.jsonl"


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return None


class WandbHistory(Reader):
    """One row per line; the step is the trainer's own (``train/global_step``, ``global_step``, ``step``) where
    it logs one, else W&B's ``_step``."""

    name = "wandb-history"
    title = "W&B `wandb-history.jsonl` (an offline or synced run's `files/`)"
    source = (
        "wandb's internal sender (`handle_history`: one JSON object per `wandb.log` call, with `_step`, "
        "`_runtime`, `_timestamp`); keys as the trainers name them: transformers `WandbCallback` (`train/...`)"
    )
    steps = "the trainer's logged step where there is one (`train/global_step`), else `_step` (one per log call)"
    carries: ClassVar[dict[Quantity, str]] = keyed_carries()

    @classmethod
    def recognises(cls, path: Path) -> bool:
        return path.is_file() and (path.name == HISTORY_FILE or path.name.endswith("-history.jsonl"))

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        keys: dict[Quantity, str] | None = None
        previous = 0
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except ValueError as exc:
                    raise HistoryError(f"'{path}' line {number} is not valid JSON ({exc}).") from exc
                if not isinstance(entry, dict):
                    continue
                found = pick(entry)
                if not found:
                    continue
                keys = {**(keys or {}), **found}
                step = next((_number(entry[k]) for k in STEP_NAMES if _number(entry.get(k)) is not None), None)
                if step is None or not math.isfinite(step):
                    continue
                skipped = _number(entry.get(found.get(Quantity.SKIPPED, "")))
                builder.add(
                    HistoryRow(
                        step=int(step),
                        steps=max(int(step) - previous, 1),
                        loss=_number(entry.get(found.get(Quantity.LOSS, ""))),
                        loss_scale=_number(entry.get(found.get(Quantity.LOSS_SCALE, ""))),
                        skipped=None if skipped is None else int(skipped),
                        grad_norm=_number(entry.get(found.get(Quantity.GRAD_NORM, ""))),
                        lr=_number(entry.get(found.get(Quantity.LR, ""))),
                    )
                )
                previous = int(step)
        notes = [f"keys read: {', '.join(f'{q.value}={k}' for q, k in keys.items())}"] if keys else []
        return Reading(notes=notes)
