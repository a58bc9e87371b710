"""Callbacks for the trainers people use: ``fp16doctor.live.integrations.hf`` and ``fp16doctor.live.integrations.lightning``.

Neither framework is a dependency of fp16doctor: importing an integration whose
framework is missing raises one ImportError saying what to install.
"""
