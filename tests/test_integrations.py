"""The watch inside real trainers (Lightning and the Hugging Face Trainer), on CPU, with faults injected at a known
step: the callback alarms at that step, writes a capsule, and `diagnose --capsule` names the cause."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli

sys.path.insert(0, str(ROOT / "tests" / "integrations"))

L = pytest.importorskip("lightning")
transformers = pytest.importorskip("transformers")

FAULT_STEP = 5


def fit_lightning(tmp_path: Path, extra_callbacks=(), **faults):
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lit_faults import BATCH, Classifier, Pairs
    from torch.utils.data import DataLoader

    from fp16doctor.integrations.lightning import FP16DoctorCallback

    L.seed_everything(0, verbose=False)  # the same weights, so the same capsule, in every run
    callback = FP16DoctorCallback(capsule_dir=tmp_path / "capsules")
    # Lightning turns precision="16-mixed" into bf16 on the CPU: a MixedPrecision plugin with a GradScaler we
    # construct keeps fp16 autocast and real loss scaling there.
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=16,
        callbacks=[*extra_callbacks, callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(Pairs(nan_at=faults.get("nan_at")), batch_size=BATCH, shuffle=False)
    trainer.fit(Classifier(overflow_at=faults.get("overflow_at")), loader)
    return trainer, callback


def diagnose_capsule(capsule: Path) -> dict:
    proc = run_cli("diagnose", "--ci", "--json", "--capsule", capsule)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_lightning_healthy_run_raises_no_alarm(tmp_path):
    trainer, callback = fit_lightning(tmp_path)
    assert callback.watch.alarm is None and trainer.global_step == 16
    assert len(callback.watch.history) == 16 and not (tmp_path / "capsules").exists()
    assert all(h.loss_scale > 1 for h in callback.watch.history)  # the plugin's GradScaler was found


def test_lightning_nan_batch_alarms_at_its_step_and_the_capsule_names_the_data(tmp_path):
    trainer, callback = fit_lightning(tmp_path, nan_at=FAULT_STEP)
    alarm = callback.watch.alarm
    assert alarm is not None and alarm.kind == "nonfinite" and alarm.step == FAULT_STEP
    assert trainer.global_step <= FAULT_STEP + 1  # stopped
    state = torch.load(alarm.capsule / "capsule.pt", weights_only=True)
    assert torch.isnan(state["batches"][0][0]).any() and state["step"] == FAULT_STEP
    report = diagnose_capsule(alarm.capsule)
    assert report["findings"][0]["cause"] == "nonfinite-data"


def test_lightning_overflowing_activation_alarms_and_the_capsule_names_the_module(tmp_path):
    trainer, callback = fit_lightning(tmp_path, overflow_at=FAULT_STEP)
    alarm = callback.watch.alarm
    assert alarm is not None and alarm.step == FAULT_STEP
    report = diagnose_capsule(alarm.capsule)
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and top["evidence"]["module"].startswith("block")
    verification = top["verification"]
    assert {"nonfinite", "skips"} <= set(verification["symptoms_before"]) and verification["removed_share"] == 1.0


class TinyTagger(torch.nn.Module):
    """An HF-style model: keyword inputs, a dict output with the loss."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Rows(torch.utils.data.Dataset):
    def __init__(self, nan_at=None, batch=8, size=8 * 20):
        g = torch.Generator().manual_seed(1)
        self.x, self.batch, self.nan_at = torch.randn(size, 16, generator=g), batch, nan_at
        self.y = (self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index].clone()
        if self.nan_at is not None and index // (self.batch * 2) == self.nan_at:  # 2 micro-batches per optimizer step
            x[0] = float("nan")
        return {"x": x, "labels": self.y[index]}


def train_hf(tmp_path: Path, nan_at=None, model=None):
    from transformers import Trainer, TrainingArguments

    from fp16doctor.integrations.hf import FP16DoctorCallback

    callback = FP16DoctorCallback(capsule_dir=tmp_path / "capsules")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=8,
        learning_rate=1e-3,
        bf16=True,
        use_cpu=True,
        report_to=[],
        logging_steps=50,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class InOrder(Trainer):  # the fault must land at a known step: no shuffling
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model or TinyTagger(), args=args, train_dataset=Rows(nan_at), callbacks=[callback])
    trainer.train()
    return trainer, callback


def test_hf_trainer_healthy_run_raises_no_alarm(tmp_path):
    trainer, callback = train_hf(tmp_path)
    assert callback.watch.alarm is None and trainer.state.global_step == 8
    assert len(callback.watch.history) == 8  # one check per optimizer step, not per micro-batch


def test_hf_trainer_nan_batch_alarms_at_its_optimizer_step(tmp_path):
    trainer, callback = train_hf(tmp_path, nan_at=3)
    alarm = callback.watch.alarm
    assert alarm is not None and alarm.kind == "nonfinite" and alarm.step == 3  # global_step before the 4th step
    assert trainer.state.global_step == 4  # stopped right after
    state = torch.load(alarm.capsule / "capsule.pt", weights_only=True)
    assert len(state["batches"]) == 2  # both micro-batches of the failing optimizer step
    report = diagnose_capsule(alarm.capsule)
    assert report["findings"][0]["cause"] == "nonfinite-data"


def test_the_callbacks_hold_batches_as_references_and_copy_them_only_for_a_capsule(tmp_path):
    """Healthy runs of both trainers: not one copy of a batch by fp16doctor (on a GPU each is a transfer and a
    sync); the capsule an alarm writes does copy (the count sees copies)."""
    from host_copies import HostCopies

    model = TinyTagger()
    with HostCopies() as copies:
        model.register_forward_pre_hook(lambda module, args, kwargs: copies.watch(*kwargs.values()), with_kwargs=True)
        _, callback = train_hf(tmp_path / "hf", model=model)
    assert len(callback.watch.history) == 8 and len(copies.watched) == 2 * 16 and copies.count == 0

    class SeesBatches(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            copies.watch(*batch)

    with HostCopies() as copies:
        _, callback = fit_lightning(tmp_path / "lit", extra_callbacks=[SeesBatches()])
    assert len(callback.watch.history) == 16 and copies.count == 0
    with HostCopies() as copies:
        _, callback = fit_lightning(tmp_path / "lit-nan", extra_callbacks=[SeesBatches()], nan_at=FAULT_STEP)
    assert callback.watch.alarm is not None and copies.count > 0


def test_a_missing_framework_is_one_clear_import_error():
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None; "
        "sys.modules['pytorch_lightning'] = None\n"
        "try:\n    import fp16doctor.integrations.lightning\nexcept ImportError as e:\n    print(e)"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout
    assert "fp16doctor[lightning]" in out


def test_capsule_argument_errors_are_bad_input(tmp_path):
    assert run_cli("diagnose", "--capsule", tmp_path).returncode == 2
    assert run_cli("diagnose").returncode == 2


@pytest.mark.cuda
def test_hf_trainer_fp16_on_gpu_reads_the_accelerators_scaler(tmp_path):
    """fp16 in the HF Trainer needs CUDA: there the callback finds accelerate's GradScaler and unscales by hand."""
    from transformers import Trainer, TrainingArguments

    from fp16doctor.integrations.hf import FP16DoctorCallback

    callback = FP16DoctorCallback(capsule_dir=tmp_path / "capsules")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=6,
        fp16=True,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=TinyTagger(), args=args, train_dataset=Rows(), callbacks=[callback]).train()
    assert callback.watch.alarm is None and len(callback.watch.history) == 6
    assert all(h.loss_scale > 1 for h in callback.watch.history)
    assert all(0 < h.grad_norm < 1e3 for h in callback.watch.history if not h.skipped)  # divided by the scale


HF_SCRIPT = ROOT / "tests" / "scripts" / "hf_trainer_script.py"


def run_script(*args, cwd):
    import subprocess

    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_hf_script_with_its_model_class_in_main_writes_a_capsule_under_output_dir_that_rebuilds(tmp_path):
    proc = run_script(HF_SCRIPT, "--output-dir", tmp_path / "out", "--nan-at", "3", cwd=tmp_path)
    assert proc.returncode == 0 and "global step 4" in proc.stdout, proc.stderr[-3000:]  # stopped after the bad step
    capsule = tmp_path / "out" / "fp16doctor_capsules" / "step_00000003"
    assert f"Capsule: {capsule}." in proc.stdout and not (tmp_path / "fp16doctor_capsules").exists()
    report = diagnose_capsule(capsule)  # another process: the script's Tagger class is stored by value
    assert report["findings"][0]["cause"] == "nonfinite-data"


def test_hf_trainer_computing_the_loss_itself_is_healthy(tmp_path):
    """A custom compute_loss pops the labels and computes the loss; the model's output has none."""
    proc = run_script(HF_SCRIPT, "--output-dir", tmp_path / "out", "--own-loss", cwd=tmp_path)
    assert proc.returncode == 0 and "global step 8" in proc.stdout and "fp16doctor:" not in proc.stdout, proc.stderr[
        -3000:
    ]
    assert not (tmp_path / "out" / "fp16doctor_capsules").exists()


def test_a_tiny_bert_with_label_smoothing_reads_the_trainers_loss(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from fp16doctor.integrations.hf import FP16DoctorCallback

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 64, (12,), generator=g), "labels": torch.tensor(i % 2)} for i in range(64)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=6,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        label_smoothing_factor=0.1,
    )
    callback = FP16DoctorCallback()
    Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=rows, callbacks=[callback]).train()
    history = callback.watch.history
    assert (
        callback.watch.alarm is None and len(history) == 6 and not (tmp_path / "out" / "fp16doctor_capsules").exists()
    )
    assert all(h.loss is not None and 0.3 < h.loss < 1.5 for h in history)  # the smoothed loss the Trainer optimised


def test_lightning_script_with_its_module_in_main_writes_a_capsule_under_default_root_dir_that_rebuilds(tmp_path):
    proc = run_script(
        ROOT / "tests" / "scripts" / "lightning_script.py", "--root", tmp_path / "root", "--nan-at", "4", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    capsule = tmp_path / "root" / "fp16doctor_capsules" / "step_00000004"
    assert f"Capsule: {capsule}." in proc.stdout and "global step 5" in proc.stdout
    history = json.loads((capsule / "manifest.json").read_text())["history"]
    assert history[-1]["skipped"] and history[-1]["loss_scale"] == 65536.0  # the scaler's own decision
    report = diagnose_capsule(capsule)  # another process: the LightningModule of __main__ is stored by value
    top = report["findings"][0]  # first: dropping the NaN row repairs the replay (AdamW moments and all)
    assert top["cause"] == "nonfinite-data" and top["evidence"]["nan"] == 1 and top["evidence"]["field"] == "0"
    assert top["verification"]["repaired"], top["verification"]


def test_a_trainer_script_under_fp16doctor_watch_gets_one_check_and_one_capsule(tmp_path):
    """The script's own callback stands down under `fp16doctor watch`: one line, one capsule, and it replays."""
    proc = run_cli("watch", "--capsule-dir", "caps", HF_SCRIPT, "--output-dir", "out", "--nan-at", "3", cwd=tmp_path)
    pointers = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("fp16doctor:")]
    assert proc.returncode == 1 and len(pointers) == 1 and "the loss is nan" in pointers[0], proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "caps").iterdir()] == ["step_00000003"]
    assert not (tmp_path / "out" / "fp16doctor_capsules").exists()
    assert diagnose_capsule(tmp_path / "caps" / "step_00000003")["findings"][0]["cause"] == "nonfinite-data"


def test_a_lightning_script_under_fp16doctor_watch_holds_the_forward_lightning_runs_before_zero_grad(tmp_path):
    """Lightning's closure runs the training step, then zero_grad, then the backward: the forward stays the step's
    micro-batch (once dropped at zero_grad, the capsule had no batch), and the capsule replays to the NaN row."""
    proc = run_cli(
        "watch",
        "--capsule-dir",
        "caps",
        ROOT / "tests" / "scripts" / "lightning_script.py",
        "--root",
        "root",
        "--nan-at",
        "4",
        cwd=tmp_path,
    )
    pointers = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("fp16doctor:")]
    assert proc.returncode == 1 and len(pointers) == 1 and "optimizer step 4: the loss is nan" in pointers[0], (
        proc.stderr[-3000:]
    )
    state = torch.load(tmp_path / "caps" / "step_00000004" / "capsule.pt", weights_only=True)
    assert len(state["batches"]) == 1 and torch.isnan(state["batches"][0]["args"][0]).sum() == 1
    top = diagnose_capsule(tmp_path / "caps" / "step_00000004")["findings"][0]
    assert top["cause"] == "nonfinite-data" and top["verification"]["repaired"]
