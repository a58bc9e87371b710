"""An additive attention mask built as `(1 - mask) * torch.finfo(torch.float32).min` and cast to the
scores' dtype, as older Hugging Face code did: -inf in fp16 (-3.4e38 stays finite in fp32). In batch 3
one sequence is all padding: its fully masked row is a uniform softmax in FP32 and NaN under AMP."""
import math
import torch
from torch import nn
import torch.nn.functional as F
CONFIG = {"steps": 8}
class Attn(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d); self.o = nn.Linear(d, d)
    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / math.sqrt(x.shape[-1])
        additive = (1.0 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
        scores = scores + additive.to(scores.dtype)
        return self.o(scores.softmax(-1) @ v)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64); self.attn = Attn(); self.head = nn.Linear(64, 2)
    def forward(self, ids, mask):
        h = self.emb(ids)
        h = h + self.attn(h, mask)
        return self.head(h.mean(1))
def model(): return Net()
def data():
    g = torch.Generator().manual_seed(41)
    for step in range(8):
        ids = torch.randint(0, 100, (8, 12), generator=g)
        lengths = torch.randint(1, 13, (8,), generator=g)
        if step == 3:
            lengths[0] = 0          # an empty sequence (all padding)
        mask = (torch.arange(12)[None] < lengths[:, None]).long()
        yield {"ids": ids, "mask": mask, "labels": torch.randint(0, 2, (8,), generator=g)}
def loss(model, batch):
    return F.cross_entropy(model(batch["ids"], batch["mask"]), batch["labels"])
