"""Public import path of the live watch (``fp16doctor.watch.Watch``, ``WatchOptions``); the code lives in
:mod:`fp16doctor.live.watch`."""

from .live.watch import *  # noqa: F401,F403
from .live.watch import Alarm, Watch, WatchOptions  # noqa: F401
