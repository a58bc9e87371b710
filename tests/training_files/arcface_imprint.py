"""Few-shot face-ID fine-tune with an ArcFace head whose class weights were
imprinted from the support embeddings (weight imprinting), support images
mixed into every batch. The margin head clamps cos to [-1+1e-7, 1-1e-7]
"to keep acos finite", as many ArcFace implementations do."""
import math
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 24}
IN, EMB, NCLS, B = 48, 64, 16, 64


class ArcMarginProduct(nn.Module):
    def __init__(self, in_features, out_features, s=30.0, m=0.5):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.weight))
        cosine = cosine.clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cosine)
        target = torch.cos(theta + self.m)
        one_hot = F.one_hot(label, cosine.size(1)).to(cosine.dtype)
        return self.s * (one_hot * target + (1 - one_hot) * cosine)


class FaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(IN, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                      nn.Linear(128, EMB))
        self.head = ArcMarginProduct(EMB, NCLS)

    def forward(self, x, label):
        return self.head(self.backbone(x), label)


def _support():
    g = torch.Generator().manual_seed(1)
    return torch.randn(NCLS, IN, generator=g)


def model():
    torch.manual_seed(0)
    net = FaceNet()
    with torch.no_grad():  # imprint: class weight = embedding of that class's support image
        net.head.weight.copy_(F.normalize(net.backbone(_support())))
    return net


def data():
    g = torch.Generator().manual_seed(2)
    support = _support()
    for _ in range(24):
        y = torch.randint(0, NCLS, (B,), generator=g)
        x = support[y] + 0.6 * torch.randn(B, IN, generator=g)
        x[:NCLS] = support                      # the support images ride along in every batch
        y[:NCLS] = torch.arange(NCLS)
        yield x, y


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x, y), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)


def scheduler(opt):
    return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[16], gamma=0.1)
