"""Callbacks for the trainers people use: ``fp16doctor.integrations.hf`` and ``fp16doctor.integrations.lightning``.

Neither framework is a dependency of fp16doctor: importing an integration whose
framework is missing raises one ImportError saying what to install.
"""
