"""``python -m fp16doctor`` == the ``fp16doctor`` console script."""

from .cli import run

run()
