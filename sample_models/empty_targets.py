"""Empty targets: a batch in which every label is the ignore_index.

A token tagger trained on packed, padded sequences: padding positions carry the
label -100, which cross-entropy ignores. One shard ends in a batch of padding
only; its mean loss is 0/0 = NaN by design (PyTorch since 1.11), in FP32 exactly
as in AMP, and the NaN gradients poison the weights. Not a precision problem:
skip such batches, or normalise the summed loss by max(n_valid, 1).
"""

import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 16, "lr": 3e-3}
VOCAB, TAGS, LENGTH = 50, 5, 12


def model() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, TAGS))


def data():
    g = torch.Generator().manual_seed(12)
    for index in range(16):
        tokens = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
        tags = tokens % TAGS
        lengths = torch.randint(3, LENGTH + 1, (8,), generator=g)
        if index == 6:
            lengths.zero_()  # the end of a shard: padding only
        pad = torch.arange(LENGTH)[None, :] >= lengths[:, None]
        yield tokens.masked_fill(pad, 0), tags.masked_fill(pad, -100)


def loss(model, batch):
    tokens, tags = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, TAGS), tags.reshape(-1))   # mean over valid tokens
