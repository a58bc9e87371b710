"""The probe engine: short trainings of the user's training in one precision mode.

A :class:`Workbench` is made once per command: it loads nothing itself but
holds the training spec, the config, the batches drawn once from ``data()``
and the reference initial weights. Every :class:`Probe` it creates starts from
those same weights and replays those same batches, so probes of different
modes differ only by precision.

Modes:

* ``fp32``: the true baseline, every low-precision path off (see :mod:`.fp32_mode`).
* ``amp``: the training as configured: the user's code as written, autocast
  with the configured dtype (CUDA's op policy, also on CPU), the configured scaler.
* ``bf16``: ``amp`` with bfloat16 and no scaler.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import traceback
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..config import DoctorConfig
from ..errors import CheckpointError, DoctorError, TrainingFileError, first_line
from ..precision.autocast_policy import autocast_factory
from ..precision.fp32_mode import NeutraliseHalfCasts, full_precision, half_casts_in_fp32
from ..precision.overrides import (
    ClipObserver,
    LossInFp32,
    autocast_forward,
    keep_modules_in_fp32,
)
from ..precision.recording import (
    OptimizerWatch,
    RecordingGradScaler,
    StepTrace,
    finish_trace,
    out_of_sight,
    step_outcome,
)
from ..precision.session import PrecisionSession
from ..tensors import OUT_OF_MEMORY
from ..userfile.batches import floats_to, to_device
from ..userfile.checkpoint import TrainedStart
from ..userfile.compiled import (
    compiled_program,
    graph_caches_off,
    inductor_fallbacks,
    run_eagerly,
    training_compiles,
)
from ..userfile.loop import canonical_step, default_loss, micro_batched_step, output_field
from ..userfile.spec import TrainingSpec, build_model, build_model_and_program, draw_batches, user_frame
from .emulated_ranks import ReductionReading, emulated_ranks_step
from .instruments import InstrumentOptions, Instruments
from .kept import owned_copy, release_memory, tensor_bytes
from .microbatch import CHECKED_BATCHES, UNSPLIT, MicroBatchPlan, plan_micro_batches
from .optimizers import ProbeOptimizers, flat_schedulers, named_optimizers
from .progress import StepProgress
from .records import RECORD_COLUMNS, StepRecord  # re-exported: the record types' old home
from .rng import rng_state, seed_everything, set_rng_state, set_training_rng

MODES = ("fp32", "amp", "bf16")
REFERENCE_KEY = -1
"""The reference weights' key in a diagnosis's kept states (steps are >= 0)."""
SCHEDULER_ORDER_WARNING = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
"""PyTorch's warning when the scheduler steps after a skipped optimizer step: the doctor reports that itself."""
DEFAULT_INSTRUMENTS = InstrumentOptions(activation_grads=False, param_grads=False, module_shares=False)
"""The numerics instruments every probe carries: what the rules read (forward outputs' exact ranges, which say
where a non-finite value was made and how large the FP32 activations get; update health). The rest is taken
only where something reads it (benchmarks/overhead.py measures both sets)."""
PLOT_INSTRUMENTS = InstrumentOptions(module_shares=False)
"""The AMP probe's where the report's plots are drawn: activation-gradient ranges (the activation-range plot)
and parameter-gradient statistics (the underflow heatmap) too."""
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DoctorError(
            "config asks for device 'cuda' but no CUDA device is available.", hint="Use device: auto or cpu."
        )
    return torch.device(name)


@dataclass
class ModeSettings:
    """What a mode means concretely on this device."""

    mode: str
    low_dtype: torch.dtype | None
    scaler_enabled: bool

    @classmethod
    def of(cls, mode: str, config: DoctorConfig) -> ModeSettings:
        if mode not in MODES:
            raise DoctorError(f"unknown probe mode '{mode}'.", hint=f"Use one of {', '.join(MODES)}.")
        if mode == "fp32":
            return cls(mode, None, False)
        if mode == "bf16":
            return cls(mode, torch.bfloat16, False)
        return cls(mode, DTYPES[config.dtype], config.scaler.enabled)


FSDP1_RUNS_EAGER = (
    "dynamo runs FullyShardedDataParallel units wrapped without use_orig_params=True eagerly (a graph break at each): "
    "the ranks train them eager, as the compiled training does; wrap with use_orig_params=True to compile them"
)


def _fsdp1_flat(module: torch.nn.Module) -> bool:
    """FSDP1 manages ``module`` without ``use_orig_params=True``: the markers dynamo itself reads to refuse it."""
    return bool(getattr(module, "_is_fsdp_managed_module", False)) and not getattr(
        module, "_fsdp_use_orig_params", False
    )


def _as_optimized(built: torch.nn.Module, wrapped: torch.nn.Module) -> torch.nn.Module:
    """The model ``optimizers(model)`` receives: as ``model()`` built it (attributes and parameter names the file
    knows), unless the ranks' wrapper replaced its parameters (FSDP1's flat parameters): then the wrapped model, whose
    parameters are the ones that train. DDP keeps the built model's parameters; FSDP2 shards them in place."""
    if wrapped is built:
        return built
    own = {id(p) for p in built.parameters()}
    return built if all(id(p) in own for p in wrapped.parameters()) else wrapped


@dataclass
class ProbeSnapshot:
    """Everything needed to take the same step again: weights, optimizer, scheduler, scaler, RNG, data position."""

    model: dict[str, Any]
    optimizer: dict[str, dict[str, Any]]
    """Every optimizer's state, by the probe's name for it."""
    scheduler: list[dict[str, Any]] | None
    """Every scheduler's state, in the order the file returned them."""
    scaler: dict[str, Any]
    rng: dict[str, Any]
    iteration: int
    cursor: int
    grads: dict[str, torch.Tensor] | None = None
    """The parameters' gradients, by name, when the snapshot falls inside a gradient accumulation (the last
    step was a micro-step: the next one adds to them); None otherwise (the next step starts afresh)."""


def resume_schedulers(start: TrainedStart, schedulers: list[Any], note: Callable[[str], None]) -> None:
    """The file's schedulers where the checkpoint left the training's: each its saved state, in the order the
    training made them; where the checkpoint keeps none, stepped to its step; where the counts differ, as the file
    makes them (``note`` says which of the last two)."""
    if len(start.schedulers) == len(schedulers):
        for scheduler, state in zip(schedulers, start.schedulers):
            scheduler.load_state_dict(copy.deepcopy(state))
    elif start.schedulers:
        note(
            f"the checkpoint's scheduler state ({len(start.schedulers)}) is not taken up: the file makes "
            f"{len(schedulers)} scheduler(s); the probes' learning rate follows the file's"
        )
    else:
        advance_schedulers(schedulers, start.step, note)


def advance_schedulers(schedulers: list[Any], steps: int, note: Callable[[str], None]) -> None:
    """A checkpoint that keeps no scheduler state: the file's schedulers stepped to where the data continues, as
    the training's had stepped (the schedule is the file's, at the checkpoint's step, not at its start)."""
    if not schedulers or steps <= 0:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SCHEDULER_ORDER_WARNING)  # no optimizer steps here
        try:
            for _ in range(steps):
                for scheduler in schedulers:
                    scheduler.step()
        except Exception as exc:  # noqa: BLE001 - a schedule that ends before the step (OneCycleLR): said, as it is
            note(f"the file's schedule could not be advanced to step {steps} ({type(exc).__name__}: {exc})")
            return
    note(f"the checkpoint keeps no scheduler state: the file's schedule is advanced to step {steps}")


def _check_param_groups(name: str, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A saved optimizer state fits only an optimizer with as many parameter groups, of as many parameters each."""
    saved = [len(group.get("params", [])) for group in state.get("param_groups", [])]
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if saved != mine:
        raise CheckpointError(
            f"the checkpoint's state of optimizer '{name}' has {len(saved)} parameter group(s) of {saved} "
            f"parameters; the file's has {len(mine)} of {mine}.",
            hint="Build the optimizer with the same parameter groups the training used (Hugging Face's Trainer "
            "makes two: the parameters with weight decay, and the biases and norms without).",
        )


def load_trained_weights(model: torch.nn.Module, start: TrainedStart) -> None:
    """The checkpoint's weights into ``model`` (a shape that differs is bad input, naming the tensor)."""
    try:
        model.load_state_dict(start.model_state_for(model.state_dict()))
    except RuntimeError as exc:
        raise CheckpointError(
            f"the checkpoint '{start.source}' does not fit this model: {first_line(exc)}",
            hint="--from-checkpoint takes a checkpoint of the model that model() builds (same shapes).",
        ) from exc


HALF_CASTS_NOTE = (
    "the file asks for half precision itself (.half(), .to(torch.float16), dtype=torch.float16): the FP32 baseline "
    "runs those casts in fp32, as a twin in full precision; the file run as written with autocast off keeps them half"
)


class Workbench:
    """The shared ground of all probes of one command: spec, config, batches, initial weights."""

    def __init__(
        self, spec: TrainingSpec, config: DoctorConfig, batch_count: int | None = None, micro_batching: bool = False
    ):
        """``micro_batching``: FP32 probes may split their batches into micro-batches to stay within the AMP
        training's activation memory (:mod:`.microbatch`; the diagnosis's memory target). Planning runs the
        file's loss a few extra times on part of the first batch, so only a caller that needs it asks."""
        self.spec = spec
        self.config = config
        self.device = resolve_device(config.device)
        seed_everything(config.seed)
        # emulated ranks take world x micro-batches batches a step: each step its own, as the ranks' would be
        per_step = config.sharding.world * config.sharding.micro_batches if config.sharding.emulated else 1
        self.batches = draw_batches(spec, batch_count or config.steps * per_step)
        self._initial_state: dict[str, torch.Tensor] | None = self._reference_state()
        self._kept_reference: MutableMapping[int, Any] | None = None
        self.model_bytes = tensor_bytes(self._initial_state)
        """The reference weights' bytes (fp32): one copy of the model."""
        self.progress = StepProgress()
        """Every probe step of this bench reports itself here (a diagnosis sets its hook: the progress display)."""
        self.micro_batching = micro_batching
        self._micro_batch_plan: MicroBatchPlan | None = None

    def _reference_state(self) -> dict[str, torch.Tensor]:
        """Seeded fp32 build: the weights every mode starts from (rounded where a mode stores half)."""
        seed_everything(self.config.seed)
        with full_precision():
            model = build_model(self.spec)
        if self.spec.start is not None:
            load_trained_weights(model, self.spec.start)
        self.parameter_shapes = [tuple(p.shape) for p in model.parameters()]
        """The shapes of ``model().parameters()`` in order (for dry runs of the user's optimizer and scheduler)."""
        return {
            k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
            for k, v in model.state_dict().items()
        }

    @property
    def initial_state(self) -> dict[str, torch.Tensor]:
        """The reference weights every probe starts from: in memory, or read back from where
        :meth:`reference_kept_in` put them (each read is a fresh copy: read it once per use)."""
        if self._initial_state is not None:
            return self._initial_state
        assert self._kept_reference is not None
        state: dict[str, torch.Tensor] = self._kept_reference[REFERENCE_KEY]
        return state

    @contextlib.contextmanager
    def reference_kept_in(self, kept: MutableMapping[int, Any]) -> Iterator[None]:
        """Keep the reference weights in ``kept`` (a diagnosis's :class:`~.kept.KeptStates`: on disk past its
        budget) while the block runs, and in memory again after it. Probes read them only while they are
        built, one probe at a time: the diagnosis then holds one probe, not a probe and a copy of the
        weights beside it."""
        assert self._initial_state is not None, "the reference weights are kept elsewhere already"
        kept[REFERENCE_KEY] = self._initial_state
        self._kept_reference, self._initial_state = kept, None
        try:
            yield
        finally:
            self._initial_state, self._kept_reference = kept[REFERENCE_KEY], None
            del kept[REFERENCE_KEY]

    def probe(self, mode: str, config: DoctorConfig | None = None, **options: Any) -> Probe:
        """A fresh probe of ``mode`` (instruments attached unless ``instruments=None``)."""
        self.spec.reset_file_state()  # each probe trains from the file as the first probe found it
        return Probe(self, mode, config or self.config, **options)

    def _spread_batches(self) -> list[Any]:
        """Up to ``CHECKED_BATCHES - 1`` drawn batches after the first, evenly spread, the last included."""
        rest = self.batches[1:]
        wanted = min(len(rest), CHECKED_BATCHES - 1)
        return [rest[round(i * (len(rest) - 1) / max(wanted - 1, 1))] for i in range(wanted)] if wanted else []

    def micro_batch_plan(self, mode: str) -> MicroBatchPlan:
        """How probes of ``mode`` cut their batches: FP32 probes of a workbench made with ``micro_batching``
        follow one plan, made the first time it is asked for (before the first FP32 probe builds its model)
        and kept; every other probe takes its batches whole."""
        if mode != "fp32" or not self.micro_batching:
            return UNSPLIT
        if self._micro_batch_plan is None:
            self._micro_batch_plan = plan_micro_batches(
                self.batches[0],
                self.model_bytes,
                self.spec.train_step is not None,
                lambda planned: self.probe(planned, instruments=None, batch_plan=UNSPLIT),
                others=self._spread_batches(),
            )
            release_memory(self.device)  # the planning probes' freed blocks go back before the first probe allocates
        return self._micro_batch_plan


CALLED_WITH = {
    "optimizer": "fp16doctor calls optimizer(params) with model.parameters(), as torch.optim's constructors take them "
    "(not the model): e.g. `def optimizer(params): return torch.optim.AdamW(params, lr=3e-4)`. "
    "To build parameter groups from the model, define optimizers(model) instead.",
    "optimizers": "fp16doctor calls optimizers(model) with the model and steps what it returns: one optimizer, or a "
    "tuple/list/dict of them (then the file's train_step() steps them).",
    "scheduler": "fp16doctor calls scheduler(optimizer) with the optimizer optimizer(params) returned (or what "
    "optimizers(model) returned: one optimizer, or the same tuple/list/dict).",
}
"""What a user function of the contract is called with: the hint when calling it raises (a wrong signature is
the likeliest reason)."""


class Probe:
    """Live training objects for one mode; ``run`` steps them and returns the record."""

    def __init__(
        self,
        bench: Workbench,
        mode: str,
        config: DoctorConfig,
        align_on_taken_steps: bool = False,
        instruments: InstrumentOptions | None = DEFAULT_INSTRUMENTS,
        hold_scheduler_on_retry: bool = True,
        batch_plan: MicroBatchPlan | None = None,
        compiled: bool = False,
        parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        backend: Callable[..., Any] | None = None,
    ):
        """``align_on_taken_steps``: a skipped step retries the same batch with the same RNG, the scheduler
        held (``compare``'s alignment); ``hold_scheduler_on_retry=False`` lets the scheduler step on a skip as
        the user's loop does, so an alignment removes the lag of skipped steps but not the schedule's.
        ``batch_plan``: how the steps cut their batches into micro-batches (None: the workbench's plan for this mode).
        ``compiled``: the steps call the model compiled, as ``config.compile`` says (:func:`compiled_program`), where
        the training compiles (``model()`` returns a compiled module, or ``compile.enabled``); the probe's own
        bookkeeping (state, instruments) stays on the eager module, whose parameters the program shares.
        ``parallelize``: wraps the built model before the optimizers are made (FSDP replaces the parameters with
        their shards, which the optimizers must hold): :attr:`model` is then the wrapped model.
        ``backend``: with ``compiled``, the program is compiled anew with this backend function (a graph trace's:
        :func:`~fp16doctor.userfile.compiled.compiled_program`)."""
        if config.sharding.emulated and bench.spec.train_step is not None:
            raise TrainingFileError(
                "sharding.world > 1 emulates the ranks with the doctor's own step, and the file defines train_step().",
                hint="Emulated ranks replay a sharded run's capsule; set sharding.world to 1 for a file with its own step.",
            )
        self.batch_plan = batch_plan if batch_plan is not None else bench.micro_batch_plan(mode)
        """Planned before anything of this probe is built: planning's throw-away probes are never alive beside it."""
        self.bench = bench
        self.spec = bench.spec
        self.config = config
        self.settings = ModeSettings.of(mode, config)
        self.mode = mode
        self.device = bench.device
        self.align = align_on_taken_steps
        self.hold_on_retry = align_on_taken_steps and hold_scheduler_on_retry
        self.iteration = 0
        self.cursor = 0
        self.records: list[StepRecord] = []
        self.failed: StepRecord | None = None
        self.reduction_reading = ReductionReading()
        """What the emulated ranks' gradient reductions did (``config.sharding``; empty where no rank is emulated)."""
        self.instruments: Instruments | None = None
        self._backend = backend
        self._program: torch.nn.Module | None = None
        """``model()``'s own ``torch.compile`` wrapper of :attr:`model` (None: it returned an eager module)."""
        self.micro_batch_watchers: list[Callable[[], None]] = []
        """Told after each micro-batch's backward in a micro-batched step (the instruments are told first): who
        watches a step's tensors a micro-batch at a time (:func:`~fp16doctor.measure.numerics.capture_gradients`)."""
        self._session = PrecisionSession.for_mode(mode, self.device.type)
        """Entered by the probe itself around its construction and every step (see :meth:`_precision`)."""
        if mode != "fp32":  # the baseline has nothing to fix
            self._session.keep_lines_in_fp32(config.overrides.fp32_lines, self.device.type)
        with self._precision(), half_casts_in_fp32() if config.overrides.fp32_weights else contextlib.nullcontext():
            self.built_model = self._build_model()
            """The model as ``model()`` built it: :attr:`model` itself, or what ``parallelize`` wrapped."""
            self.model = parallelize(self.built_model) if parallelize is not None else self.built_model
            self._compiled_model = self._compiled(compiled)
            self.optimizer_arg = self._build_optimizers(_as_optimized(self.built_model, self.model))
            """What ``train_step`` and ``scheduler()`` receive: one optimizer, or the file's tuple/list/dict of them."""
            self.optimizers = ProbeOptimizers(
                named_optimizers(self.optimizer_arg, self._optimizer_source()),
                self.model,
                on_found=self._found_optimizer,
                user_file=self.spec.path,
            )
            self.optimizer = self.optimizers.primary
            """The first optimizer (its learning rate is the record's ``lr``)."""
            self.scheduler = (
                self._call_user("scheduler", self.spec.scheduler, self.optimizer_arg) if self.spec.scheduler else None
            )
            self.schedulers = flat_schedulers(self.scheduler)
        cfg = config.scaler
        self.scaler = RecordingGradScaler(
            self.device.type,
            init_scale=cfg.init_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
            enabled=self.settings.scaler_enabled,
        )
        self.scaler.names = {id(opt): name for name, opt in self.optimizers.by_name.items()}
        if self.spec.start is not None:
            self._resume(self.spec.start, scaler=config.scaler == bench.config.scaler)
        self._watch = OptimizerWatch(self.optimizers.all(), self.scaler)
        self._session.observe_clipping(
            ClipObserver(self.scaler, tuple(self.optimizers.all()), config.overrides.unscale_before_clip),
            self.spec.module,
        )
        self.autocast = autocast_factory(self.device.type, self.settings.low_dtype)
        self._step_modes = self._runtime_fixes()
        if instruments is not None:
            self.instrument(instruments)
        seed_everything(config.seed)  # dropout and friends draw the same numbers in every mode
        if self.spec.start is not None and self.spec.start.rng is not None:
            set_training_rng(self.spec.start.rng)  # and the numbers the training would have drawn next

    # --- construction -------------------------------------------------------------------------
    def _resume(self, start: TrainedStart, scaler: bool) -> None:
        """Take up the trained state a checkpoint holds (the weights are the workbench's reference already): the
        optimizer's moments, the scheduler's position and, unless this probe tries other scaler settings (the
        sweep, a fix), the scaler's scale and growth tracker."""
        states = start.optimizer_states_for(list(self.optimizers.by_name))
        for (name, optimizer), state in zip(self.optimizers.by_name.items(), states or []):
            _check_param_groups(name, optimizer, state)
        try:
            for optimizer, state in zip(self.optimizers.all(), states or []):
                optimizer.load_state_dict(copy.deepcopy(state))
            resume_schedulers(start, self.schedulers, self.spec.note)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(
                f"the checkpoint's optimizer or scheduler state does not fit the file's ({first_line(exc)}).",
                hint="--from-checkpoint takes a checkpoint of the training this file defines (its optimizer too).",
            ) from exc
        if scaler and start.scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(start.scaler)

    def _runtime_fixes(self) -> list[Any]:
        """The torch-function modes that ``config.overrides`` keep active during every step."""
        if self.mode == "fp32":
            return []  # the baseline has nothing to fix
        modes: list[Any] = []
        if self.config.overrides.loss_in_fp32:
            loss_mode = LossInFp32(self.device.type)
            loss_mode.attach(self.model)
            modes.append(loss_mode)
        if self.config.overrides.fp32_weights:
            # fp32 master weights: the file's half casts become fp32, the forward runs under autocast.
            modes.append(NeutraliseHalfCasts())
            autocast_forward(self.model, self.autocast)
        return modes

    def _build_model(self) -> torch.nn.Module:
        seed_everything(self.config.seed)
        model, self._program = build_model_and_program(self.spec)
        model = model.to(self.device)
        if self.mode == "fp32" or self.config.overrides.fp32_weights:
            model.float()
        keep_modules_in_fp32(model, self.config.overrides.fp32_modules, self.device.type)
        if self.config.overrides.loss_in_fp64:
            model.register_forward_hook(outputs_in_float64)
        state = model.state_dict()
        reference = self.bench.initial_state  # read once: it may come back from disk
        missing = set(state) ^ set(reference)
        if missing:
            raise TrainingFileError(
                "model() builds a different model on each call (state keys differ: "
                + ", ".join(sorted(missing)[:5])
                + ").",
                hint="model() must build the same architecture every time it is called.",
            )
        with torch.no_grad():
            for name, tensor in state.items():
                tensor.copy_(reference[name])
        return model.train()

    @property
    def step_model(self) -> torch.nn.Module:
        """What the steps call: :attr:`model` (as a caller may have wrapped it since: ``train``'s DDP), or the
        program compiled from it."""
        return self._compiled_model if self._compiled_model is not None else self.model

    @property
    def runs_compiled(self) -> bool:
        """The steps call a compiled program (the training compiles, and this probe was asked to run it so)."""
        return self._compiled_model is not None

    def _compiled(self, compiled: bool) -> torch.nn.Module | None:
        """The program the steps call, compiled from :attr:`model`; where that is :attr:`built_model` wrapped for
        the ranks, compiled anew with ``model()``'s recorded options (its own program compiled the unwrapped model).
        The regions run eagerly are named in :attr:`built_model`, as ``model()`` built it."""
        if not compiled or not training_compiles(self.config.compile, self.spec.compiled):
            return None
        if self._compiles_anew:
            # dynamo reuses a graph compiled for another instance of the same class without looking at inductor's
            # lowerings or a submodule's forward: this probe's graphs are compiled anew, and dropped when it closes
            torch._dynamo.reset()
        run_eagerly(self.built_model, self.config.compile.eager_modules)
        if any(_fsdp1_flat(m) for m in self.model.modules()):
            self.spec.note(FSDP1_RUNS_EAGER)
        program = None if self.model is not self.built_model else self._program
        return compiled_program(
            self.model, program, self.config.compile, self.spec.compiled, self._backend, parts_of=self.built_model
        )

    @property
    def _compiles_anew(self) -> bool:
        return self.config.compile.compiles_anew or self._backend is not None

    def _build_optimizers(self, model: torch.nn.Module) -> Any:
        """The file's ``optimizers(model)`` (one, or a tuple/list/dict), its ``optimizer(params)``, or the default
        AdamW, over ``model``'s parameters."""
        if self.spec.optimizers is not None:
            built = self._call_user("optimizers", self.spec.optimizers, model)
            several = len(named_optimizers(built, "optimizers(model)")) > 1
            if several and self.spec.train_step is None:
                raise TrainingFileError(
                    "optimizers(model) returned several optimizers but the file defines no train_step(): only your "
                    "step knows which loss each optimizer follows and in which order they step.",
                    hint="Define train_step(model, batch, optimizer, scaler, autocast); it receives the same "
                    "tuple/list/dict as `optimizer` (PyTorch's recipe: scaler.step() each, then one scaler.update()).",
                )
            return built
        if self.spec.optimizer is None:
            return torch.optim.AdamW(model.parameters(), lr=self.config.lr)
        optimizer = self._call_user("optimizer", self.spec.optimizer, model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TrainingFileError(
                f"optimizer(params) returned {type(optimizer).__name__}, not a torch.optim.Optimizer."
            )
        return optimizer

    def _optimizer_source(self) -> str:
        return "optimizers(model)" if self.spec.optimizers is not None else "optimizer(params)"

    def _found_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer the training created itself stepped for the first time: watch, count and instrument it too."""
        self.scaler.names[id(optimizer)] = name
        self._watch.watch(optimizer)
        if self.instruments is not None:
            self.instruments.watch_optimizer(optimizer)

    def _call_user(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (DoctorError, *OUT_OF_MEMORY):
            raise
        except Exception as exc:  # noqa: BLE001
            raise TrainingFileError(
                f"{name}() raised {type(exc).__name__}: {exc}",
                location=self.spec.user_location(exc),
                hint=CALLED_WITH.get(name, ""),
            ) from exc

    # --- contexts -----------------------------------------------------------------------------
    def _precision(self) -> contextlib.AbstractContextManager[None]:
        """The precision environment of this mode (FP32 guards, or CUDA's policy for CPU autocast, and the
        clipping observer). :meth:`step` enters it itself, so every step, whoever takes it, runs under the
        numerics the diagnosis measured; it is re-entrant, and active only while the probe builds or steps."""
        return self._session()

    # --- stepping -----------------------------------------------------------------------------
    def _loss_fn(self) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
        user_loss = self.spec.loss or default_loss

        def checked_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            loss = reported_loss(user_loss(model, batch))  # (loss, metrics) or an output with .loss: the loss
            self._loss_value(loss, check_only=True)  # a non-scalar loss is bad input, not a numerical fault
            return loss

        return checked_loss

    def batch_at_cursor(self) -> tuple[int, Any]:
        """The workbench's batch at the data cursor, and its index; with emulated ranks, the step's run of
        ``world`` x ``micro_batches`` batches (a list, rank by rank) and the index of its first."""
        batches = self.bench.batches
        sharding = self.config.sharding
        if not sharding.emulated:
            index = self.cursor % len(batches)
            return index, batches[index]
        count = sharding.world * sharding.micro_batches
        first = (self.cursor * count) % len(batches)
        return first, [batches[(first + i) % len(batches)] for i in range(count)]

    def _run_step(self, batch: Any) -> Any:
        with self._runtime_fixes_active(), self.optimizers:  # optimizers the step creates itself are found as they step
            if self.config.sharding.emulated:
                return emulated_ranks_step(
                    self.step_model,
                    batch,
                    self.optimizer,
                    self.scaler,
                    self.autocast,
                    self._loss_fn(),
                    self.config.sharding,
                    self.config.max_grad_norm,
                    reading=self.reduction_reading,
                    step=self.iteration,
                    policy_dtypes=self.mode != "fp32",  # the FP32 baseline: the same ranks, no half precision
                    fp32_modules=tuple(self.config.overrides.fp32_modules),
                )
            if self.spec.train_step is not None:
                return self.spec.train_step(self.step_model, batch, self.optimizer_arg, self.scaler, self.autocast)
            if self.batch_plan.split:
                return micro_batched_step(
                    self.step_model,
                    self.batch_plan.pieces(batch),
                    self.optimizer,
                    self.scaler,
                    self.autocast,
                    self._loss_fn(),
                    self.config.max_grad_norm,
                    after_backward=self._micro_batch_done,
                )
            return canonical_step(
                self.step_model,
                batch,
                self.optimizer,
                self.scaler,
                self.autocast,
                self._loss_fn(),
                self.config.max_grad_norm,
            )

    def next_micro_batch_rows(self) -> list[int] | None:
        """The rows of each micro-batch the next :meth:`step` (on the workbench's batch at the data cursor) cuts
        its batch into, in order; None when it takes the batch whole (one micro-batch, or a ``train_step``)."""
        if self.spec.train_step is not None or not self.batch_plan.split or self.config.sharding.emulated:
            return None
        rows = self.batch_plan.piece_rows(self.bench.batches[self.cursor % len(self.bench.batches)])
        return rows if rows is not None and len(rows) > 1 else None

    def _micro_batch_done(self) -> None:
        """Between two micro-batches: the instruments take the finished one's rows and let its tensors go."""
        if self.instruments is not None:
            self.instruments.end_micro_batch()
        for watcher in self.micro_batch_watchers:
            watcher()

    def loss_of(self, batch: Any) -> torch.Tensor:
        """The loss on ``batch`` as this probe's steps compute it (moved to its device and dtype, under its
        precision, its runtime fixes and autocast), with its graph; nothing steps. What planning measures."""
        batch = to_device(batch, self.device, torch.float32 if self.mode == "fp32" else None)
        with self._precision(), self._runtime_fixes_active(), self.autocast():
            return self._loss_fn()(self.step_model, batch)

    @contextlib.contextmanager
    def _runtime_fixes_active(self) -> Iterator[None]:
        """The torch-function modes of ``config.overrides`` (:meth:`_runtime_fixes`), entered together; a compiled
        probe's operators left to ATen (``compile.fallback_ops``) while it compiles and runs. A compiled probe under
        CUDA's policy on the CPU compiles with the graph caches off: their keys hold dynamo's graph, not the autocast
        kernels AOT autograd traces through, so a graph compiled under CPU autocast's own lists (the user's run, a
        test) would come back without the policy's casts."""
        with contextlib.ExitStack() as stack:
            for mode in self._step_modes:
                stack.enter_context(mode)
            if self.runs_compiled:
                stack.enter_context(inductor_fallbacks(self.config.compile.fallback_ops))
                if self._session.cuda_kernels:
                    stack.enter_context(graph_caches_off())
            yield

    def step(self, batch: Any = None, batch_index: int | None = None) -> StepRecord:
        """Take one training step and record it. A user exception ends the probe (``self.failed``).

        Without ``batch`` the step replays the workbench's batch at the data cursor; a
        training run streams its own batches in. The step runs inside the probe's precision session.
        Every step reports itself to the bench's :class:`~fp16doctor.engine.progress.StepProgress` first.
        """
        self.bench.progress.step(self.mode)
        with self._precision():
            return self._step(batch, batch_index)

    def _step(self, batch: Any, batch_index: int | None) -> StepRecord:
        if batch is None:
            batch_index, batch = self.batch_at_cursor()
        batch_index = self.cursor if batch_index is None else batch_index
        batch = to_device(batch, self.device, torch.float32 if self.mode == "fp32" else None)
        lr = float(self.optimizer.param_groups[0]["lr"])
        with out_of_sight():  # the doctor's read, not the training's
            scale = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
        self.scaler.trace = trace = StepTrace(scale_used=scale)
        rng_before = rng_state() if self.align else None
        if self.instruments is not None:
            self.instruments.begin_step(self.iteration, scale)
        try:
            loss = self._run_step(batch)
        except (DoctorError, *OUT_OF_MEMORY):
            raise
        except Exception as exc:  # noqa: BLE001 - a user's exception is evidence, not a crash
            if raised_by_doctor(exc):
                raise  # a bug of the doctor's own, inside its hooks: not the training's, and not blamed on it
            self._end_instruments(trace)
            record = self._exception_record(exc, batch_index, lr, scale, trace)
            self.failed = record
            self.records.append(record)
            return record
        loss_value = self._loss_value(loss)
        finish_trace(trace, self.optimizers.all())
        self._end_instruments(trace)
        grad_norm = float(trace.grad_norm if trace.grad_norm is not None else float("nan"))
        outcome = step_outcome(trace, nonfinite_grads=not math.isfinite(grad_norm))
        skipped = outcome == "skipped"
        record = StepRecord(
            step=self.iteration,
            batch_index=batch_index,
            loss=loss_value,
            grad_norm=grad_norm,
            lr=lr,
            loss_scale=scale,
            skipped=skipped,
            optimizer_stepped=outcome == "stepped",
            micro_step=outcome == "accumulated",
            nonfinite_loss=not math.isfinite(loss_value),
            nonfinite_grads=not math.isfinite(grad_norm),
            trace=trace,
        )
        self._advance(skipped, optimizer_step=outcome != "accumulated", loss=loss_value)
        if skipped and rng_before is not None:
            set_rng_state(rng_before)  # the retry draws the same dropout masks as fp32's step did
        self.records.append(record)
        return record

    def instrument(self, options: InstrumentOptions | None = None, eager_step: bool = False) -> Instruments:
        """Attach the numerics instruments (see :mod:`.instruments`) to this probe's model and optimizer. Their
        module hooks only where the steps run eager: where they call the compiled program, unless ``eager_step``
        (the caller runs the step forced eager, ``torch.compiler.set_stance("force_eager")``)."""
        if self.instruments is not None and options is not None and options != self.instruments.options:
            self.instruments.detach()
            self.instruments = None
        if self.instruments is None:
            hook_modules = eager_step or not self.runs_compiled
            self.instruments = Instruments(self.model, self.optimizers.all(), options, hook_modules=hook_modules)
        return self.instruments

    def _end_instruments(self, trace: StepTrace) -> None:
        if self.instruments is not None:
            self.instruments.end_step(grads_unscaled=trace.unscaled or not trace.scaled)

    def _advance(self, skipped: bool, optimizer_step: bool = True, loss: float = math.nan) -> None:
        """Move the data cursor, and the scheduler once per optimizer step (not per accumulation micro-step)."""
        hold = skipped and (self.hold_on_retry or self.config.overrides.hold_scheduler_on_skip)
        if self.schedulers and optimizer_step and not hold:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=SCHEDULER_ORDER_WARNING)
                for scheduler in self.schedulers:
                    step_scheduler(scheduler, loss)
        cap = self.config.overrides.max_lr
        if cap is not None:
            for group in (g for optimizer in self.optimizers.all() for g in optimizer.param_groups):
                group["lr"] = min(group["lr"], cap)
        if not (skipped and self.align):
            self.cursor += 1
        self.iteration += 1

    def _loss_value(self, loss: Any, check_only: bool = False) -> float:
        returned = type(loss).__name__
        if self.spec.train_step is not None:
            loss = reported_loss(loss)
            if isinstance(loss, (int, float)):  # `return loss.item()`: the step already ran, the value is all we need
                return float(loss)
        if not isinstance(loss, torch.Tensor):
            where = "train_step()" if self.spec.train_step else "loss()"
            hint = (
                "Return the loss: a scalar tensor or a number (an output with a `loss` field, or a tuple with the "
                "loss first, works too)."
                if self.spec.train_step
                else "Return the scalar loss tensor (or an output with a `loss` field, or a tuple with the loss first)."
            )
            raise TrainingFileError(f"{where} returned {returned}, not a loss.", hint=hint)
        if loss.numel() != 1:
            where = "train_step()" if self.spec.train_step else ("loss()" if self.spec.loss else "the default loss")
            raise TrainingFileError(
                f"{where} returned a loss of shape {tuple(loss.shape)}; a scalar is needed.",
                hint="Reduce it, e.g. `loss.mean()`.",
            )
        return 0.0 if check_only else float(loss.detach().float().item())

    def _exception_record(
        self, exc: Exception, batch_index: int, lr: float, scale: float, trace: StepTrace
    ) -> StepRecord:
        own = None if self.spec.replays_capsule else user_frame(exc, self.spec.path)  # a capsule's file is ours
        location = own or _outside_torch_frame(exc)
        self.iteration += 1
        return StepRecord(
            step=self.iteration - 1,
            batch_index=batch_index,
            loss=float("nan"),
            grad_norm=float("nan"),
            lr=lr,
            loss_scale=scale,
            skipped=True,
            optimizer_stepped=trace.optimizer_stepped,
            micro_step=False,
            nonfinite_loss=True,
            nonfinite_grads=True,
            exception_type=type(exc).__name__,
            exception=first_line(exc),
            exception_location=location,
            exception_module=raising_module(exc, self.model),
            trace=trace,
        )

    def run(
        self,
        steps: int | None = None,
        max_iterations: int | None = None,
        stop_on_nonfinite_loss: bool = False,
        before_step: Callable[[Probe], None] | None = None,
    ) -> pd.DataFrame:
        """Take ``steps`` steps (with alignment: until that many optimizer steps were taken, at most ``max_iterations``).

        ``stop_on_nonfinite_loss`` ends the run at the first inf/NaN loss: retrying a batch whose
        forward pass overflows (alignment) would only repeat the same failure. ``before_step`` sees the
        probe before each step (e.g. to keep its weights at chosen steps).
        """
        steps = steps if steps is not None else self.config.steps
        # Aligned runs allow extra iterations for skipped steps: a scale settling from far too high
        # needs one skip per halving (2^40 -> 2^16 is 24 skips).
        limit = max_iterations if max_iterations is not None else (2 * steps + 32 if self.align else steps)
        taken = 0
        with self._precision():  # held across the steps: entered once, not once per step
            for _ in range(limit):
                if before_step is not None:
                    before_step(self)
                record = self.step()
                if self.failed is not None or (stop_on_nonfinite_loss and record.nonfinite_loss):
                    break
                taken += 0 if record.skipped else 1
                if self.align and taken >= steps:
                    break
        return self.frame()

    def skips_by_optimizer(self) -> dict[str, int]:
        """How many steps the scaler skipped, per optimizer (each optimizer's step is skipped on its own gradients)."""
        counts = {name: 0 for name in self.optimizers.by_name}
        for record in self.records:
            for name in record.trace.skipped_optimizers if record.trace else []:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def frame(self) -> pd.DataFrame:
        """The record so far as a DataFrame with ``RECORD_COLUMNS``."""
        return pd.DataFrame([r.row() for r in self.records], columns=RECORD_COLUMNS)

    # --- snapshot / restore -------------------------------------------------------------------
    def snapshot(self, copy_state: bool = True) -> ProbeSnapshot:
        """The probe's state now. ``copy_state=False``: the weights and optimizer state as live tensors, for a
        caller that saves them at once (a kept state spilled to disk needs no copy in memory first)."""
        rng = rng_state()
        accumulating = bool(self.records) and self.records[-1].micro_step
        grads = (
            {
                n: p.grad.detach().clone() if copy_state else p.grad
                for n, p in self.model.named_parameters()
                if p.grad is not None
            }
            if accumulating
            else None
        )
        return ProbeSnapshot(
            model=copy.deepcopy(self.model.state_dict()) if copy_state else self.model.state_dict(),
            optimizer=self.optimizers.state(copy_state),
            scheduler=[copy.deepcopy(s.state_dict()) for s in self.schedulers] if self.schedulers else None,
            scaler=copy.deepcopy(self.scaler.state_dict()),
            rng=rng,
            iteration=self.iteration,
            cursor=self.cursor,
            grads=grads,
        )

    def restore(self, snap: ProbeSnapshot, owned: bool = False) -> None:
        """Back to ``snap``. ``owned``: the snapshot is the probe's to keep (a fresh load of a kept state): its
        optimizer tensors become the optimizer's state instead of being copied.

        The probe's own gradients and optimizer state are dropped first: they are replaced anyway, and holding
        them while the snapshot's load would keep two copies of the optimizer state."""
        self._drop_training_state()
        self.model.load_state_dict(snap.model)
        self._load_grads(snap.grads, owned)
        self.optimizers.load(snap.optimizer, owned=owned)
        for scheduler, state in zip(self.schedulers, snap.scheduler or []):
            scheduler.load_state_dict(state)
        if snap.scaler:
            self.scaler.load_state_dict(snap.scaler)
        set_rng_state(snap.rng)
        self.iteration, self.cursor = snap.iteration, snap.cursor
        self.records = [r for r in self.records if r.step < snap.iteration]
        self.failed = None

    def restore_kept(self, kept: MutableMapping[int, ProbeSnapshot], step: int) -> None:
        """Back to the snapshot kept at ``step`` (a :class:`~.kept.KeptStates` on disk or in memory). The
        probe's gradients and optimizer state are freed before the snapshot is read back, so the restore
        holds the probe's weights and one snapshot, not the probe's whole state beside it."""
        self._drop_training_state()
        self.restore(owned_copy(kept, step), owned=True)  # owned: its optimizer tensors are taken over, not copied

    def _drop_training_state(self) -> None:
        """Free the gradients and every optimizer's state (a restore replaces both)."""
        for p in self.model.parameters():
            p.grad = None
        for optimizer in self.optimizers.all():
            optimizer.state.clear()

    def _load_grads(self, grads: dict[str, torch.Tensor] | None, owned: bool) -> None:
        if not grads:
            return
        for name, p in self.model.named_parameters():
            if name in grads:
                g = grads[name]
                p.grad = g.to(p.device) if owned else g.detach().clone().to(p.device)

    def close(self) -> None:
        """Detach what the probe hooked into, and break its reference cycles: a closed probe (its model,
        gradients and optimizer state) is freed as soon as its last reference goes, not at the next full
        garbage collection, so the diagnosis holds one probe at a time."""
        self._watch.close()
        if self._session.half_casts_rewritten:
            self.spec.note(HALF_CASTS_NOTE)
        if self.instruments is not None:
            self.instruments.detach()
        self.optimizers.on_found = None  # a bound method of this probe: the cycle that kept closed probes alive
        if self.runs_compiled and self._compiles_anew:
            torch._dynamo.reset()  # no later probe reuses a graph compiled with this one's fallbacks or eager regions


def outputs_in_float64(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: the model's floating outputs in float64, so that the loss computed from them runs in float64
    (``overrides.loss_in_fp64``; autocast leaves float64 alone)."""
    return floats_to(output, torch.float64)


def metric_driven(scheduler: Any) -> bool:
    """A scheduler whose learning rate follows a measured metric (``ReduceLROnPlateau``), not the step count."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def step_scheduler(scheduler: Any, loss: float) -> None:
    """One scheduler step; a metric-driven scheduler is given the step's loss, as a loop would give it."""
    if metric_driven(scheduler):
        scheduler.step(loss)
    else:
        scheduler.step()


def reported_loss(value: Any) -> Any:
    """The loss inside what a ``train_step`` returned: the tensor or number itself, a mapping's or an output
    object's ``loss`` (Hugging Face's ``ModelOutput``), or the first item of a tuple or list."""
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    inner = output_field(value, "loss")
    if inner is not None:
        return reported_loss(inner)
    if isinstance(value, (tuple, list)) and value:
        return reported_loss(value[0])
    return value


def raising_module(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The name of the deepest submodule of ``model`` whose code was on the stack when ``exc`` was raised."""
    names = {id(m): n for n, m in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


PACKAGE = Path(__file__).resolve().parent.parent
PASSING_THROUGH = ("__torch_dispatch__", "__torch_function__")
"""The doctor's dispatch and function modes call every operator of the step: an operator's error surfaces in them."""


def raised_by_doctor(exc: BaseException) -> bool:
    """``exc`` was raised by the doctor's own code (its instruments, its measurements), not by the training's: the
    frame that raised it lies in the package, outside the precision machinery that wraps the user's calls and the
    user-facing loop (the default loss), and outside the modes every operator passes through."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    try:
        where = Path(last.filename).resolve()
    except OSError:
        return False
    if PACKAGE not in where.parents or last.name in PASSING_THROUGH:
        return False
    return where.parent.name not in ("precision", "userfile")


def _outside_torch_frame(exc: BaseException) -> str | None:
    """The deepest frame outside PyTorch and the doctor's precision machinery (its dispatch modes and thin
    wrappers, which sit under every op of every probe): a helper module of the user's, a library's model, or
    the doctor's default loss, named as such. The same exception then has the same place in every probe (the
    FP32 probe's mode and AMP's autocast policy gave two places, and the AMP one went unexplained)."""
    torch_dir = str(Path(torch.__file__).resolve().parent) + os.sep
    precision = str(Path(__file__).resolve().parent.parent / "precision") + os.sep
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not str(Path(f.filename).resolve()).startswith((torch_dir, precision))
    ]
    if not frames:
        return None
    last = frames[-1]
    if (
        last.name == "default_loss"
        and Path(last.filename).resolve() == Path(default_loss.__code__.co_filename).resolve()
    ):
        what = "cross_entropy(model(x), y)" if "cross_entropy" in (last.line or "") else "model(**batch).loss"
        return f"fp16doctor's default loss {what}"
    return f"{last.filename}:{last.lineno}"
