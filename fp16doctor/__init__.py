"""fp16doctor: a command-line doctor for mixed-precision (fp16/bf16 AMP) training in PyTorch."""

__version__ = "0.1.0"
