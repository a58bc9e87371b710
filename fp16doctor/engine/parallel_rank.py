"""The entry point of each torchrun process of the parallel stage (:func:`fp16doctor.engine.parallel.main`).

A module of its own: what rank 0 pickles is then of :mod:`fp16doctor.engine.parallel`, not of ``__main__``."""

from __future__ import annotations

import sys

from .parallel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
