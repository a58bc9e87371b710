"""Tiny trainings that leave real logs behind: a Hugging Face Trainer writing trainer_state.json and its
checkpoints, a Lightning Trainer writing CSVLogger's metrics.csv. Written as their users write them."""

import torch
import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self, size=8 * 80, nan_at=None):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 16, generator=g)
        self.y = (self.x[:, 1] > 0).long()
        self.nan_at = nan_at

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if self.nan_at is not None and i // 8 == self.nan_at:
            x[0] = float("nan")
        return {"x": x, "labels": self.y[i]}


def train_hf(output_dir, lr_jump=False, steps=40, nan_at=None, callbacks=()):
    """A constant warm-up (lr x0.002 for 30 steps) into lr 0.5 when lr_jump: the jump is what breaks it."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5 if lr_jump else 1e-3)
    warmup = lambda step: (0.002 if step < 30 else 1.0) if lr_jump else 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=steps,
        bf16=True,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_steps=20,
        logging_nan_inf_filter=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=args, train_dataset=Rows(nan_at=nan_at), optimizers=(optimizer, scheduler),
                      callbacks=list(callbacks))
    trainer.train()
    return trainer


class Regressor(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self.layer, norm_type=2))
        self.log("loss_scale", self.trainer.precision_plugin.scaler.get_scale())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit_lightning(save_dir, lr, steps=60):
    """SGD on a linear regression: at lr 0.13 each step overshoots and the weights grow until fp16 overflows."""
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 40, 8, generator=g) * 3
    y = x.sum(1, keepdim=True)
    # Lightning turns precision="16-mixed" into bf16 on the CPU: the plugin with a GradScaler keeps fp16 and scaling
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=steps,
        logger=CSVLogger(str(save_dir), name="run"),
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(lr), DataLoader(TensorDataset(x, y), batch_size=64))
    return trainer
