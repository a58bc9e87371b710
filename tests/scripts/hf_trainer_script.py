"""A Hugging Face Trainer script as people write them: the model class defined in the script itself, the
fp16doctor callback added to the Trainer. ``--nan-at K`` puts a NaN feature into optimizer step K's batches;
``--own-loss`` computes the loss in the Trainer's ``compute_loss`` (the model's output then carries none)."""

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer, TrainingArguments

from fp16doctor.integrations.hf import FP16DoctorCallback

BATCH, ACCUMULATION = 8, 2


class Tagger(nn.Module):
    """Keyword inputs, a dict output with the loss when labels are given (Hugging Face style)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Rows(Dataset):
    def __init__(self, nan_at, size=BATCH * ACCUMULATION * 10):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 16, generator=g)
        self.y = (self.x[:, 1] > 0).long()
        self.nan_at = nan_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index].clone()
        if index // (BATCH * ACCUMULATION) == self.nan_at:
            x[0] = float("nan")
        return {"x": x, "labels": self.y[index]}


class InOrder(Trainer):
    """No shuffling, so the broken batch lands at a known optimizer step."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class OwnLoss(InOrder):
    """The loss computed outside the model, from its logits, with label smoothing."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = nn.functional.cross_entropy(outputs["logits"], labels, label_smoothing=0.1)
        return (loss, outputs) if return_outputs else loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("--own-loss", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    training = TrainingArguments(output_dir=args.output_dir, per_device_train_batch_size=BATCH,
                                 gradient_accumulation_steps=ACCUMULATION, max_steps=8, learning_rate=1e-3, bf16=True,
                                 use_cpu=True, report_to=[], logging_steps=50, save_strategy="no", disable_tqdm=True,
                                 dataloader_num_workers=0)
    trainer = (OwnLoss if args.own_loss else InOrder)(model=Tagger(), args=training, train_dataset=Rows(args.nan_at), callbacks=[FP16DoctorCallback()])
    trainer.train()
    print("global step", trainer.state.global_step)


if __name__ == "__main__":
    main()
