"""The real-world case of the notes: a T5 whose feed-forward output projection (`wo`) carries weights
"pretrained in bf16" that push its output past 65504 in fp16 fine-tuning. T5 also takes log(0) on
purpose in its relative-position buckets (then casts to integers): an infinity that does not matter,
which the localisation must not blame."""
import torch
from transformers import T5Config, T5ForConditionalGeneration

CONFIG = {"steps": 6}


def model():
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    t5 = T5ForConditionalGeneration(config)
    with torch.no_grad():
        t5.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(1e5)
    return t5


def data():
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        source = torch.randint(1, 128, (4, 12), generator=g)
        yield {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": source.flip(1)}
