"""The Hugging Face ``Trainer``'s ``trainer_state.json``, alone or as the newest one of an ``output_dir``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar

from ...errors import HistoryError
from ..records import HistoryBuilder, HistoryRow, Quantity
from . import NOT_CARRIED, Reader, Reading

STATE_FILE = "trainer_state.json"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def newest_state(folder: Path) -> Path | None:
    """The ``trainer_state.json`` with the most steps in an output_dir: its own (``save_state()``) or the newest
    ``checkpoint-N/`` one (the Trainer writes one per checkpoint, each holding the whole log history so far)."""
    candidates = [folder / STATE_FILE] if (folder / STATE_FILE).is_file() else []
    numbered = sorted(
        (int(m.group(1)), p / STATE_FILE)
        for p in folder.iterdir()
        if p.is_dir() and (m := CHECKPOINT_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    )
    if numbered:
        candidates.append(numbered[-1][1])
    if not candidates:
        return None
    return max(candidates, key=lambda p: (_global_step(p), p.parent != folder))


def _global_step(path: Path) -> int:
    try:
        return int(json.loads(path.read_text(encoding="utf-8")).get("global_step") or 0)
    except (OSError, ValueError, AttributeError):
        return -1


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class HfTrainerState(Reader):
    """The ``log_history`` of ``trainer_state.json``: one entry per logging step (``logging_steps``), written at
    each checkpoint and by ``save_state()``; evaluation and summary entries (no ``loss``) are left out."""

    name = "hf-trainer-state"
    title = "Hugging Face Trainer `trainer_state.json` (or its `output_dir`)"
    source = (
        "transformers `src/transformers/trainer.py` (`_maybe_log_save_evaluate` fills `loss`, `grad_norm`, "
        "`learning_rate`), `src/transformers/trainer_callback.py` (`TrainerState.save_to_json`)"
    )
    steps = (
        "`step` is `global_step` (attempted optimizer steps); a row covers the steps since the previous log "
        "(`logging_steps`)"
    )
    carries: ClassVar[dict[Quantity, str]] = {
        Quantity.LOSS: "`loss`: the mean over the logging interval; NaN/inf are replaced by the running mean "
        "unless `logging_nan_inf_filter=False`",
        Quantity.LOSS_SCALE: NOT_CARRIED,
        Quantity.SKIPPED: NOT_CARRIED,
        Quantity.GRAD_NORM: "`grad_norm`: the last step's, before clipping (only with `max_grad_norm > 0`)",
        Quantity.LR: "`learning_rate`",
    }

    @classmethod
    def recognises(cls, path: Path) -> bool:
        if path.is_dir():
            return newest_state(path) is not None
        return path.name == STATE_FILE or (path.suffix == ".json" and '"log_history"' in _head(path))

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        reading = Reading()
        if path.is_dir():
            found = newest_state(path)
            assert found is not None
            reading.notes.append(f"read {found.relative_to(path)}, the newest trainer_state.json in {path}")
            path = found
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise HistoryError(
                f"'{path}' is not valid JSON ({exc}).", hint="Pass an intact trainer_state.json."
            ) from exc
        history = state.get("log_history") if isinstance(state, dict) else None
        if not isinstance(history, list):
            raise HistoryError(f"'{path}' has no log_history list: not a Trainer's trainer_state.json.")
        previous = 0
        for entry in history:
            if not isinstance(entry, dict) or "loss" not in entry or not isinstance(entry.get("step"), int):
                continue
            step = int(entry["step"])
            builder.add(
                HistoryRow(
                    step=step,
                    steps=max(step - previous, 1),
                    loss=_number(entry.get("loss")),
                    grad_norm=_number(entry.get("grad_norm")),
                    lr=_number(entry.get("learning_rate")),
                )
            )
            previous = step
        if not any(isinstance(e, dict) and _nonfinite_loss(e) for e in history):
            reading.notes.append(
                "the Trainer logs a NaN/inf loss as the running mean unless logging_nan_inf_filter=False: "
                "a non-finite step may show only in grad_norm"
            )
        return reading


def _nonfinite_loss(entry: dict[str, Any]) -> bool:
    loss = _number(entry.get("loss"))
    return loss is not None and not math.isfinite(loss)


def _head(path: Path, size: int = 4096) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(size)
    except OSError:
        return ""
