"""A text classifier whose head the training runs in fp32, as language-model trainings do for their logits: the
trained head's weights are large (a sharp, confident classifier), so its logits reach about 1e5. Under AMP that is
fine (the head is fp32); served in pure fp16 (model.half()) the logits are inf."""

import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self, vocab=64, width=32, classes=10):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        h = self.body(self.embed(tokens))
        with torch.autocast(tokens.device.type, enabled=False):  # logits in the head's own dtype, as trained
            return self.head(h.to(self.head.weight.dtype))


def model():
    torch.manual_seed(0)
    net = Classifier()
    with torch.no_grad():
        net.head.weight.mul_(3.5e5)  # what a long training to near-one-hot targets leaves
    return net


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (16, 12), generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]
