"""Probe steps counted for a progress display: every :meth:`Probe.step <fp16doctor.engine.probe.Probe.step>`
reports itself, against the steps the work under way announced.

The engine prints nothing: it tells a hook ``(probe mode, step about to run, steps planned)``; a caller
(the CLI's progress display) renders it. The counting cannot be forgotten by a stage, because the probe
itself reports each step it takes; what a stage (or a helper it calls) adds is the *total*, announced with
:meth:`StepProgress.planned` before it steps: the outermost announcement sets it, so a stage that knows its
whole plan announces it once, and the helpers it calls (which announce their own steps for the callers that
do not) only correct it, dropping what they planned and did not take. A step past the plan raises the total
to that step: the display never shows "step 7 of 6", only an estimate that grew.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

ProbeStepHook = Callable[[str, int, int], None]
"""Told ``(probe mode, step about to run, the steps planned)`` before each probe step, the steps counted
from the start of the work (a diagnosis stage) and starting at 0: what a progress display needs, and
nothing it could change."""


class StepProgress:
    """The probe steps of the work under way, and how many it planned (one per :class:`Workbench`)."""

    def __init__(self, hook: ProbeStepHook | None = None):
        self.hook = hook
        self.done = 0
        """Steps taken since :meth:`begin`."""
        self.total = 0
        """Steps planned since :meth:`begin` (at least ``done``)."""
        self._depth = 0

    def begin(self) -> None:
        """New work starts (a stage): the count starts again at 0 of nothing planned."""
        self.done = self.total = 0
        self._depth = 0

    @contextlib.contextmanager
    def planned(self, steps: int) -> Iterator[None]:
        """About ``steps`` probe steps are taken inside (an estimate; an upper bound where the work may stop
        early). The outermost announcement sets the total; one inside it is a part of it (a helper announcing
        its own steps), and adds nothing. On leaving any announcement, the steps it did not take are dropped
        from the total: an early stop (a sweep setting that settled, a search that found its repair) shortens
        the estimate at once instead of leaving it hanging. So an outer plan is the sum of the parts it
        expects, each counted as the part itself announces it."""
        outermost = self._depth == 0
        start = self.done
        if outermost:
            self.total = max(self.total, self.done) + max(int(steps), 0)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            unused = steps - (self.done - start)
            if unused > 0:
                self.total = max(self.total - unused, self.done)

    def step(self, mode: str) -> None:
        """A probe of ``mode`` is about to take a step (called by the probe itself)."""
        self.total = max(self.total, self.done + 1)
        if self.hook is not None:
            self.hook(mode, self.done, self.total)
        self.done += 1
