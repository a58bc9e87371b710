"""Numbers formatted for people: three significant digits, compact exponents, percentages where asked.

Shared by the terminal, the Markdown and the HTML report so the same value
reads the same everywhere (``0.494``, ``1.4e+02``, ``65504``, ``12.5%``).
"""

from __future__ import annotations

import math
from typing import Any


def human(value: Any, digits: int = 3, percent: bool = False) -> str:
    """One number for people: ``None`` -> "-", non-finite spelled out, ints kept whole, floats to ``digits`` digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return str(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(number):
        return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")
    if percent:
        return f"{100 * number:.{digits}g}%"
    if number == int(number) and abs(number) < 1e6:
        return str(int(number))
    return f"{number:.{digits}g}"


def humanize(value: Any) -> Any:
    """``value`` with every float inside (dicts, lists) rounded to three significant digits, for display."""
    if isinstance(value, dict):
        return {k: humanize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [humanize(v) for v in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return human(value)
        return float(f"{value:.3g}")
    return value
