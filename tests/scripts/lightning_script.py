"""A Lightning training script with its LightningModule defined in the script itself and the fp16doctor callback.
``--nan-at K`` puts a NaN feature into the batch of optimizer step K. fp16 with a real GradScaler on the CPU."""

import argparse

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fp16doctor.integrations.lightning import FP16DoctorCallback

BATCH = 16


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--nan-at", type=int, default=-1)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * 12, 16, generator=g)
    y = (x[:, 0] > 0).long()
    if args.nan_at >= 0:
        x[args.nan_at * BATCH + 2, 3] = float("nan")
    trainer = L.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
                        max_steps=12, callbacks=[FP16DoctorCallback()], default_root_dir=args.root, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(), DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    print("global step", trainer.global_step)


if __name__ == "__main__":
    main()
