"""A Hugging Face model built from a config (nothing downloaded), trained on dict batches.

Written the way a fine-tuning script is: BertForSequenceClassification, AdamW with
weight decay on everything but biases and LayerNorm weights, a linear warm-up schedule
from transformers, and the default loss (`model(**batch).loss`).
"""

import torch
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

CONFIG = {"steps": 12, "lr": 3e-4}
VOCAB, LENGTH = 120, 24


def model():
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=3)
    return BertForSequenceClassification(config)


def data():
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        ids = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
        mask = torch.ones(8, LENGTH, dtype=torch.long)
        mask[:, LENGTH // 2:] = (torch.rand(8, LENGTH - LENGTH // 2, generator=g) > 0.3).long()
        yield {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (8,), generator=g)}


def optimizer(params):
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)


def scheduler(optimizer):
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=12)
