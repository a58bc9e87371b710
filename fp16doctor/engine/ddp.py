"""Facts about a DistributedDataParallel model that matter for mixed precision."""

from __future__ import annotations

from typing import Any


def half_precision_comm_hooks(model: Any) -> list[str]:
    """Names of the fp16/bf16 gradient-compression hooks registered on a DDP model: its gradients then travel
    (and are summed) in half precision. Empty for anything else."""
    hooks = getattr(model, "_comm_hooks", None) or []
    names = [getattr(h[0] if isinstance(h, tuple) else h, "__name__", str(h)) for h in hooks]
    if getattr(model, "_comm_hook", None) is not None:  # older PyTorch keeps one
        names.append(getattr(model._comm_hook, "__name__", "hook"))
    return [n for n in names if "fp16" in n or "bf16" in n]
