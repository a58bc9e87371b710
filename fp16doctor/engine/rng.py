"""Every random-number generator a training file may draw from: seeding, saving, restoring.

The saved state uses only types ``torch.load(weights_only=True)`` accepts, so the
same helpers serve in-memory probe snapshots and on-disk training checkpoints.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np  # a pandas dependency, always present
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """The state of every generator (CUDA's too where present)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def callers_rng_kept() -> Iterator[None]:
    """Whatever is drawn or reseeded inside, every generator (torch CPU and CUDA, Python, NumPy) continues
    afterwards exactly where the caller left it: work the doctor does inside someone else's training
    (a capsule, a check in a callback) must not change the random numbers of their run."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


def set_training_rng(state: dict[str, Any]) -> None:
    """The generators a training's checkpoint kept (:attr:`~fp16doctor.userfile.checkpoint.TrainedStart.rng`):
    torch's CPU generator, and Python's and NumPy's where it kept them, as Hugging Face's Trainer saves them."""
    torch.set_rng_state(state["cpu"])
    python = state.get("python")
    if isinstance(python, (tuple, list)) and len(python) == 3:
        version, internal, gauss = python
        random.setstate((version, tuple(internal), gauss))
    numpy_state = state.get("numpy")
    if isinstance(numpy_state, (tuple, list)) and len(numpy_state) == 5:
        np.random.set_state(tuple(numpy_state))
