"""A padding mask that, in batch 2, masks every key of one sequence (length 0): the attention softmax
over a row that is -inf everywhere is NaN, in FP32 as in AMP. Not a precision problem; the doctor
should say where it starts."""
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 6}
class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 50)
    def forward(self, ids, pad):
        h = self.emb(ids)
        a, _ = self.mha(h, h, h, key_padding_mask=pad)
        return self.out(h + a)
def model(): return Enc()
def data():
    g = torch.Generator().manual_seed(15)
    for step in range(6):
        ids = torch.randint(0, 50, (4, 10), generator=g)
        lengths = torch.tensor([10, 7, 5, 0 if step == 2 else 3])
        pad = torch.arange(10)[None, :] >= lengths[:, None]
        yield {"ids": ids, "pad": pad, "labels": ids}
def loss(model, batch):
    logits = model(batch["ids"], batch["pad"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
