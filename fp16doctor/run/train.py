"""``fp16doctor train``: the corrected training run, on the CPU, one GPU or many processes.

The loop is the probe engine's (the canonical AMP step of :mod:`.loop`, or the
file's own ``train_step``, with every runtime fix of ``config.overrides``),
streamed over the user's ``data()`` epoch after epoch, watched cheaply (loss,
gradient norm, scale, skips: no per-layer hooks), checkpointed atomically
every K steps, and resumable bit for bit on the CPU.

Run directory (``--run-dir``, default ``runs/<training file name>``):

* ``metrics.csv``: one row per step, written as it goes;
* ``checkpoints/step_XXXXXXXX.pt``: model, optimizer, scheduler, scaler, RNG
  (every rank's), data position; loads with ``torch.load(weights_only=True)``;
  the newest three are kept;
* ``nonfinite_step_N.json`` / ``.md``: the replayed diagnosis of the first
  non-finite step;
* ``summary.json``: how the run ended.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import DoctorConfig
from ..engine.ddp import half_precision_comm_hooks
from ..engine.instruments import InstrumentOptions
from ..engine.probe import Probe, Workbench
from ..engine.rng import rng_state, set_rng_state
from ..errors import DoctorError, TrainingFileError, one_line
from ..files import atomic_torch_save, atomic_write_text, jsonable
from ..measure.localise import trace_step
from ..tensors import OUT_OF_MEMORY, parameter_sums
from ..userfile.batches import check_batch
from ..userfile.spec import TrainingSpec
from .checkpoint_state import load_whole_state, shards_parameters, whole_state

KEEP_CHECKPOINTS = 3
METRIC_COLUMNS = ["step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "nonfinite", "seconds", "micro_step"]
"""``skipped``: the scaler skipped an attempted optimizer step; ``micro_step``: a gradient-accumulation
micro-batch (no optimizer step attempted, not a skip)."""


@dataclass
class TrainOptions:
    """How the run is kept and how it reacts to trouble."""

    run_dir: Path
    checkpoint_every: int = 50
    """K: a checkpoint every K steps (a SIGKILL loses at most K steps)."""
    resume: bool = False
    """Continue from the newest checkpoint in run_dir."""
    on_nonfinite: str = "skip"
    """skip: like the GradScaler, skip the step and go on (stopping after max_nonfinite in a row); stop: stop at once."""
    max_nonfinite: int = 20
    """Consecutive non-finite steps after which a skipping run stops."""


@dataclass
class Distributed:
    """This process's place in a torchrun job (world 1: a plain run)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Distributed:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


@dataclass
class TrainResult:
    """How the run ended, for the summary and the exit code."""

    status: str
    """completed | stopped | interrupted | failed"""
    steps: int
    first_step: int
    skipped: int = 0
    nonfinite: int = 0
    first_nonfinite: dict[str, Any] | None = None
    reason: str = ""
    final_loss: float | None = None
    last_checkpoint: str | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """What the run noted about how it ran the training (compiled, ...): under torchrun, rank 0's, which the
    launching command says."""

    @property
    def ok(self) -> bool:
        return self.status == "completed"


class BatchStream:
    """The user's ``data()``, epoch after epoch; ``position`` counts batches drawn (the checkpoint's data position)."""

    def __init__(self, spec: TrainingSpec):
        self.spec = spec
        self.position = 0
        self._iterator: Iterator[Any] | None = None

    def _next_raw(self) -> Any:
        for attempt in range(2):
            if self._iterator is None:
                self._iterator = iter(self.spec.data())
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
                if attempt:
                    raise TrainingFileError("data() yielded no batches.") from None
        raise AssertionError("unreachable")

    def next(self) -> Any:
        batch = self._next_raw()
        check_batch(batch, self.position)
        self.position += 1
        return batch

    def skip(self, count: int) -> None:
        for _ in range(count):
            self.next()


SHARDED_NOT_REPLAYED = (
    "not replayed: the model is sharded (FSDP), and the operator tracer does not replay a sharded step yet; "
    "torchrun -m fp16doctor watch names the rank, micro-batch and first module of a sharded run's non-finite step"
)
"""The first non-finite step's explanation where the ranks shard the model."""


def checkpoint_paths(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step_*.pt"))


COMPILED_TRAINING = "train runs the model compiled, as model() and the config's compile settings compile it"


class Trainer:
    """One process's training run (rank ``dist.rank`` of ``dist.world``)."""

    def __init__(
        self, spec: TrainingSpec, config: DoctorConfig, options: TrainOptions, dist: Distributed | None = None
    ):
        self.spec, self.config, self.options = spec, config, options
        self.dist = dist or Distributed()
        self.run_dir = Path(options.run_dir)
        self.mode = "bf16" if config.dtype == "bfloat16" else "amp"
        self.bench = Workbench(spec, config, batch_count=1)  # initial weights as the diagnosis saw them
        # A compiled training trains compiled, as its compile settings say (the corrected config's among them): its
        # numerics are the compiled program's, not eager's. On the ranks the wrapped model is compiled, as a
        # training compiles its DDP or FSDP module.
        self.probe: Probe = self.bench.probe(
            self.mode,
            config,
            instruments=None,
            compiled=True,
            parallelize=self._wrapped if self.dist.world > 1 else None,
        )
        if self.probe.runs_compiled:
            spec.note(COMPILED_TRAINING)
        self.inner_model: torch.nn.Module = self.probe.built_model
        """The model as ``model()`` built it, under the ranks' wrapper: what checkpoints hold."""
        self.stream = BatchStream(spec)
        self.snapshot: tuple[Any, int, list[Any]] | None = None
        """(probe snapshot, stream position, batches since) for replaying a bad step."""

    # --- distributed -------------------------------------------------------------------------------
    def _wrapped(self, model: torch.nn.Module) -> torch.nn.Module:
        """The file's ``parallelize()`` of the built model, or DistributedDataParallel (gradients all-reduced in
        their dtype, fp32 master grads, unless the training registers a hook): before the optimizers are made, which
        must hold the parameters FSDP shards."""
        if self.spec.parallelize is not None:  # the training's own topology
            return self.spec.parallelized(model)
        device_ids = [self.bench.device.index or 0] if self.bench.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def _agree(self, flag: bool) -> bool:
        """Every rank takes the same decision (any rank's flag)."""
        if self.dist.world == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.probe.device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return bool(value.item() > 0)

    def _global_mean(self, value: float) -> float:
        """The mean over ranks (each rank's loss is its own shard's): the global batch's loss."""
        if self.dist.world == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.probe.device)
        torch.distributed.all_reduce(tensor)
        return float(tensor.item()) / self.dist.world

    def _rank_report(self, result: TrainResult) -> None:
        """Each rank's fingerprint: parameters (a sharded one whole), scale and skips must agree on every rank."""
        report = {
            "rank": self.dist.rank,
            **parameter_sums(self.inner_model.parameters()),
            "loss_scale": float(self.probe.scaler.get_scale()) if self.probe.scaler.is_enabled() else 1.0,
            "skipped": result.skipped,
            "steps": result.steps,
        }
        atomic_write_text(
            self.run_dir / "ranks" / f"rank{self.dist.rank}.json", json.dumps(jsonable(report), allow_nan=False)
        )

    def comm_hook_findings(self) -> list[dict[str, Any]]:
        """An fp16/bf16 gradient-compression hook on DDP: gradients then travel in half precision."""
        half = half_precision_comm_hooks(self.probe.model)
        if not half:
            return []
        return [
            {
                "cause": "ddp-half-allreduce",
                "severity": "warning",
                "title": f"DDP gradients are all-reduced in half precision ({', '.join(half)})",
                "fix": "Remove the compression hook (gradients should be reduced in fp32), or accept the lost precision knowingly.",
            }
        ]

    # --- checkpoints -------------------------------------------------------------------------------
    def _checkpoint(self, step: int) -> str | None:
        """Rank 0 writes model, optimizer, scheduler, scaler, every rank's RNG and the data position."""
        rngs: list[Any] = [rng_state()]
        if self.dist.world > 1:
            rngs = [None] * self.dist.world
            torch.distributed.all_gather_object(rngs, rng_state())
        probe = self.probe
        model_state, optimizer_states = whole_state(self.inner_model, probe.model, probe.optimizers)  # sharded: all
        if not self.dist.main:
            return None
        state = {
            "step": step,
            "data_position": self.stream.position,
            "world": self.dist.world,
            "model": model_state,
            "optimizer": optimizer_states[probe.optimizers.name_of(probe.optimizer) or ""],
            "optimizers": optimizer_states,  # every optimizer by name (optimizers(model) gives several)
            "scheduler": probe.schedulers[0].state_dict() if probe.schedulers else None,
            "schedulers": [scheduler.state_dict() for scheduler in probe.schedulers],
            "scaler": probe.scaler.state_dict(),
            "rng": rngs,
            "config": json.loads(json.dumps(self.config.to_dict())),
        }
        path = self.run_dir / "checkpoints" / f"step_{step:08d}.pt"
        atomic_torch_save(path, state)  # temp file + rename: a crash never leaves a broken one
        for old in checkpoint_paths(self.run_dir)[:-KEEP_CHECKPOINTS]:
            old.unlink(missing_ok=True)
        return str(path)

    def _resume(self) -> int:
        paths = checkpoint_paths(self.run_dir)
        if not paths:
            raise DoctorError(
                f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}.",
                hint="Run without --resume to start fresh.",
            )
        state = torch.load(paths[-1], map_location=self.probe.device, weights_only=True)
        if state["world"] != self.dist.world:
            raise DoctorError(
                f"the checkpoint was written by {state['world']} process(es), this run has {self.dist.world}.",
                hint="Resume with the same --nproc.",
            )
        optimizers = self.probe.optimizers
        optimizer_states = state.get("optimizers") or {optimizers.name_of(self.probe.optimizer): state["optimizer"]}
        load_whole_state(self.inner_model, self.probe.model, optimizers, state["model"], optimizer_states)
        schedulers = state.get("schedulers") or ([state["scheduler"]] if state["scheduler"] is not None else [])
        for scheduler, scheduler_state in zip(self.probe.schedulers, schedulers):
            scheduler.load_state_dict(scheduler_state)
        self.probe.scaler.load_state_dict(state["scaler"])
        self.stream.skip(state["data_position"])  # data() replays deterministically up to the position...
        set_rng_state(state["rng"][self.dist.rank])  # ...then the RNG continues where it stopped
        self.probe.iteration = self.probe.cursor = state["step"]
        return int(state["step"])

    # --- the loop ----------------------------------------------------------------------------------
    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
        """Train config.steps steps (from the newest checkpoint with ``resume``)."""
        start = self._resume() if self.options.resume else 0
        result = TrainResult(status="completed", steps=start, first_step=start)
        metrics = self._open_metrics(start)
        self.snapshot = (self.probe.snapshot(), self.stream.position, [])
        in_a_row = 0
        attempted, moved = 0, False  # optimizer steps attempted (not accumulation micro-batches); any applied
        began = time.perf_counter()
        interrupted = _InterruptFlag()
        try:
            for step in range(start, self.config.steps):
                if self._agree(interrupted.raised):
                    raise KeyboardInterrupt
                tick = time.perf_counter()
                batch = self._next_batch()
                self.snapshot[2].append(batch)
                try:
                    record = self.probe.step(batch, step)  # the canonical AMP step (or the file's train_step)
                except OUT_OF_MEMORY as exc:  # the run stops as failed, its checkpoints and metrics kept
                    result.status, result.reason = "failed", f"out of memory at step {step}: {one_line(exc)}"
                    break
                if record.exception_type is not None:
                    result.status, result.reason = (
                        "failed",
                        f"{record.exception_type}: {record.exception} ({record.exception_location})",
                    )
                    break
                nonfinite = self._agree(record.nonfinite_loss or record.nonfinite_grads)
                row = {
                    "step": step,
                    "loss": self._global_mean(record.loss),
                    "grad_norm": record.grad_norm,
                    "lr": record.lr,
                    "loss_scale": record.loss_scale,
                    "skipped": record.skipped,
                    "nonfinite": nonfinite,
                    "seconds": time.perf_counter() - tick,
                    "micro_step": record.micro_step,
                }
                self._write_metric(metrics, row)
                result.steps = step + 1
                result.skipped += int(record.skipped)
                attempted += int(not record.micro_step)
                moved = moved or bool(record.optimizer_stepped)  # any optimizer (a GAN's other one counts)
                result.final_loss = record.loss if math.isfinite(record.loss) else result.final_loss
                if nonfinite:
                    result.nonfinite += 1
                    in_a_row += 1
                    if result.first_nonfinite is None:
                        result.first_nonfinite = self._diagnose_step(step, row)
                    if self.options.on_nonfinite == "stop" or in_a_row >= self.options.max_nonfinite:
                        result.status = "stopped"
                        result.reason = (
                            f"non-finite step {step}"
                            if self.options.on_nonfinite == "stop"
                            else f"{in_a_row} non-finite steps in a row (up to step {step})"
                        )
                        break
                else:
                    in_a_row = 0
                if on_step is not None and self.dist.main:
                    on_step(row)
                if (step + 1) % self.options.checkpoint_every == 0 or step + 1 == self.config.steps:
                    result.last_checkpoint = self._checkpoint(step + 1) or result.last_checkpoint
                    self.snapshot = (self.probe.snapshot(), self.stream.position, [])
        except KeyboardInterrupt:
            # Ctrl-C is only acted on between steps (see _InterruptFlag), so the checkpoint holds
            # exactly the completed steps and --resume continues as if nothing happened.
            result.status, result.reason = "interrupted", "Ctrl-C"
            result.last_checkpoint = self._checkpoint(result.steps) or result.last_checkpoint
        finally:
            interrupted.restore()
            metrics.close()
        if result.status == "completed" and start == 0 and attempted and not moved:
            result.status = "stopped"  # it reached its last step, but nothing was trained (a resumed run had trained)
            result.reason = (
                f"every one of the {attempted} optimizer steps was skipped (non-finite gradients): the weights "
                "never moved"
            )
        result.seconds = time.perf_counter() - began
        result.findings = self.comm_hook_findings()  # after the run: a train_step may register one on its first step
        result.notes = list(self.spec.notes)
        if self.dist.world > 1:
            self._rank_report(result)
        if self.dist.main:
            atomic_write_text(
                self.run_dir / "summary.json", json.dumps(jsonable(asdict(result)), indent=2, allow_nan=False)
            )
        return result

    def _next_batch(self) -> Any:
        """Each rank takes its own shard: of every ``world`` consecutive batches, the rank-th."""
        batches = [self.stream.next() for _ in range(self.dist.world)]
        return batches[self.dist.rank]

    # --- metrics -----------------------------------------------------------------------------------
    def _open_metrics(self, start: int) -> Any:
        path = self.run_dir / "metrics.csv"
        if not self.dist.main:
            return open(os.devnull, "w")
        rows = []
        if start and path.exists():  # keep the rows of the steps the checkpoint holds
            with open(path, newline="") as handle:
                rows = [r for r in csv.DictReader(handle) if int(r["step"]) < start]
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, buffer.getvalue())
        return open(path, "a", newline="")

    @staticmethod
    def _write_metric(handle: Any, row: dict[str, Any]) -> None:
        csv.DictWriter(handle, fieldnames=METRIC_COLUMNS).writerow(row)
        handle.flush()

    # --- the first non-finite step -------------------------------------------------------------------
    def _diagnose_step(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        """Replay the step from the last snapshot with the instruments and the operator tracer; write it next to the run."""
        assert self.snapshot is not None, "the run takes its first snapshot before its first step"
        snap, _, batches = self.snapshot
        report: dict[str, Any] = {"step": step, **row}
        if shards_parameters(self.probe.model):  # every rank alike: the same model, the same decision
            report.update(localisation=None, first_nonfinite_module=None, explanation=SHARDED_NOT_REPLAYED)
            self._write_step_report(step, report)
            return report
        current = self.probe.snapshot()
        try:
            self.probe.restore(snap)
            for earlier in batches[:-1]:
                self.probe.step(earlier)
            # one step, counted exactly; trace_step runs it forced eager, so the module hooks see every module
            instruments = self.probe.instrument(InstrumentOptions(count_nonfinite=True), eager_step=True)
            localisation = trace_step(self.probe, batches[-1], step)
            first = instruments.first_nonfinite_forward()
            report["localisation"] = localisation.to_json() if localisation else None
            report["first_nonfinite_module"] = first
            report["explanation"] = self._explain(row, localisation, self.probe.runs_compiled)
        finally:
            if self.probe.instruments is not None:
                self.probe.instruments.detach()
                self.probe.instruments = None
            self.probe.restore(current)
        self._write_step_report(step, report)
        return report

    def _write_step_report(self, step: int, report: dict[str, Any]) -> None:
        if self.dist.main:
            base = self.run_dir / f"nonfinite_step_{step}"
            atomic_write_text(base.with_suffix(".json"), json.dumps(jsonable(report), indent=2, allow_nan=False))
            atomic_write_text(base.with_suffix(".md"), _markdown_step(report))

    @staticmethod
    def _explain(row: dict[str, Any], localisation: Any, compiled: bool) -> str:
        if localisation is None and compiled:  # the operator tracer replays the step eager
            return (
                "the eager replay stayed finite: the compiled program makes the fault (fp16doctor diagnose localises "
                "it in its compiled stage)"
            )
        if localisation is None:
            return "the replay stayed finite: a non-deterministic fault"
        where = f"{localisation.operator} in {localisation.module} ({localisation.phase})"
        if localisation.phase == "backward" and math.isfinite(row["loss"]):
            return f"gradients overflow in backward at loss scale {row['loss_scale']:.0f} ({where}): the GradScaler skips the step and lowers the scale"
        return f"{localisation.output} first produced by {where}"


class _InterruptFlag:
    """SIGINT sets a flag the loop reads between steps (a step is never cut in half); a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave the default behaviour
            self._previous = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _markdown_step(report: dict[str, Any]) -> str:
    lines = [
        f"# Non-finite step {report['step']}",
        "",
        report.get("explanation", ""),
        "",
        "```json",
        json.dumps({k: v for k, v in report.items() if k != "explanation"}, indent=2, default=str),
        "```",
    ]
    return "\n".join(lines) + "\n"
