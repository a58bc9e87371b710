"""``diagnose``: the ordered triage (stages), the rules, and the ranked diagnosis.

The names below are loaded on first use (PEP 562): importing one rule, or the hand-built evidence its cases
use (:mod:`.rule_cases`), loads this package first, and it must not pull in the triage and with it
the probe, its instruments and the stages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .findings import Diagnosis, Evidence, Finding, Fix, StageReport
    from .triage import DiagnoseOptions, diagnose, fixed_config, rank

_HOMES = {
    "DiagnoseOptions": ".triage",
    "diagnose": ".triage",
    "fixed_config": ".triage",
    "rank": ".triage",
    "Diagnosis": ".findings",
    "Evidence": ".findings",
    "Finding": ".findings",
    "Fix": ".findings",
    "StageReport": ".findings",
}
"""Each public name and the module that defines it."""

__all__ = [
    "DiagnoseOptions",
    "Diagnosis",
    "Evidence",
    "Finding",
    "Fix",
    "StageReport",
    "diagnose",
    "fixed_config",
    "rank",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
