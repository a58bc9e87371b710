"""``fp16doctor.watch``: the live watch, as a call and as an import path.

``fp16doctor.watch(...)`` returns a :class:`~fp16doctor.live.watching.Watching` (a context manager and a
decorator); ``from fp16doctor.watch import Watch, WatchOptions`` imports the watch's records. The module is
callable so that both spellings hold: importing ``fp16doctor.watch`` binds this module to that name.
The code lives in :mod:`fp16doctor.live`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .live.watch import *  # noqa: F401,F403
from .live.watch import Alarm, Watch, WatchOptions  # noqa: F401
from .live.watching import Watching


def watch(
    capsule_dir: str | Path = "fp16doctor_capsules",
    *,
    skip_streak: int = 5,
    spike_factor: float = 10.0,
    stop_on_alarm: bool = True,
    on_alarm: Callable[[Alarm], None] | None = None,
    checksum_every: int = 100,
    rank_timeout: float | None = None,
    gather_limit_mb: float = 4096.0,
) -> Watching:
    """Watch the training this process runs inside a ``with`` block or a decorated function.

    ``capsule_dir``: where a replay capsule is written on an alarm. ``skip_streak``: optimizer steps skipped
    in a row that raise an alarm. ``spike_factor``: a loss above this multiple of the recent median is a spike.
    ``stop_on_alarm``: end the block at the first alarm. ``on_alarm``: told each alarm as it is raised.
    Under torchrun: ``checksum_every``: steps between two comparisons of the ranks' replicated weights;
    ``rank_timeout``: seconds a rank waits for the others in the watch's own all-gather (None: the process group's
    timeout); ``gather_limit_mb``: where the ranks capture a step together (FSDP; DDP with a compression hook),
    the largest whole state gathered onto rank 0 (past it, each rank saves its own shards into the capsule). A
    failure inside the watch itself is a ``RuntimeWarning``; the training goes on unwatched.
    """
    options = WatchOptions(
        capsule_dir=Path(capsule_dir),
        stop_on_alarm=stop_on_alarm,
        skip_streak=skip_streak,
        spike_factor=spike_factor,
        checksum_every=checksum_every,
        rank_timeout=rank_timeout,
        gather_limit_mb=gather_limit_mb,
    )
    return Watching(options, on_alarm=on_alarm)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Watching:
        return watch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
