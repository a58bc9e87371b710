"""A small text classifier over bag-of-words features, sharded with FSDP2 (fully_shard per layer, then the root):
the MixedPrecisionPolicy casts the parameters to fp16 and reduces in fp32, its output_dtype left unset (the loss, a
multi-class hinge by hand, takes the fp16 scores as they come and stays in fp16: autocast lists none of its ops), and
the loop scales no loss (the question torchtitan and PyTorch leave open: does FSDP2 with an fp16 param_dtype need a
GradScaler?). The gradients here are large enough for fp16: nothing goes wrong yet."""
import torch
from torch import nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

CONFIG = {"steps": 6, "lr": 1e-3, "dtype": "float16", "scaler": {"enabled": False}}


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
    scores = model(features)
    true = scores.gather(1, labels[:, None])
    return F.relu(1 + scores - true).mean()


def parallelize(model):
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
