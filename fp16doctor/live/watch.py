"""A live watch on a running training: cheap per-step numbers, alarms, and replay capsules.

The engine under ``fp16doctor watch`` (:mod:`fp16doctor.live.observe`) and the Hugging Face and
Lightning callbacks (``fp16doctor.live.integrations``), usable from a hand-written loop too. Per
optimizer step, at one host synchronisation, it records the loss, the unscaled global gradient norm,
the loss scale, whether the GradScaler skips the step (the scaler's own found-inf flags where the
caller hands them over), the learning rate, and per layer whether the gradients are finite and their
norm (the largest one named). It raises an alarm on the
first non-finite loss or gradient, a streak of skipped steps, a scale
collapsing towards its minimum, or a loss spike; on an alarm it writes a
*replay capsule*: the model and optimizer state the bad step started from, its
batch(es), the scaler's state, RNG states, the config, and a small training
file that rebuilds it all, so that ``fp16doctor diagnose --capsule DIR``
diagnoses hours-into-a-run failures offline, in seconds, on CPU.

The watch is called *before* the optimizer step, where everything an alarm
needs is known and the weights have not moved yet: the capsule holds exactly
the state the failing step started from.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from ..config import CALIBRATION_SKIPS
from ..engine.rng import callers_rng_kept, rng_state
from ..files import atomic_torch_save, atomic_write_bytes, atomic_write_text
from ..tensors import dtype_name, grad_values, norms
from ..userfile.batches import map_tensors
from ..userfile.compiled import CompileOptions
from .capsule import (
    BACKEND_FILE,
    CAPSULE_FORMAT,
    OPTIMIZER_FILE,
    SHARDS,
    CapsuleContents,
    LossRecord,
    ReplayStart,
    capsule_config,
    capsule_folder,
    capsule_training_file,
    constructor_settings,
    cpu_copy,
    detached_module,
    import_roots,
    loss_gradient_finding,
    pickled_optimizer_class,
    positioned_optimizer_state,
    replay_inputs,
    write_manifest,
)
from .sharding import local_part
from .stepstate import StateReport, StepStartKeeper

EARLY_SPIKE_STEPS = 3
"""The fewest earlier finite losses a spike is measured against."""
ALARMS = ("nonfinite", "skip-streak", "scale-collapse", "loss-spike", "rank-disagreement", "rank-divergence")


@dataclass
class WatchOptions:
    """When the watch alarms and what it does then."""

    capsule_dir: Path = Path("fp16doctor_capsules")
    """Where replay capsules are written (one folder per alarm)."""
    stop_on_alarm: bool = True
    """Stop the training at the first alarm (the callbacks ask their trainer to stop)."""
    skip_streak: int = 5
    """This many optimizer steps skipped in a row is an alarm. Skips of a fresh GradScaler calibrating its
    initial scale (before its first applied step) are settling, as the diagnosis counts them: they alarm at
    ``max(skip_streak, CALIBRATION_SKIPS + 1)`` in a row (each halves the scale: 2^16 down to 2^6 in 10)."""
    min_scale: float = 1.0
    """A loss scale at or below this has collapsed: the gradients overflow even unscaled."""
    spike_factor: float = 10.0
    """A loss above this multiple of the recent median is a spike."""
    spike_window: int = 20
    """Steps in the running median the spike compares against. Before half of them have passed, a loss spikes above
    the square of ``spike_factor`` times the median of the steps so far (at least 3)."""
    alarms: tuple[str, ...] = ALARMS
    """Which alarms are raised."""
    norms_every: int = 5
    """Where a GradScaler decides the skip, the per-layer gradient norms (the history's ``grad_norm``, the largest
    layer) are read every this many optimizer steps, and at every step the scaler skips or whose loss is not finite:
    all an alarm reads, for half the watch's cost on a small model. A capsule's 50 steps of history then hold ten
    norms at least (the gradient-norm growth a log reader looks for needs six). Without a scaler they are read at
    every step: they are how a non-finite gradient that nothing skips is seen. 1: every step."""
    checksum_every: int = 100
    """Under torchrun: every this many ``GradScaler.update()`` calls (from the first) the ranks compare a checksum
    of the parameters each holds whole (a DDP model's); a difference is ``rank-divergence``."""
    rank_timeout: float | None = None
    """Under torchrun: seconds a rank waits for the others in the watch's own all-gather before it stops with a
    message naming it; None: the process group's own timeout."""
    gather_limit_mb: float = 4096.0
    """Where the ranks capture a step together (FSDP; DDP with a compression hook): the largest whole model and
    optimizer state (MiB) the capsule gathers onto rank 0's CPU. Past it, every rank saves its own shards with
    ``torch.distributed.checkpoint`` into the capsule (on a filesystem every rank writes to), and the replay reads
    them whole: rank 0's memory never holds the whole state during the run."""


HISTORY_KEPT = 50
"""The last optimizer steps a capsule keeps of its watch's history."""


@dataclass
class StepNumbers:
    """What the watch measured at one optimizer step."""

    step: int
    loss: float | None
    """The loss the step optimised (summed over its micro-batches); None: no loss was seen (never an alarm)."""
    grad_norm: float | None
    """The unscaled gradients' L2 norm; None: not read at this step (see ``WatchOptions.norms_every``)."""
    loss_scale: float
    skipped: bool
    lr: float
    nonfinite_layers: list[str] = field(default_factory=list)
    largest_layer: str | None = None
    """The layer whose (unscaled) gradient has the largest norm."""
    largest_norm: float | None = 0.0
    """Its norm; None: the norms were not read at this step."""
    local: bool = False
    """The gradient norms and non-finite layers are this rank's shard's (a sharded model), not the whole model's."""
    own_nonfinite: bool | None = None
    """This rank's own gradients were non-finite before the ranks reduced them; None: not measured."""


@dataclass
class Alarm:
    """Why the watch raised, at which step, and where its capsule is."""

    kind: str
    step: int
    message: str
    capsule: Path | None = None
    optimizer: str | None = None
    """Which optimizer's step (``Adam (Discriminator)``) where the training has several; their steps count apart."""
    no_capsule: str | None = None
    """Why no capsule was written, where one would have been."""
    rank: int | None = None
    """The rank that raised it, under torchrun."""

    def pointer(self) -> str:
        """The one line a user sees."""
        where = (
            f" Capsule: {self.capsule}. Diagnose it: fp16doctor diagnose --capsule {self.capsule}"
            if self.capsule
            else f" No capsule: {self.no_capsule}."
            if self.no_capsule
            else ""
        )
        of = f" of {self.optimizer}" if self.optimizer else ""
        on = f" on rank {self.rank}" if self.rank is not None else ""
        return f"fp16doctor: {self.kind} at optimizer step {self.step}{of}{on}: {self.message}.{where}"


class Watch:
    """Attach to a model; feed it micro-batches and losses; call :meth:`before_optimizer_step` once per optimizer step."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: WatchOptions | None = None,
        framework: str = "torch",
        dtype: str | None = None,
    ):
        self.model = model
        self.options = options or WatchOptions()
        self.framework = framework
        self.dtype = dtype
        """The low precision the training runs in (float16 / bfloat16); None: float16 with a scaler, else bfloat16."""
        self.history: list[StepNumbers] = []
        self.alarm: Alarm | None = None
        self._batches: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._loss_dtypes: set[str] = set()
        self.output_grads: list[tuple[list[torch.Tensor | None], bool]] = []
        self.rank: int | None = None
        """The process's rank under torchrun (capsule names carry it); None: a single process."""
        self.label: str | None = None
        """The optimizer and model this watch checks, named in its alarms where a training has several optimizers."""
        self._streak = 0
        self._calibrating = False
        """A fresh scaler is still settling from its initial scale: the watch began at optimizer step 0, the scaler
        holds no loaded state, and no step has been applied since."""
        self.scaler_resumed = False
        """The scaler was loaded from a saved state (set by whoever sees ``load_state_dict``: ``fp16doctor watch``'s
        observer): its scale has settled, though ``load_state_dict`` made it the scaler's ``init_scale``."""
        self._names = {p: n for n, p in model.named_parameters()}
        self.sharded = False
        """Each rank holds a shard of the model: the gradient numbers are the rank's shard's."""
        self.no_capsule: str | None = None
        """Why this watch writes no capsule (a sharded model's state is spread over the ranks); None: it writes them."""
        self.compiled: CompileOptions | None = None
        """How the model's program was compiled (its ``modules``: the blocks compiled one by one, the model around them
        eager; None: it ran eager); its capsule records it, and its replay compiles the same."""
        self.unseen_forward = "the watch saw no forward of the model in this step"
        """Why no capsule, where the watch saw none of the step's forwards (they hold the batches it replays)."""
        self.step_state = StepStartKeeper()
        """The state the model's forward writes to, as the current step found it (:mod:`.stepstate`); the observer
        of ``fp16doctor watch`` gives the watch the keeper its forward hooks have filled since the step began."""

    # --- feeding -------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The step's first forward is about to run: keep the state the model's forward writes to, as it is now
        (references, and copies of what earlier forwards wrote in place: :mod:`.stepstate`). Idempotent within a
        step: the callbacks call it before each micro-batch's forward."""
        self.step_state.begin(self.model)

    def capture_batch(self, batch: Any) -> None:
        """A micro-batch of the current optimizer step: a reference, held until the step is checked.

        It is copied to the host only when an alarm writes a capsule, so a healthy step costs no transfer."""
        self._batches.append(batch)

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """A micro-batch's loss (a device tensor: no synchronisation here), and the dtype it was computed in."""
        self._losses.append(
            loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        )
        self._loss_dtypes.add(dtype_name(loss.dtype) if isinstance(loss, torch.Tensor) else "float")

    # --- the check -------------------------------------------------------------------------------------
    def before_optimizer_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        grads_scaled: bool = False,
        found_inf: torch.Tensor | None = None,
        own_nonfinite: torch.Tensor | None = None,
    ) -> Alarm | None:
        """Measure this optimizer step (one host sync), decide on an alarm, write its capsule; then forget the step.

        ``found_inf`` is the scaler's own decision (its inf/NaN flags, summed over devices): the step is
        skipped exactly when it is non-zero. Without it the skip is inferred from the gradients' finiteness.
        The training's random generators are left as they were: the measurement draws no random number, and
        the capsule is written inside :func:`callers_rng_kept` (saving and restoring every generator on each
        step would cost a healthy step more than the measurement itself).

        ``own_nonfinite`` counts this rank's own gradients that were non-finite before the ranks reduced them (a
        device tensor, read in the same transfer)."""
        return self._check_step(step, optimizer, scaler, grads_scaled, found_inf, own_nonfinite)

    def _check_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        grads_scaled: bool,
        found_inf: torch.Tensor | None,
        own_nonfinite: torch.Tensor | None = None,
    ) -> Alarm | None:
        try:
            numbers = self._measure(step, optimizer, scaler, grads_scaled, found_inf, own_nonfinite)
            if not self.history:  # a fresh training's first step, at its scaler's own initial scale
                self._calibrating = (
                    step == 0 and not self.scaler_resumed and at_initial_scale(scaler, numbers.loss_scale)
                )
            self.history.append(numbers)
            kind, message = self._decide(numbers)
            if kind is not None and self.alarm is None:
                self.alarm = Alarm(kind, step, message, optimizer=self.label, rank=self.rank)
                self.capsule_for(self.alarm, optimizer, scaler, numbers)
                return self.alarm
            return None
        finally:
            self.forget_step()

    def capsule_for(self, alarm: Alarm, optimizer: torch.optim.Optimizer, scaler: Any, numbers: StepNumbers) -> None:
        """Write the alarm's capsule, or say why there is none: a capsule that cannot be written leaves the alarm
        without one (the alarm still stops the run), never the training broken."""
        if self.no_capsule is not None:
            alarm.no_capsule = self.no_capsule
            return
        if not self._batches:  # nothing to replay the step on
            alarm.no_capsule = self.unseen_forward
            return
        try:
            alarm.capsule = self.write_capsule(optimizer, scaler, numbers)
        except Exception as exc:  # noqa: BLE001 - the watch's own failure, never the training's
            alarm.no_capsule = f"writing it failed ({type(exc).__name__}: {first_line(exc)})"

    def name_parameters(self, names: dict[Any, str]) -> None:
        """Name these parameters so (a wrapper's own parameters, by what they hold)."""
        self._names.update(names)

    def param_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The optimizer's parameters' names, in its order (the same on every rank)."""
        return [self._names.get(p, "?") for group in optimizer.param_groups for p in group["params"]]

    def forget_step(self) -> None:
        """Drop the references to this step's batches, losses, output gradients and start state."""
        self._batches, self._losses, self.output_grads, self._loss_dtypes = [], [], [], set()
        self.step_state.end()

    def record_output_grads(self, grads: list[torch.Tensor | None], scaled: bool) -> None:
        """The gradient of the loss w.r.t. a micro-batch's model outputs (references); ``scaled``: of the scaled loss.

        With them a capsule replays the step's forward and backward without the script's loss code."""
        self.output_grads.append((grads, scaled))

    def _measure(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        grads_scaled: bool,
        found_inf: torch.Tensor | None = None,
        own_nonfinite: torch.Tensor | None = None,
    ) -> StepNumbers:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        device = params[0].grad.device if params else torch.device("cpu")
        scale_now = scale_tensor(scaler, device)
        # every one: params have a grad; a sharded one is measured on this rank's shard
        grads = [local_part(g) for g in map(grad_values, params) if g is not None]
        # a healthy step the scaler applies needs no per-layer norm: only every norms_every-th step reads them
        every = max(1, self.options.norms_every)
        read_norms = found_inf is None or step % every == 0
        # one pass over the gradients: per-layer L2 norms, in fp32 or wider (a half gradient's norm may pass 65504)
        layer_l2 = norms(grads) if read_norms else []
        losses = self._losses or [torch.tensor(math.nan)]
        flag = found_inf if found_inf is not None else torch.tensor(0.0)
        own = own_nonfinite if own_nonfinite is not None else torch.tensor(-1.0)
        # the one transfer, of 0-d tensors in one stack (the scale too: get_scale() would be a second sync); the
        # few sums are the host's (a tensor operation costs a healthy step more than adding thirty floats)
        values = torch.stack([scalar_on(t, device) for t in (flag, scale_now, own, *losses, *layer_l2)]).tolist()
        flag_value, scale, own_value = values[:3]
        loss_values, layer_values = values[3 : 3 + len(losses)], values[3 + len(losses) :]
        loss_value = sum(loss_values) if self._losses else None
        troubled = flag_value != 0.0 or (loss_value is not None and not math.isfinite(loss_value))
        if not read_norms and troubled:  # what an alarm names: a second transfer, on trouble only
            read_norms = True
            layer_values = torch.stack([scalar_on(t, device) for t in norms(grads)]).tolist() if grads else []
        divide = scale if grads_scaled else 1.0
        layer_norms = [v / divide for v in layer_values]
        names = [self._names.get(p, "?") for p in params]
        bad = nonfinite_layers(grads, names, layer_norms)
        finite = [(v, n) for n, v in zip(names, layer_norms) if math.isfinite(v)]
        largest = max(finite, default=(0.0, None))
        return StepNumbers(
            step=step,
            loss=loss_value,
            grad_norm=math.sqrt(sum(v * v for v in layer_values)) / divide if read_norms else None,
            loss_scale=scale,
            skipped=self._skipped(flag_value, found_inf, bad, scaler),
            lr=float(optimizer.param_groups[0]["lr"]),
            nonfinite_layers=bad[:20],
            largest_layer=largest[1],
            largest_norm=largest[0] if read_norms else None,
            local=self.sharded,
            own_nonfinite=None if own_value < 0 else own_value > 0,
        )

    @staticmethod
    def _skipped(flag: float, found_inf: torch.Tensor | None, bad: list[str], scaler: Any) -> bool:
        """The scaler's decision when it was given; else: non-finite gradients an enabled scaler will skip."""
        if found_inf is not None:
            return flag != 0.0
        return bool(bad) and scaler is not None and scaler.is_enabled()

    def _decide(self, n: StepNumbers) -> tuple[str | None, str]:
        wanted = self.options.alarms
        self._streak = self._streak + 1 if n.skipped else 0
        self._calibrating = self._calibrating and n.skipped
        if "nonfinite" in wanted and n.loss is not None and not math.isfinite(n.loss):
            return "nonfinite", f"the loss is {n.loss}"
        if (
            "nonfinite" in wanted and n.nonfinite_layers and not n.skipped
        ):  # no scaler caught them: they reach the weights
            return "nonfinite", f"non-finite gradients in {', '.join(n.nonfinite_layers[:3])}"
        if "skip-streak" in wanted and self._streak >= self._streak_limit():
            settling = (
                f" from the scaler's initial scale {self.history[0].loss_scale:g} down to {n.loss_scale:g}, more than"
                f" calibrating it takes"
                if self._calibrating
                else ""
            )
            where = (
                f"in {', '.join(n.nonfinite_layers[:3])}"
                if n.nonfinite_layers
                else "in another rank's shard"
                if n.local
                else "found by the scaler"
            )
            return (
                "skip-streak",
                f"{self._streak} optimizer steps skipped in a row{settling} (inf/NaN gradients {where})",
            )
        if "scale-collapse" in wanted and n.skipped and n.loss_scale <= self.options.min_scale:
            return "scale-collapse", f"the loss scale fell to {n.loss_scale:g} and the gradients still overflow"
        if "loss-spike" in wanted and n.loss is not None and math.isfinite(n.loss):
            return self._spike(n.loss)
        return None, ""

    def _spike(self, loss: float) -> tuple[str | None, str]:
        """A loss far above the recent median. Before half a window of history, against the first steps' median (at
        least :data:`EARLY_SPIKE_STEPS`), with the factor squared: a median of a few steps is noisy, but a run that
        blows up in its first steps must be heard too."""
        recent = [
            h.loss
            for h in self.history[-self.options.spike_window - 1 : -1]
            if h.loss is not None and math.isfinite(h.loss)
        ]
        early = len(recent) < self.options.spike_window // 2
        if len(recent) < EARLY_SPIKE_STEPS:
            return None, ""
        median = statistics.median(recent)
        factor = self.options.spike_factor ** (2 if early else 1)
        if median <= 0 or loss <= factor * median:
            return None, ""
        against = f"the median of the first {len(recent)} steps" if early else "the recent median"
        return "loss-spike", f"the loss {loss:.4g} is {loss / median:.1f}x {against} {median:.4g}"

    def _streak_limit(self) -> int:
        """Skips in a row that alarm: more while a fresh scaler settles (a default 2^16 halves to what the gradients
        allow: ``diagnose`` counts up to ``CALIBRATION_SKIPS`` such leading skips as settling, not as a fault)."""
        if self._calibrating:
            return max(self.options.skip_streak, CALIBRATION_SKIPS + 1)
        return self.options.skip_streak

    # --- the capsule -------------------------------------------------------------------------------------
    def write_capsule(self, optimizer: torch.optim.Optimizer, scaler: Any, numbers: StepNumbers) -> Path:
        """The state this step started from, its batches and a training file that rebuilds them (atomic writes).

        Only here are the step's batches and output gradients copied to the host. The training's random generators
        are left as they were (see :func:`callers_rng_kept`)."""
        with callers_rng_kept():
            return self._write_capsule(optimizer, scaler, numbers)

    def _write_capsule(self, optimizer: torch.optim.Optimizer, scaler: Any, numbers: StepNumbers) -> Path:
        folder = capsule_folder(Path(self.options.capsule_dir), numbers.step, self.rank)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the user's optimizer
        batches, output_grads = replay_inputs(self._batches, self.output_grads, numbers.loss_scale)
        start = self.step_state.start
        with start.restored(self.model) if start is not None else contextlib.nullcontext(StateReport()) as written:
            positioned = positioned_optimizer_state(inner, self.model)
            contents = CapsuleContents(
                module=detached_module(self.model),
                model_state=map_tensors(dict(self.model.state_dict()), cpu_copy),
                optimizer_state=positioned if positioned is not None else map_tensors(inner.state_dict(), cpu_copy),
                optimizer_by_position=positioned is not None,
                batches=batches,
                output_grads=output_grads,
                import_paths=import_roots(self.model),
            )
            self._save_model(folder, inner, scaler, numbers, contents)
        self._write_replay(folder, scaler, numbers, contents, written if start is not None else None)
        return folder

    def write_ranks_capsule(
        self, optimizer: torch.optim.Optimizer, scaler: Any, numbers: StepNumbers, contents: CapsuleContents
    ) -> Path:
        """The capsule the ranks of a sharded run captured together (rank 0 writes it: see
        :mod:`.sharded_capsule`): ``contents`` holds every rank's batches and the gathered state."""
        with callers_rng_kept():
            folder = capsule_folder(Path(self.options.capsule_dir), numbers.step, self.rank, every_rank=True)
            self._save_model(folder, getattr(optimizer, "optimizer", optimizer), scaler, numbers, contents)
            if contents.shards is not None:  # before the manifest, which says the capsule is whole
                os.replace(contents.shards.folder, folder / SHARDS)
            self._write_replay(folder, scaler, numbers, contents, None)
            return folder

    def _write_replay(
        self,
        folder: Path,
        scaler: Any,
        numbers: StepNumbers,
        contents: CapsuleContents,
        written: StateReport | None,
    ) -> None:
        """config.json, train_capsule.py and, last, the manifest."""
        enabled = scaler is not None and scaler.is_enabled()
        dtype = self.dtype or ("float16" if enabled else "bfloat16")
        config = capsule_config(numbers, scaler, len(contents.batches), dtype)
        if contents.sharding is not None:
            config["sharding"] = contents.sharding
        replay = "output-grads" if contents.output_grads is not None else self.framework
        atomic_write_text(folder / "config.json", json.dumps(config, indent=2))
        backend_stored = self._store_backend(folder)
        atomic_write_text(
            folder / "train_capsule.py", capsule_training_file(numbers, config, self.framework, replay, self.compiled)
        )
        output_dtypes = {dtype_name(g.dtype) for grads, _ in self.output_grads for g in grads if g is not None}
        write_manifest(
            folder,
            numbers.step,
            replay,
            loss_gradient_finding(numbers.loss, contents.output_grads),
            LossRecord(numbers.loss, sorted(self._loss_dtypes), sorted(output_dtypes)),
            ReplayStart(
                step_state=written,
                history_finite=all(h.loss is None or math.isfinite(h.loss) for h in self.history[:-1]),
                skipped_before=skip_streak_before(self.history),
                history=[history_row(h) for h in self.history[-HISTORY_KEPT:]],
            ),
            compiled=self.compiled,
            sharding=contents.sharding,
            not_emulated=contents.not_emulated,
            alarm=self._alarm_record(),
            backend_stored=backend_stored,
        )

    def _alarm_record(self) -> dict[str, Any]:
        """The alarm the capsule is of, as its files record it."""
        return {"kind": self.alarm.kind if self.alarm else None, "message": self.alarm.message if self.alarm else ""}

    def _store_backend(self, folder: Path) -> bool:
        """The run's custom compile backend, pickled into the capsule; False where there is none or it does not
        pickle (a closure over a live object): the replay then compiles with inductor, and its note says so."""
        compiler = self.compiled.compiler if self.compiled is not None else None
        if compiler is None:
            return False
        try:
            atomic_torch_save(folder / BACKEND_FILE, compiler, pickle_module=cloudpickle)
        except Exception:  # noqa: BLE001 - anything pickling raises: the capsule is written without it
            return False
        return True

    def _save_model(
        self,
        folder: Path,
        inner: torch.optim.Optimizer,
        scaler: Any,
        numbers: StepNumbers,
        contents: CapsuleContents,
    ) -> None:
        """capsule.pt and model.pt: the model as it is now (its written state put back by the caller)."""
        cls = type(inner)
        enabled = scaler is not None and scaler.is_enabled()
        state = {
            "format": CAPSULE_FORMAT,
            "framework": self.framework,
            "step": numbers.step,
            "rank": self.rank,
            "model": contents.model_state,
            "optimizer": contents.optimizer_state,
            "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
            "optimizer_by_position": contents.optimizer_by_position,
            "optimizer_defaults": constructor_settings(inner),
            "scaler": scaler.state_dict() if enabled else None,
            "batches": contents.batches,
            "output_grads": contents.output_grads,
            "rng": rng_state(),
            "loss": numbers.loss,
            "loss_scale": numbers.loss_scale,
            "alarm": self._alarm_record(),
            "import_paths": contents.import_paths,
            "shard_keys": None,  # a whole state: the replay loads "model" as it is
            "parameter_keys": None,
            **(contents.shards.to_capsule() if contents.shards is not None else {}),
        }
        atomic_torch_save(folder / "capsule.pt", state)
        atomic_torch_save(folder / "model.pt", contents.module, pickle_module=cloudpickle)
        with contextlib.suppress(Exception):  # one that does not pickle: the replay imports it by its name
            atomic_write_bytes(folder / OPTIMIZER_FILE, pickled_optimizer_class(cls))


def history_row(numbers: StepNumbers) -> dict[str, Any]:
    """What the manifest keeps of a step: what the diagnosis reads of the run before the capsule's step."""
    return {
        "step": numbers.step,
        "loss": numbers.loss,
        "skipped": numbers.skipped,
        "loss_scale": numbers.loss_scale,
        "lr": numbers.lr,
        "grad_norm": numbers.grad_norm,
        "nonfinite_layers": numbers.nonfinite_layers,
    }


def skip_streak_before(history: list[StepNumbers]) -> int:
    """The steps skipped in a row just before the last one checked."""
    streak = 0
    for numbers in reversed(history[:-1]):
        if not numbers.skipped:
            break
        streak += 1
    return streak


def first_line(exc: BaseException) -> str:
    """An exception's message in one line (its first)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def nonfinite_layers(grads: list[torch.Tensor], names: list[str], layer_norms: list[float]) -> list[str]:
    """The layers whose gradients hold an inf or NaN.

    A gradient with an inf or NaN has a non-finite L2 norm; a finite one too, rarely, where its squares overflow
    fp32 (values past ~1e19). Only those suspects are looked at again (a second synchronisation, on trouble only)."""
    suspects = [i for i, v in enumerate(layer_norms) if not math.isfinite(v)]
    if not suspects:
        return []
    flags = torch.stack([~torch.isfinite(grads[i]).all() for i in suspects]).tolist()
    return [names[i] for i, bad in zip(suspects, flags) if bad]


def at_initial_scale(scaler: Any, scale: float) -> bool:
    """Whether ``scale`` is an enabled GradScaler's own ``init_scale`` (``load_state_dict`` sets it to the loaded
    scale too: the watch also asks for optimizer step 0, as a resumed Trainer's global_step is not)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return False
    initial = getattr(scaler, "_init_scale", None)  # read back in float32, as the watch reads the scale
    return isinstance(initial, (int, float)) and float(torch.tensor(float(initial), dtype=torch.float32)) == scale


def scalar_on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A one-element tensor as a 0-d tensor on ``device``: reshaped and moved only where it is not already (each
    operation costs a healthy step a few microseconds, and a step stacks some thirty of them)."""
    tensor = tensor if tensor.dim() == 0 else tensor.reshape(())
    return tensor if tensor.device == device else tensor.to(device)


def scale_tensor(scaler: Any, device: torch.device) -> torch.Tensor:
    """The loss scale as a float tensor on ``device``, read without a synchronisation (1.0 without an enabled scaler)."""
    if scaler is None or not scaler.is_enabled():
        return torch.ones((), device=device)
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(scaler.get_scale()), device=device)  # not initialised yet: a Python float, no sync


def watch_step(watch: Watch, stop: Callable[[], None]) -> Callable[[Alarm | None], None]:
    """What a callback does with an alarm: print the pointer, then stop the training if configured."""

    def handle(alarm: Alarm | None) -> None:
        if alarm is None:
            return
        print(alarm.pointer(), flush=True)
        if watch.options.stop_on_alarm:
            stop()

    return handle
