"""The history a replay capsule keeps: the steps before the alarm, as ``fp16doctor watch`` and the callbacks
measured them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ...errors import HistoryError
from ..records import HistoryBuilder, HistoryRow, Quantity
from . import Reader, Reading

CAPSULE_STATE = "capsule.pt"
MANIFEST = "manifest.json"


def capsule_folders(path: Path) -> list[Path]:
    """The capsule itself, or the capsules in a ``--capsule-dir`` (each alarm writes one ``step_N`` folder)."""
    if (path / CAPSULE_STATE).is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_dir() and (p / CAPSULE_STATE).is_file())
    return []


def load_history(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The capsule's recorded steps and its alarm: from its manifest (plain JSON, however large the model), else,
    for a capsule of an older fp16doctor, from its state (``weights_only``: nothing is unpickled but tensors and
    builtins)."""
    import json

    import torch

    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and isinstance(manifest.get("history"), list):
        return manifest["history"], dict(manifest.get("alarm") or {})
    try:
        state = torch.load(folder / CAPSULE_STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds on a damaged or foreign file
        raise HistoryError(
            f"capsule '{folder}': {CAPSULE_STATE} cannot be read ({type(exc).__name__}: {exc})."
        ) from exc
    history = state.get("history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise HistoryError(f"capsule '{folder}' keeps no step history (written by an older fp16doctor).")
    return history, dict(state.get("alarm") or {})


class WatchCapsule(Reader):
    """A capsule folder (or the folder of several): the up to 50 steps the watch measured before its alarm, the
    newest capsule's where there are several. The capsule itself replays the failing step: the next command is
    ``diagnose --capsule``."""

    name = "fp16doctor-watch"
    title = "a replay capsule of `fp16doctor watch` or the callbacks (or the `--capsule-dir` holding them)"
    source = "fp16doctor `fp16doctor/live/watch.py` (`Watch._write_capsule`: `history`, the last 50 `StepNumbers`)"
    steps = "one row per optimizer step, the last 50 before the alarm"
    carries: ClassVar[dict[Quantity, str]] = {
        Quantity.LOSS: "`loss` (summed over the step's micro-batches)",
        Quantity.LOSS_SCALE: "`loss_scale`",
        Quantity.SKIPPED: "`skipped` (the scaler's own found-inf)",
        Quantity.GRAD_NORM: "`grad_norm` (unscaled)",
        Quantity.LR: "`lr`",
    }

    @classmethod
    def recognises(cls, path: Path) -> bool:
        return path.is_dir() and bool(capsule_folders(path))

    def read(self, path: Path, builder: HistoryBuilder) -> Reading:
        folders = capsule_folders(path)
        newest = max(folders, key=lambda f: (int(_step_of(f)), f.name))
        history, alarm = load_history(newest)
        for entry in history:
            if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
                continue
            builder.add(
                HistoryRow(
                    step=int(entry["step"]),
                    loss=_number(entry.get("loss")),
                    loss_scale=_number(entry.get("loss_scale")),
                    skipped=int(bool(entry.get("skipped"))),
                    grad_norm=_number(entry.get("grad_norm")),
                    lr=_number(entry.get("lr")),
                )
            )
        notes = [f"capsule {newest}: alarm {alarm.get('kind')}: {alarm.get('message')}"] if alarm.get("kind") else []
        if len(folders) > 1:
            notes.append(f"{len(folders)} capsules in {path}; read the newest, {newest.name}")
        return Reading(notes=notes)


def _step_of(folder: Path) -> int:
    digits = "".join(c for c in folder.name.split("step_")[-1].split("-")[0] if c.isdigit())
    return int(digits) if digits else -1


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
