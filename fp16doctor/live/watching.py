"""The live watch around code in this process (``fp16doctor.watch()``): a context manager and a decorator.

What ``fp16doctor watch SCRIPT`` does for a whole script, for the part of a program a library caller chooses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from .observe import TrainingObserver, WatchStopped, torchrun_rank
from .watch import Alarm, WatchOptions

F = TypeVar("F", bound=Callable[..., Any])


class Watching:
    """Observes every optimizer step inside its ``with`` block (or the decorated function's call).

    On an alarm it writes a replay capsule and, with ``stop_on_alarm``, stops the training at once: the
    block ends there and execution goes on after it (the stop is no exception of the caller's). ``alarms``
    holds what it saw.
    """

    def __init__(self, options: WatchOptions, on_alarm: Callable[[Alarm], None] | None = None):
        self.options = options
        self.on_alarm = on_alarm
        self._observer: TrainingObserver | None = None
        self._alarms: list[Alarm] = []

    @property
    def alarms(self) -> list[Alarm]:
        return list(self._observer.alarms) if self._observer is not None else list(self._alarms)

    def __enter__(self) -> Watching:
        self._observer = TrainingObserver(self.options, on_alarm=self.on_alarm, rank=torchrun_rank())
        self._observer.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.__exit__(kind, exc, tb)
            self._alarms = list(observer.alarms)
        return kind is not None and issubclass(kind, WatchStopped)

    def __call__(self, function: F) -> F:
        """As a decorator: each call of ``function`` runs watched."""

        @functools.wraps(function)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)
            return None  # stopped on an alarm

        return watched  # type: ignore[return-value]
