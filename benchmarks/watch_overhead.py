"""What watching costs a real run: ``fp16doctor watch`` on a nanoGPT-style script and the callbacks in a real
Hugging Face ``Trainer`` and a real Lightning ``Trainer``, against the same run unwatched, side by side with
Hugging Face's ``--debug underflow_overflow`` (``DebugUnderflowOverflow``: forward hooks on every module).

Three workloads, all on CPU in fp16 with a GradScaler (the watch's main path), nothing downloaded:

* script:    ``benchmarks/nanogpt_train.py`` (a 2-layer GPT, width 64, batch 8 x 32 tokens, its own GradScaler
             loop with gradient accumulation 2), run in this process as ``fp16doctor watch`` runs it
             (``run_target`` under a ``TrainingObserver``); a step ends at the script's ``iter N`` line;
* hf:        a 4-layer BERT (hidden 128) built from a config, batch 16 x 64 tokens, in ``transformers.Trainer``
             (fp16 autocast on the CPU with the accelerator's GradScaler), with ``FP16DoctorCallback`` /
             ``debug="underflow_overflow"``;
* lightning: a 2-layer transformer-encoder classifier (width 64), batch 8 x 64 tokens, ``precision="16-mixed"``
             with a CPU GradScaler, with ``FP16DoctorCallback`` / ``DebugUnderflowOverflow(module)``.

Times are CPU time of this process (and wall time alongside): on a shared machine the neighbours stretch a
step's wall time, not its work. One torch thread by default (``--threads``).

Paired and interleaved at the step: within one training run, after ``--warmup`` steps, the steps cycle through
``plain, watched, plain, debug`` (ABAB), the watch and the detector switched on and off between steps (the
observer is entered and left at the script's iteration line and keeps what it found, so a watched step is one of
a long watch; the callback is attached and detached; the detector's hooks are taken off and put back). Each
watched or debug step is divided by the mean of the plain steps on either side of it, so the noise of a shared
machine that lasts longer than a step cancels. It prints per workload the median of these paired ratios and
their interquartile range, against the target (watched <= 1.05 x plain).

It also counts, per optimizer step of the script (the difference of a 4- and a 2-iteration run, so setup cancels),
the aten operators dispatched and the host reads (``.item()``, ``.tolist()``, ``bool(t)``, ...: on a GPU each
read of a device tensor is a synchronisation) that the watch adds; the issue's budget is one per optimizer step.

    python benchmarks/watch_overhead.py [--rounds 20] [--warmup 3] [--only script hf lightning]
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
CYCLE = ("plain", "watched", "plain", "debug")


class Clock:
    """Wall and CPU time of each step. The CPU time is this process's own: on a shared machine the neighbours'
    load stretches the wall time of a step, not the work it does, so the ratios are judged on CPU time."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._wall)
        self.cpu.append(time.process_time() - self._cpu)

    def lap(self) -> None:
        """The step since the last lap ends here and the next begins."""
        self.stop()
        self.start()


def setting_of(step: int, warmup: int) -> str:
    """``plain`` for the warm-up steps, then ``plain, watched, plain, debug`` over and over."""
    return "plain" if step < warmup else CYCLE[(step - warmup) % len(CYCLE)]


def total_steps(args: argparse.Namespace) -> int:
    """Warm-up, the rounds, and a last plain step so that every watched and debug step has two plain neighbours."""
    return args.warmup + len(CYCLE) * args.rounds + 1


class HookSwitch:
    """The forward hooks ``owner`` registered on a model's modules, taken off and put back between steps."""

    def __init__(self, model: torch.nn.Module, owner_type: type):
        self.hooks = [
            (m, key, hook)
            for m in model.modules()
            for key, hook in m._forward_hooks.items()
            if isinstance(getattr(hook, "__self__", None), owner_type)
        ]

    def set(self, on: bool) -> None:
        for module, key, hook in self.hooks:
            if on:
                module._forward_hooks[key] = hook
            else:
                module._forward_hooks.pop(key, None)


# --- the nanoGPT-style script, as `fp16doctor watch` runs it ----------------------------------------------------
class SwitchingStdout(io.StringIO):
    """The script's stdout: at each ``iter N`` line (the end of an iteration) the next step's setting is put in place."""

    def __init__(self, warmup: int, observer: TrainingObserver):
        super().__init__()
        self.warmup, self.observer, self.step = warmup, observer, 0
        self.clock = Clock()
        self.debug: HookSwitch | None = None
        self.watching = False

    def write(self, text: str) -> int:
        if text.startswith("iter "):
            self.clock.lap()
            self.step += 1
            self.switch(setting_of(self.step, self.warmup))
        return super().write(text)

    def switch(self, setting: str) -> None:
        if setting == "watched" and not self.watching:
            self.observer.__enter__()
        elif setting != "watched" and self.watching:
            self.observer.__exit__(None, None, None)
        self.watching = setting == "watched"
        if self.debug is None and self.observer._models:  # the script's model, found by the first watched step
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(self.observer._models[0])
            self.debug = HookSwitch(self.observer._models[0], DebugUnderflowOverflow)
        if self.debug is not None:
            self.debug.set(setting == "debug")


def script_step_times(args: argparse.Namespace) -> tuple[Clock, list[str]]:
    """The script's per-iteration times, and each iteration's setting (the first debug step before the model was
    found by a watched one runs plain: it is left out)."""
    steps = total_steps(args)
    with tempfile.TemporaryDirectory() as capsules:
        out = SwitchingStdout(args.warmup, TrainingObserver(WatchOptions(capsule_dir=Path(capsules))))
        try:
            with contextlib.redirect_stdout(out):
                run_target(Target(str(SCRIPT), ("--iters", str(steps))))
        finally:
            out.switch("plain")
    settings = [setting_of(i, args.warmup) for i in range(steps)]
    first_watched = settings.index("watched")
    settings = [("skip" if s == "debug" and i < first_watched else s) for i, s in enumerate(settings)]
    return out.clock, settings


def run_script(iters: int, watched: bool) -> str:
    """The script's stdout, run once in this process as ``python SCRIPT ARGS`` would (under the watch, or not)."""
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as capsules, contextlib.redirect_stdout(out):
        with TrainingObserver(WatchOptions(capsule_dir=Path(capsules))) if watched else contextlib.nullcontext():
            run_target(Target(str(SCRIPT), ("--iters", str(iters))))
    return out.getvalue()


# --- Hugging Face Trainer ---------------------------------------------------------------------------------------
def hf_step_times(args: argparse.Namespace) -> tuple[Clock, list[str]]:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
    from transformers.debug_utils import DebugUnderflowOverflow

    from fp16doctor.integrations.hf import FP16DoctorCallback

    steps = total_steps(args)
    settings = [setting_of(i, args.warmup) for i in range(steps)]

    class Switch(TrainerCallback):
        """Puts each step's setting in place at its start: the doctor's callback attached (its ``on_train_begin``)
        or detached (``on_train_end``: hooks and patches gone), the Trainer's own debug hooks on or off."""

        def __init__(self) -> None:
            self.doctor = FP16DoctorCallback()
            self.on = False
            self.debug: HookSwitch | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            setting = settings[state.global_step]
            if setting == "watched" and not self.on:
                self.doctor.on_train_begin(args, state, control, model=model, **kwargs)
            elif setting != "watched" and self.on:
                self.doctor.on_train_end(args, state, control, model=model, **kwargs)
            self.on = setting == "watched"
            self.debug = self.debug or HookSwitch(model, DebugUnderflowOverflow)
            self.debug.set(setting == "debug")

        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            if self.on:
                self.doctor.on_pre_optimizer_step(*a, **kw)

        def on_step_end(self, *a: Any, **kw: Any) -> Any:
            return self.doctor.on_step_end(*a, **kw)

        def on_train_end(self, *a: Any, **kw: Any) -> None:
            if self.on:
                self.doctor.on_train_end(*a, **kw)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.clock = Clock()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.clock.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.clock.stop()

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
    )
    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(1, 1000, (64,), generator=g), "labels": torch.tensor(i % 2)}
        for i in range(16 * steps)
    ]
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        train_args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=16,
            max_steps=steps,
            use_cpu=True,
            fp16=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10_000,
            debug="underflow_overflow",
        )
        with contextlib.redirect_stdout(io.StringIO()):
            Trainer(
                model=BertForSequenceClassification(config),
                args=train_args,
                train_dataset=rows,
                callbacks=[Switch(), clock],
            ).train()  # the switch before the clock: switching is not timed
    return clock.clock, settings


# --- Lightning --------------------------------------------------------------------------------------------------
def lightning_step_times(args: argparse.Namespace) -> tuple[Clock, list[str]]:
    import logging

    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset
    from transformers.debug_utils import DebugUnderflowOverflow

    from fp16doctor.integrations.lightning import FP16DoctorCallback

    steps = total_steps(args)
    settings = [setting_of(i, args.warmup) for i in range(steps)]

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

    class Switch(L.Callback):
        """The doctor's callback sees the watched steps only (its events are passed on then); the detector's hooks
        are on for the debug steps only."""

        def __init__(self, module: L.LightningModule) -> None:
            self.doctor, self.setting = FP16DoctorCallback(), "plain"
            self.debug = HookSwitch(module, DebugUnderflowOverflow)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.doctor.on_train_start(trainer, pl_module)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.setting = settings[batch_idx]
            self.debug.set(self.setting == "debug")
            if self.setting == "watched":
                self.doctor.on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if self.setting == "watched":
                self.doctor.on_before_backward(trainer, pl_module, loss)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.setting == "watched":
                self.doctor.on_before_optimizer_step(trainer, pl_module, optimizer)

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.clock = Clock()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.clock.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.clock.stop()

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" lines
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 512, (8 * steps, 64), generator=g), torch.randint(0, 2, (8 * steps,), generator=g)
    module, clock = Classifier(), StepClock()
    DebugUnderflowOverflow(module)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu",
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
            max_steps=steps,
            callbacks=[Switch(module), clock],
            default_root_dir=root,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(TensorDataset(ids, labels), batch_size=8))
    return clock.clock, settings


WORKLOADS: dict[str, Callable[[argparse.Namespace], tuple[Clock, list[str]]]] = {
    "script": script_step_times,
    "hf": hf_step_times,
    "lightning": lightning_step_times,
}


# --- measuring --------------------------------------------------------------------------------------------------
def paired_ratios(times: list[float], settings: list[str]) -> tuple[dict[str, list[float]], list[float]]:
    """Each watched and debug step over the mean of the plain steps on either side; and the plain steps' times."""
    ratios: dict[str, list[float]] = {"watched": [], "debug": []}
    plains = [t for t, s in zip(times, settings) if s == "plain"]
    for i in range(1, len(times) - 1):
        if settings[i] in ratios and settings[i - 1] == settings[i + 1] == "plain":
            ratios[settings[i]].append(times[i] / ((times[i - 1] + times[i + 1]) / 2))
    return ratios, plains


class HostReads(TorchFunctionMode):
    """Counts the Python-level reads of a tensor's value: on a GPU each is a device-to-host synchronisation."""

    READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
    }

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def script_counts(watched: bool) -> tuple[float, float]:
    """Aten operators and host reads per optimizer step of the script: (4 iterations - 2 iterations) / 2."""
    totals = []
    for iters in (2, 4):
        ops, reads = DispatchCounter(), HostReads()
        with ops, reads:
            run_script(iters, watched)
        totals.append((ops.total, reads.count))
    return (totals[1][0] - totals[0][0]) / 2, (totals[1][1] - totals[0][1]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="(plain, watched, plain, debug) cycles per workload")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default; one by default: "
        "threads that wait for a busy neighbour's core spin and blur the CPU time)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, fp16 with a GradScaler; per workload one "
        f"run: {args.warmup} warm-up steps, then {args.rounds} x (plain, watched, plain, debug), plain",
        flush=True,
    )
    if "script" in args.only:
        (plain_ops, plain_reads), (watched_ops, watched_reads) = script_counts(False), script_counts(True)
        print(
            f"script, per optimizer step: {plain_ops:.0f} aten ops plain, {watched_ops - plain_ops:+.0f} watched; "
            f"{plain_reads:.0f} host reads plain, {watched_reads - plain_reads:+.0f} watched",
            flush=True,
        )
    for workload in args.only:
        clock, settings = WORKLOADS[workload](args)
        if len(clock.cpu) != len(settings):
            raise SystemExit(f"{workload}: {len(clock.cpu)} step times for {len(settings)} steps")
        (cpu, plain_cpu), (wall, plain_wall) = paired_ratios(clock.cpu, settings), paired_ratios(clock.wall, settings)
        print(
            f"{workload:9s} plain step: CPU {statistics.median(plain_cpu) * 1e3:.1f} ms, wall {statistics.median(plain_wall) * 1e3:.1f} ms "
            f"(IQR {iqr(plain_wall) * 1e3:.1f} ms)",
            flush=True,
        )
        for setting, label in (
            ("watched", "fp16doctor watch" if workload == "script" else "FP16DoctorCallback"),
            ("debug", "DebugUnderflowOverflow"),
        ):
            ratio = statistics.median(cpu[setting])
            verdict = (
                f"  (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})" if setting == "watched" else ""
            )
            print(
                f"  {label + ' / plain':32s} CPU {ratio:.3f} IQR {iqr(cpu[setting]):.3f}, wall {statistics.median(wall[setting]):.3f} "
                f"IQR {iqr(wall[setting]):.3f}, {len(cpu[setting])} pairs{verdict}",
                flush=True,
            )


if __name__ == "__main__":
    main()
