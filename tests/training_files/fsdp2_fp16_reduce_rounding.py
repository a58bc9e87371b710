"""A small text classifier over bag-of-words features, trained in bf16 under FSDP2 (fully_shard per layer, then
the root). The MixedPrecisionPolicy reduce-scatters the gradients in fp16, for fp16's three more bits of mantissa
than bf16 at bf16's bytes. The gradients are small and well inside fp16's range: the reduction only rounds."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

CONFIG = {"steps": 6, "lr": 1e-3, "dtype": "bfloat16"}


def model():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def data():
    g = torch.Generator().manual_seed(5)
    centres = torch.randn(4, 32, generator=g)
    for _ in range(48):
        labels = torch.randint(0, 4, (64,), generator=g)
        features = centres[labels] + 0.5 * torch.randn(64, 32, generator=g)
        yield features, labels


def loss(model, batch):
    features, labels = batch
    return F.cross_entropy(model(features).float(), labels)


def parallelize(model):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16, output_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
