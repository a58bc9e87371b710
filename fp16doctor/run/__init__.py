"""The corrected training run (``fp16doctor train``), on one process or many."""
