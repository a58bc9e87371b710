"""A Hugging Face classifier fed the tokenizer's own output type: data() yields `BatchEncoding`s
(a UserDict, not a dict), as `tokenizer(texts, return_tensors="pt")` returns them."""
import torch
from transformers import BatchEncoding, BertConfig, BertForSequenceClassification

CONFIG = {"steps": 3}


def model():
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    return BertForSequenceClassification(config)


def data():
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 100, (4, 16), generator=g)
        yield BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                             "labels": torch.randint(0, 2, (4,), generator=g)})
