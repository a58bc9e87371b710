"""The watch's cost inside a real Hugging Face Trainer, against what users have today.

One process, a small BERT-like model built from a config (4 layers, hidden 128, batch 16 x 64 tokens,
CPU, fp32): median optimizer-step time of a plain Trainer, with FP16DoctorCallback, and with
`--debug underflow_overflow` (DebugUnderflowOverflow: forward hooks on every module). The three
settings are interleaved over rounds so the machine's noise hits them alike. Target: the callback
at <= 1.10x a plain step.

    python benchmarks/callback_overhead.py [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from fp16doctor.integrations.hf import FP16DoctorCallback  # noqa: E402


class StepClock(TrainerCallback):
    """Wall time of each optimizer step, from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 1000, (n, 64), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def step_times(setting: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=64)
    clock = StepClock()
    callbacks = [clock] + ([FP16DoctorCallback(capsule_dir=Path(tempfile.mkdtemp()))] if setting == "callback" else [])
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, max_steps=steps, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=10_000,
                                 debug="underflow_overflow" if setting == "debug" else "")
        Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens(16 * steps),
                callbacks=callbacks).train()
    return clock.times[3:]  # the first steps warm caches up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    torch.set_num_threads(2)
    times: dict[str, list[float]] = {"plain": [], "callback": [], "debug": []}
    for _ in range(options.rounds):
        for setting in times:
            times[setting] += step_times(setting, options.steps)
    plain = statistics.median(times["plain"])
    print(f"median step: plain {plain * 1e3:.1f} ms")
    print(f"FP16DoctorCallback / plain           = {statistics.median(times['callback']) / plain:.3f}  (target <= 1.10)")
    print(f"--debug underflow_overflow / plain   = {statistics.median(times['debug']) / plain:.3f}")


if __name__ == "__main__":
    main()
