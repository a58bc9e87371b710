"""A BERT-style token classifier (LayerNorm eps=1e-12, padding tokens that embed to zero vectors), compiled with
inductor, in a process where a team's "fast" rsqrt lowering is registered: like a fast-math kernel with
denormals-are-zero, it takes inputs below fp16's smallest normal (6.1e-5) as 0. A padding row's variance is 0, so
its normalisation is rsqrt(0 + 1e-12): 1e6 in eager, inf in the lowering, and 0 * inf is NaN. None of the pinned torch's own lowerings misbehave here; this
one is injected on purpose, the way a custom or patched lowering would make it."""

import torch
from torch import nn
from torch._inductor import lowering
from torch._inductor.virtualized import ops

CONFIG = {"steps": 6}
VOCAB, PAD = 40, 0
FP16_TINY = 6.1e-5


def fast_rsqrt(x):
    load = x.make_loader()

    def inner(index):
        value = load(index)
        tiny = ops.lt(value, ops.constant(FP16_TINY, x.get_dtype()))  # below fp16's smallest normal: taken as 0
        return ops.rsqrt(ops.where(tiny, ops.constant(0.0, x.get_dtype()), value))

    return lowering.Pointwise.create(device=x.get_device(), dtype=x.get_dtype(), inner_fn=inner, ranges=x.get_size())


lowering.lowerings[torch.ops.aten.rsqrt.default] = fast_rsqrt
# inductor's compiled-graph cache keys do not hold a lowering registered at run time: a graph compiled before it,
# in this process or another, would come back
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


class Tagger(nn.Module):
    def __init__(self, width=32, tags=5):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width, padding_idx=PAD)
        self.norm = nn.LayerNorm(width, eps=1e-12, elementwise_affine=False)
        self.head = nn.Linear(width, tags)

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens)))


def model():
    torch.manual_seed(0)
    return torch.compile(Tagger())


def data():
    g = torch.Generator().manual_seed(1)
    for _ in range(64):
        tokens = torch.randint(1, VOCAB, (8, 10), generator=g)
        tokens[:, 7:] = PAD
        yield tokens, torch.randint(0, 5, (8, 10), generator=g)


def loss(model, batch):
    tokens, tags = batch
    return nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tags.flatten())
