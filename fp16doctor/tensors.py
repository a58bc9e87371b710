"""Tensor helpers every layer may use."""

from __future__ import annotations

import torch

FP16_MAX = 65504.0
"""The largest finite fp16 value (mixed-precision-notes.md, Formats)."""
FP16_MIN_SUBNORMAL = 2.0**-24
"""fp16's smallest subnormal: non-zero values below it flush to zero."""
FP16_MIN_NORMAL = 2.0**-14
"""fp16's smallest normal: below it values lose precision."""


def grad_values(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a dense tensor of its values: a sparse gradient (``nn.Embedding(sparse=True)``)
    gives its coalesced values, which hold its every non-zero entry (norms, extremes and shares stay exact)."""
    g = p.grad
    if g is None:
        return None
    g = g.detach()
    return g.coalesce().values() if g.is_sparse else g
