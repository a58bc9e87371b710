"""The public import path of the trainers' callbacks (``fp16doctor.integrations.hf``, ``.lightning``); the code
lives in :mod:`fp16doctor.live.integrations`."""
