"""The diagnosis's memory plan: what one probe needs, and how much of the kept states may stay in memory.

The training the user runs holds the weights, their gradients and the optimizer's state (two moments for
Adam): about four copies of the model, before activations. The diagnosis holds one probe at a time (that
much again), the reference weights every probe starts from (one copy), and the states later stages need.
Each kept state is at least a copy of the model, and the 1.5x memory target leaves no room for one beside
a probe, the reference weights and the doctor's own code: by default they all go to disk, and a
``--max-memory`` budget keeps in memory what fits beyond one probe (``benchmarks/diagnose_scale.py``
measures the whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.microbatch import TRAINING_COPIES
from ..engine.probe import Workbench
from ..errors import MemoryLimitError

PROBE_COPIES = TRAINING_COPIES
"""Weights, gradients and two optimizer moments: one probe's model-sized tensors, before activations."""
DEFAULT_KEPT_BYTES = 0
"""Without --max-memory: every kept state goes to the temporary folder (read back one at a time)."""


@dataclass(frozen=True)
class MemoryPlan:
    model_bytes: int
    """The model's weights in fp32 (the workbench's reference copy)."""
    probe_bytes: int
    """What one probe needs before activations (``PROBE_COPIES`` copies of the model)."""
    kept_budget: int
    """Bytes of kept states held in memory; past it they go to a temporary folder."""


def memory_plan(bench: Workbench, max_memory: int | None = None) -> MemoryPlan:
    """The plan for ``bench``'s model under ``max_memory`` bytes (None: the default, one probe in memory and every kept state on disk)."""
    model_bytes = bench.model_bytes
    probe_bytes = PROBE_COPIES * model_bytes
    if max_memory is None:
        return MemoryPlan(model_bytes, probe_bytes, DEFAULT_KEPT_BYTES)
    needed = probe_bytes + model_bytes
    if max_memory < needed:
        raise MemoryLimitError(
            f"--max-memory {size_text(max_memory)} is too small for this model: one probe needs about {size_text(needed)} "
            f"(its weights, gradients and optimizer state, {size_text(probe_bytes)}, and the reference weights every probe "
            f"starts from, {size_text(model_bytes)}), before activations.",
            hint=f"Give at least that, e.g. --max-memory {size_text(2 * needed)}, or leave the flag out (one probe in memory, kept states on disk).",
        )
    return MemoryPlan(model_bytes, probe_bytes, max_memory - needed)


def size_text(size: int) -> str:
    """``size`` bytes as a short decimal size (``1.2GB``, ``340MB``): what --max-memory accepts back."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.3g}{unit}"
    return f"{size}B"
