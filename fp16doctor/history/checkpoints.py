"""Checkpoints found beside the logs, each with the optimizer step it holds (read off its name: nothing is loaded)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from .records import Checkpoint

LAYOUTS: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    ("hf", re.compile(r"^checkpoint-(\d+)$"), True),
    ("deepspeed", re.compile(r"^global_step(\d+)$"), True),
    ("megatron", re.compile(r"^iter_(\d+)$"), True),
    ("lightning", re.compile(r"(?:^|[-_])step=(\d+)(?:[-_.].*)?\.ckpt$"), False),
    ("fp16doctor", re.compile(r"^step_(\d+)\.pt$"), False),
    ("fairseq", re.compile(r"^checkpoint_\d+_(\d+)\.pt$"), False),
)
"""(kind, name pattern, is a folder): the Hugging Face Trainer's ``checkpoint-N/``, DeepSpeed's
``global_stepN/``, Megatron-LM's ``iter_NNNNNNN/``, Lightning's ``epoch=E-step=N.ckpt``, ``fp16doctor train``'s
``checkpoints/step_N.pt``, fairseq's ``checkpoint_E_U.pt`` (U: updates)."""


def _match(entry: Path) -> Checkpoint | None:
    for kind, pattern, folder in LAYOUTS:
        m = pattern.search(entry.name)
        if m and entry.is_dir() == folder:
            return Checkpoint(entry, int(m.group(1)), kind)
    return None


RUN_CHECKPOINTS = {
    "hf-trainer-state": {"hf"},
    "deepspeed": {"deepspeed", "hf"},  # DeepSpeed under the Hugging Face Trainer saves inside checkpoint-N/
    "megatron": {"megatron"},
    "lightning-csv": {"lightning"},
    "fp16doctor-train": {"fp16doctor"},
    "fairseq": {"fairseq"},
}
"""The checkpoints a run that writes a log of each format writes; a format not named here (TensorBoard, W&B, a
watch's capsule) comes with any training loop, and takes any."""
HOLDER = re.compile(r"checkpoint|ckpt", re.IGNORECASE)
"""A subfolder a run keeps its checkpoints in (``checkpoints/``, ``ckpts/``); any other subfolder may be another
run's, whose checkpoints are not this one's."""


def _places(source: Path) -> list[Path]:
    """Where a run keeps checkpoints, seen from one of its logs: the log's folder and its checkpoint folders one
    level down (``checkpoints/``), and, for a log inside a checkpoint (``checkpoint-N/trainer_state.json``) or a
    Lightning ``version_N/``, the folders above."""
    folder = source if source.is_dir() else source.parent
    places = [folder, *[p for p in _subfolders(folder)]]
    for parent in list(folder.parents)[:2]:
        places.append(parent)
    return places


def _subfolders(folder: Path) -> Iterable[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir() and _match(p) is None and HOLDER.search(p.name)]
    except OSError:
        return []


def find_checkpoints(sources: Iterable[tuple[Path, str]]) -> list[Checkpoint]:
    """Every checkpoint beside the given logs (each with its format), of a kind such a run writes, by step."""
    found: dict[Path, Checkpoint] = {}
    for source, log_format in sources:
        kinds = RUN_CHECKPOINTS.get(log_format)
        for place in _places(source):
            try:
                entries = list(place.iterdir())
            except OSError:
                continue
            for entry in entries:
                checkpoint = _match(entry)
                if checkpoint is not None and (kinds is None or checkpoint.kind in kinds):
                    found.setdefault(entry.resolve(), checkpoint)
    return sorted(found.values(), key=lambda c: (c.step, str(c.path)))


def nearest_before(checkpoints: list[Checkpoint], step: int) -> Checkpoint | None:
    """The newest checkpoint written before ``step``: the state the trouble had not reached yet."""
    earlier = [c for c in checkpoints if c.step < step]
    return earlier[-1] if earlier else None
