"""fp16doctor: a doctor for mixed-precision (fp16/bf16 AMP) training in PyTorch.

The public API (:mod:`fp16doctor.api`): ``diagnose``, ``compare`` and ``watch``, returning typed records with
a stable ``to_json()``. The names load on first use (PEP 562): ``import fp16doctor`` alone, as the command
line does for ``--version``, loads neither torch nor the diagnosis.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from . import watch
    from .api import (
        CheckpointStart,
        Comparison,
        Diagnosis,
        ServeCheck,
        SpeedReport,
        Watching,
        compare,
        corrected_config,
        diagnose,
        load,
        serve_check,
        speed,
    )
    from .errors import DoctorError

_HOMES = {
    "diagnose": ".api",
    "compare": ".api",
    "corrected_config": ".api",
    "load": ".api",
    "Diagnosis": ".api",
    "Comparison": ".api",
    "ServeCheck": ".api",
    "serve_check": ".api",
    "SpeedReport": ".api",
    "speed": ".api",
    "CheckpointStart": ".api",
    "Watching": ".api",
    "DoctorError": ".errors",
}
"""Each public name and the module that defines it. ``watch`` is the callable module :mod:`fp16doctor.watch`."""

__all__ = [
    "CheckpointStart",
    "Comparison",
    "Diagnosis",
    "ServeCheck",
    "SpeedReport",
    "DoctorError",
    "Watching",
    "__version__",
    "compare",
    "serve_check",
    "speed",
    "corrected_config",
    "diagnose",
    "load",
    "watch",
]


def __getattr__(name: str) -> Any:
    if name == "watch":
        return importlib.import_module(".watch", __name__)
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
