"""Numbers formatted for people: three significant digits, compact exponents, percentages where asked.

Shared by the terminal, the Markdown and the HTML report so the same value
reads the same everywhere (``0.494``, ``1.4e+02``, ``65504``, ``12.5%``). Powers of two (loss scales,
fp16's limits) are never rounded: ``2048``, ``65536``, ``2^-14``, ``2^40``; a loss scale rounded to
``2050`` or ``8190`` reads as a setting nobody chose.
"""

from __future__ import annotations

import math
import re
import textwrap
from typing import Any

from ..files import jsonable

UNMEASURED = "not measured"
"""What a share that has no number (NaN: nothing to measure it on) reads as."""
EXACT_EXPONENTS = range(-4, 31)
"""Powers of two printed as plain numbers (0.0625 .. 1073741824); beyond, as ``2^k``."""


def power_of_two_exponent(number: float) -> int | None:
    """``k`` when ``number`` is exactly ``2^k`` (positive), else None."""
    if not math.isfinite(number) or number <= 0:
        return None
    mantissa, exponent = math.frexp(number)
    return exponent - 1 if mantissa == 0.5 else None


def _power_of_two_text(exponent: int) -> str:
    if exponent in EXACT_EXPONENTS:
        number = 2.0**exponent
        return str(int(number)) if exponent >= 0 else repr(number)
    return f"2^{exponent}"


def human(value: Any, digits: int = 3, percent: bool = False) -> str:
    """One number for people: ``None`` -> "-", non-finite spelled out, ints kept whole, powers of two exact,
    floats to ``digits`` digits. A share (``percent``) that could not be measured says so, never ``nan%``."""
    if percent and isinstance(value, float) and math.isnan(value):
        return UNMEASURED
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
    exponent = power_of_two_exponent(abs(number))
    if exponent is not None:
        return ("-" if number < 0 else "") + _power_of_two_text(exponent)
    if number == int(number) and abs(number) < 1e6:
        return str(int(number))
    return f"{number:.{digits}g}"


def humanize(value: Any) -> Any:
    """``value`` with every float inside (dicts, lists) rounded to three significant digits, for display.

    Whole numbers stay whole and exact (``65536``, not ``65500.0``); powers of two too small or too large
    to read as digits become ``2^k`` text."""
    if isinstance(value, dict):
        return {k: UNMEASURED if _unmeasured_share(k, v) else humanize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [humanize(v) for v in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return human(value)
        exponent = power_of_two_exponent(abs(value))
        if exponent is not None and exponent not in EXACT_EXPONENTS:
            return human(value)
        if value == int(value) and abs(value) < 2**53:
            return int(value)
        if exponent is not None:
            return value
        return float(f"{value:.3g}")
    return value


def shown_evidence(evidence: dict[str, Any]) -> dict[str, Any]:
    """A finding's evidence as the reports print it: rounded for reading (:func:`humanize`), without the keys
    that hold nothing (None, an empty string: a note the rule had nothing for). ``--json`` keeps them all."""
    return {k: v for k, v in humanize(jsonable(evidence)).items() if v is not None and v != ""}


def _unmeasured_share(key: Any, value: Any) -> bool:
    """An evidence share (``..._share``) that is NaN (or its JSON form ``"nan"``): there was nothing to measure it on."""
    nan = (isinstance(value, float) and math.isnan(value)) or value == "nan"
    return isinstance(key, str) and key.endswith("share") and nan


def exact_numbers(value: Any) -> Any:
    """``value`` for display with whole floats as integers (``init_scale: 2048``) and nothing rounded: a config
    patch is copied as it is printed."""
    if isinstance(value, dict):
        return {k: exact_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [exact_numbers(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value == int(value) and abs(value) < 2**53:
        return int(value)
    return value


def healthy_headline(severities: list[str], only_eager_fails: bool = False) -> str:
    """What follows ``healthy: FILE`` for a diagnosis with no error finding, given its findings' severities.

    "Trains like its FP32 twin" is true of a training whose loss never moves (both twins train nothing), so
    a headline over warnings says that precision is not the problem and sends the reader to the warnings
    first, instead of reading as a clean bill of health with notes attached. ``only_eager_fails``: the training
    compiles and is healthy so, while its eager AMP fails (said first: the same code run eagerly would fail)."""
    warnings = severities.count("warning")
    if only_eager_fails:
        return "is healthy as compiled, but eager AMP fails: the warnings below say where, should it run eagerly"
    if warnings:
        return f"shows no measured mixed-precision failure, but {warnings} warning(s) below say what to look at first"
    notes = len(severities)
    return "trains in mixed precision like its FP32 twin" + (f" ({notes} note(s) below)" if notes else "")


TRAILING_COMMENT = re.compile(r"^(?P<code>\s*[^#\s][^#]*?)\s{2,}(?P<comment>#.*)$")
"""A code line and its trailing comment, separated by two spaces or more (the snippets' style; a ``#`` inside a
string is not preceded by two spaces in them)."""


def fitted_code(code: str, width: int) -> str:
    """A fix's Python snippet with its lines kept within ``width`` columns the way a person would: a trailing
    comment that does not fit goes on its own line above the code, and a comment line too long is wrapped into
    comment lines. So a terminal that wraps what is still too wide never turns a comment's words into code (the
    snippet stays valid Python to copy). Code itself is left as it is."""
    out: list[str] = []
    for line in code.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        trailing = TRAILING_COMMENT.match(line)
        if trailing is not None and all(trailing["code"].count(q) % 2 == 0 for q in "'\""):  # not inside a string
            indent = line[: len(line) - len(line.lstrip())]
            out += _wrapped_comment(indent + trailing["comment"], width)
            out.append(trailing["code"].rstrip())
        elif line.lstrip().startswith("#"):
            out += _wrapped_comment(line, width)
        else:
            out.append(line)
    return "\n".join(out)


def _wrapped_comment(line: str, width: int) -> list[str]:
    indent = line[: len(line) - len(line.lstrip())]
    text = line.lstrip()[1:].strip()
    return textwrap.wrap(
        text,
        width=max(width, 20),
        initial_indent=indent + "# ",
        subsequent_indent=indent + "# ",
        break_long_words=False,
        break_on_hyphens=False,
    ) or [line]
