"""Public import path of the Lightning callback: ``from fp16doctor.integrations.lightning import FP16DoctorCallback``."""

from ..live.integrations.lightning import *  # noqa: F401,F403
from ..live.integrations.lightning import FP16DoctorCallback  # noqa: F401
