"""House prices from 24 features, sharded with FSDP2: fp32 master parameters under autocast, the gradients
reduce-scattered in fp16 to halve their traffic. The model de-normalises its output itself with a learnable price
scale (1000) and offset, so the squared error of prices near 5e5 sends gradients past fp16 twice over: in the head's
fp16 backward, and in the fp16 reduction of the offset's fp32 gradient. Two faults: keeping the linear layers in
fp32 repairs one process, and the ranks only with their reduction in fp32 too."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

CONFIG = {"steps": 30, "lr": 1e-3}
FEATURES = 24


class PriceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head = nn.Linear(128, 1)
        self.price_scale = nn.Parameter(torch.tensor([1000.0]))
        self.price_offset = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x):
        z = self.head(self.encoder(x)).float().squeeze(-1)
        return z * self.price_scale + self.price_offset


def model():
    return PriceNet()


def parallelize(net):
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    fully_shard(net.encoder, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    return net


def data():
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(FEATURES, generator=g) * 30000
    for _ in range(80):
        x = torch.rand(64, FEATURES, generator=g)
        yield x, x @ weights + 150000 + 5000 * torch.randn(64, generator=g)


def loss(net, batch):
    x, price = batch
    return F.mse_loss(net(x), price)
