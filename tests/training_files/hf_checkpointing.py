"""The Hugging Face model of hf_bert.py with activation (gradient) checkpointing on.

The recompute in backward must run under the same precision policy as the forward:
the same autocast ops in AMP, the same fp32 everywhere in the FP32 baseline.
"""

from hf_bert import CONFIG, data, optimizer, scheduler  # noqa: F401 - a sibling module of this file
from hf_bert import model as bert


def model():
    net = bert()
    net.gradient_checkpointing_enable()
    return net
