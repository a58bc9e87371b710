"""Public import path of the Hugging Face callback: ``from fp16doctor.integrations.hf import FP16DoctorCallback``."""

from ..live.integrations.hf import *  # noqa: F401,F403
from ..live.integrations.hf import FP16DoctorCallback  # noqa: F401
