"""Config patches as a report shows them: one recommendation per setting.

Two error findings may each propose a patch for the same setting with different values (scale-growth's
``growth_interval: 2000`` and lr-schedule-peak's ``10``, say), each tried alone. Printing both would tell
the reader two opposite things; the diagnosis has already measured the patches together (the verified
corrected config). So each renderer shows, for a finding whose patch contradicts another's, a reference to
the corrected config instead of its own patch, and the corrected config's patch once.
"""

from __future__ import annotations

from typing import Any

from ..diagnosis.findings import Diagnosis, Finding
from .formatting import exact_numbers


def settings(patch: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config patch as ``{"scaler.growth_interval": 10, ...}``."""
    flat: dict[str, Any] = {}
    for key, value in patch.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(settings(value, name + "."))
        else:
            flat[name] = value
    return flat


def contradicted_settings(diagnosis: Diagnosis) -> dict[int, list[str]]:
    """Per error finding (by rank), the settings its patch sets to a value another error finding's patch
    contradicts; empty when there is no corrected config to point at instead."""
    if diagnosis.corrected is None:
        return {}
    corrected = settings(diagnosis.corrected.config_patch)
    patched = [
        (f.rank, settings(f.fix.config_patch))
        for f in diagnosis.findings
        if f.severity == "error" and f.fix.config_patch
    ]
    values: dict[str, set[str]] = {}
    for _, flat in patched:
        for name, value in flat.items():
            if isinstance(value, list):  # lists add up (modules kept in fp32, ...): no patch contradicts another's
                continue
            values.setdefault(name, set()).add(repr(value))
    contested = {name for name, seen in values.items() if len(seen) > 1 and name in corrected}
    found = {rank: sorted(name for name in flat if name in contested) for rank, flat in patched}
    return {rank: names for rank, names in found.items() if names}


def reference_to_corrected(finding: Finding, contested: list[str], diagnosis: Diagnosis) -> str:
    """What a finding says instead of a patch that another finding's contradicts."""
    corrected = diagnosis.corrected
    chosen = settings(corrected.config_patch) if corrected is not None else {}
    values = ", ".join(f"{name}: {exact_numbers(chosen[name])}" for name in contested)
    fixes = ", ".join(corrected.from_findings) if corrected is not None else ""
    return (
        f"Config patch: another finding proposes a different {', '.join(contested)}; use the corrected config "
        f"instead ({values}; measured with the fixes of {fixes})."
    )
