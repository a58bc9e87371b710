"""What watching costs a real run: ``fp16doctor watch`` on a nanoGPT-style script and the callbacks in a real
Hugging Face ``Trainer`` and a real Lightning ``Trainer``, against the same run unwatched, side by side with
Hugging Face's ``--debug underflow_overflow`` (``DebugUnderflowOverflow``: forward hooks on every module).

Three workloads, all on CPU in fp16 with a GradScaler (the watch's main path), nothing downloaded:

* script:    ``benchmarks/nanogpt_train.py`` (a 2-layer GPT, its own GradScaler loop, gradient accumulation 2),
             run in this process exactly as ``fp16doctor watch`` runs it (``run_target`` under a
             ``TrainingObserver``); the step time is the one the script prints per iteration;
* hf:        a 2-layer BERT built from a config, in ``transformers.Trainer`` (fp16 autocast on the CPU with the
             accelerator's GradScaler), with ``FP16DoctorCallback`` / ``debug="underflow_overflow"``;
* lightning: a small transformer-encoder classifier, ``precision="16-mixed"`` with a CPU GradScaler, with
             ``FP16DoctorCallback`` / ``DebugUnderflowOverflow(module)``.

Each run trains ``--steps`` optimizer steps; its first ``--warmup`` steps are dropped and the run's median step
time is kept. Per workload a round is ``plain, watched, plain, debug`` and the rounds follow one another, so every
watched and debug run sits between two plain runs (paired: each ratio divides by the mean of its two plain
neighbours, and noise slower than a run cancels; ABAB, after a first plain warm-up run). It prints, per workload,
the median of the paired ratios and their interquartile range, against the target (watched <= 1.05 x plain).

It also counts, per optimizer step of the script (the difference of a 4- and a 2-iteration run, so setup cancels),
the aten operators dispatched and the host reads (``.item()``, ``.tolist()``, ``bool(t)``, ... : each a
synchronisation on a GPU) that the watch adds; the issue's budget is one host synchronisation per optimizer step.

    python benchmarks/watch_overhead.py [--rounds 4] [--steps 10] [--warmup 3] [--only script hf lightning]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from overhead import DispatchCounter, iqr  # noqa: E402

from fp16doctor.live.observe import TrainingObserver  # noqa: E402
from fp16doctor.live.script import Target, run_target  # noqa: E402
from fp16doctor.live.watch import WatchOptions  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "nanogpt_train.py"
TARGET = 1.05
SETTINGS = ("plain", "watched", "debug")
ITER_TIME = re.compile(r"^iter \d+: .* time ([0-9.]+)ms$", re.M)


# --- the nanoGPT-style script, as `fp16doctor watch` runs it ----------------------------------------------------
def script_args(steps: int, setting: str) -> tuple[str, ...]:
    return ("--iters", str(steps), *(("--hf-debug",) if setting == "debug" else ()))


def run_script(steps: int, setting: str) -> str:
    """The script's stdout, run in this process as ``python SCRIPT ARGS`` (under the watch for ``watched``)."""
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as capsules, contextlib.redirect_stdout(out):
        watch = TrainingObserver(WatchOptions(capsule_dir=Path(capsules))) if setting == "watched" else contextlib.nullcontext()
        with watch:
            run_target(Target(str(SCRIPT), script_args(steps, setting)))
    return out.getvalue()


def script_step_times(steps: int, setting: str) -> list[float]:
    return [float(ms) / 1e3 for ms in ITER_TIME.findall(run_script(steps, setting))]


# --- Hugging Face Trainer ---------------------------------------------------------------------------------------
def hf_step_times(steps: int, setting: str) -> list[float]:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from fp16doctor.integrations.hf import FP16DoctorCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self._start)

    torch.manual_seed(0)
    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 512, (64,), generator=g), "labels": torch.tensor(i % 2)} for i in range(8 * steps)]
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        callbacks: list[Any] = [clock] + ([FP16DoctorCallback()] if setting == "watched" else [])
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=steps, use_cpu=True, fp16=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=10_000,
                                 debug="underflow_overflow" if setting == "debug" else "")
        with contextlib.redirect_stdout(io.StringIO()):
            Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=rows, callbacks=callbacks).train()
    return clock.times


# --- Lightning --------------------------------------------------------------------------------------------------
def lightning_step_times(steps: int, setting: str) -> list[float]:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    from fp16doctor.integrations.lightning import FP16DoctorCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(512, 64)
            layer = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(64, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(ids)).mean(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, labels = batch
            return torch.nn.functional.cross_entropy(self(ids), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._start)

    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" lines per run
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 512, (8 * steps, 64), generator=g), torch.randint(0, 2, (8 * steps,), generator=g)
    module, clock = Classifier(), StepClock()
    if setting == "debug":
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(module)
    with tempfile.TemporaryDirectory() as root:
        callbacks: list[Any] = [clock] + ([FP16DoctorCallback()] if setting == "watched" else [])
        trainer = L.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
                            max_steps=steps, callbacks=callbacks, default_root_dir=root, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, DataLoader(TensorDataset(ids, labels), batch_size=8))
    return clock.times


WORKLOADS: dict[str, Callable[[int, str], list[float]]] = {
    "script": script_step_times, "hf": hf_step_times, "lightning": lightning_step_times}


# --- measuring --------------------------------------------------------------------------------------------------
def run_median(workload: str, setting: str, args: argparse.Namespace) -> float:
    """One run's median step time after its warm-up steps."""
    times = WORKLOADS[workload](args.steps, setting)[args.warmup:]
    if not times:
        raise SystemExit(f"{workload} {setting}: no step times were measured (more --steps than --warmup?)")
    return statistics.median(times)


def paired_ratios(workload: str, args: argparse.Namespace) -> tuple[dict[str, list[float]], list[float]]:
    """Rounds ``plain, watched, plain, debug`` followed by a last plain run: every watched and debug run divided by
    the mean of the plain runs on either side of it. Returns the ratios and the plain medians."""
    run_median(workload, "plain", args)  # warm-up run: imports, allocator pools, thread pool
    ratios: dict[str, list[float]] = {"watched": [], "debug": []}
    plains = [run_median(workload, "plain", args)]
    for _ in range(args.rounds):
        for setting in ("watched", "debug"):
            elapsed = run_median(workload, setting, args)
            plains.append(run_median(workload, "plain", args))
            ratios[setting].append(elapsed / ((plains[-2] + plains[-1]) / 2))
    return ratios, plains


class HostReads(TorchFunctionMode):
    """Counts the Python-level reads of a tensor's value: on a GPU each is a device-to-host synchronisation."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__index__}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def script_counts(setting: str) -> tuple[float, float]:
    """Aten operators and host reads per optimizer step of the script: (4 iterations - 2 iterations) / 2."""
    totals = []
    for iters in (2, 4):
        ops, reads = DispatchCounter(), HostReads()
        with ops, reads:
            run_script(iters, setting)
        totals.append((ops.total, reads.count))
    return (totals[1][0] - totals[0][0]) / 2, (totals[1][1] - totals[0][1]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="paired watched and debug runs per workload")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, fp16 with a GradScaler; "
          f"{args.rounds} rounds of (plain, watched, plain, debug) per workload, {args.steps} steps per run, "
          f"the first {args.warmup} left out", flush=True)
    if "script" in args.only:
        (plain_ops, plain_reads), (watched_ops, watched_reads) = script_counts("plain"), script_counts("watched")
        print(f"script, per optimizer step: {plain_ops:.0f} aten ops plain, {watched_ops - plain_ops:+.0f} watched; "
              f"{plain_reads:.0f} host reads plain, {watched_reads - plain_reads:+.0f} watched", flush=True)
    for workload in args.only:
        ratios, plains = paired_ratios(workload, args)
        print(f"{workload:9s} plain step {statistics.median(plains) * 1e3:7.1f} ms (IQR {iqr(plains) * 1e3:.1f} ms)", flush=True)
        for setting, label in (("watched", "fp16doctor watch" if workload == "script" else "FP16DoctorCallback"),
                               ("debug", "DebugUnderflowOverflow")):
            values = ratios[setting]
            ratio = statistics.median(values)
            verdict = f"  (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})" if setting == "watched" else ""
            print(f"  {label + ' / plain':32s} = {ratio:.3f}  IQR {iqr(values):.3f} over {len(values)} pairs{verdict}",
                  flush=True)


if __name__ == "__main__":
    main()
