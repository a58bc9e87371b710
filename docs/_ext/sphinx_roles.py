"""A griffe extension for the API page: the Sphinx roles in the code's docstrings read as code.

The package's docstrings cross-reference with Sphinx roles (``:class:`~fp16doctor.errors.DoctorError```), which
Markdown would print as they are; the role's target becomes a code span instead (``~`` keeps its last name).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`]+)`")


def as_code(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(as_code, obj.docstring.value)
