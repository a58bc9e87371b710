"""House prices in dollars, trained in bf16 under FSDP2 (fully_shard per layer, then the root), with a
MixedPrecisionPolicy that reduce-scatters the gradients in fp16 to halve the reduction's bytes. bf16 holds the
price gradients; fp16 does not."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

CONFIG = {"steps": 8, "lr": 1e-3, "dtype": "bfloat16"}


def model():
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def data():
    g = torch.Generator().manual_seed(3)
    for _ in range(64):
        features = torch.randn(128, 12, generator=g)
        price = 350_000 + 90_000 * features[:, :2].sum(dim=1, keepdim=True)
        yield features, price


def loss(model, batch):
    features, price = batch
    return F.mse_loss(model(features).float(), price)


def parallelize(model):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
