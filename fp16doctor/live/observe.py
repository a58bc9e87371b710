"""Watching a training loop from outside: no callback, no change to the script.

:class:`TrainingObserver` is what ``fp16doctor watch SCRIPT`` runs the script under. For the
duration of a ``with`` block (and only then: one observer at a time, every patch restored on exit,
under one lock) it observes

* ``GradScaler.scale``: the loss a scaled backward is called on, unscaled (the tensor given to ``scale``);
* ``Tensor.backward``: the loss of a loop without a scaler (the tensor ``backward()`` is called on);
* ``GradScaler.step``, where the skip is decided: it unscales first (what ``step`` does first anyway,
  so the numbers are unchanged), reads the scaler's found-inf flags and checks the step *before* the
  weights move, also on exactly the steps the scaler skips (where ``optimizer.step`` never runs);
* PyTorch's global optimizer step pre-hook, for optimizers stepped without an enabled scaler;
* the model's forward: its inputs (each micro-batch, as references) and, through tensor hooks on its
  outputs, the gradient of the loss w.r.t. those outputs, so a capsule replays the step without the
  script's loss code. The model is the outermost module whose parameters the optimizer steps; it is
  found through global module hooks during the first optimizer step, which are then replaced by
  hooks on the model alone. An optimizer created later (a GAN's discriminator joining after a warm-up)
  or created early but first stepped later turns the global hooks back on until its model is found:
  ``Optimizer.__init__`` is observed, so the new model's very first forward is seen;
* ``zero_grad`` (of an optimizer or a module): the forwards held for a model whose gradients have
  arrived when its gradients are cleared did not feed its next step (a GAN's discriminator run inside
  the generator's loss), so they are dropped and a capsule holds exactly the forwards whose gradients
  the step applies; a forward whose backward is still to come stays (Lightning zeroes between the two).

Each optimizer step is checked by a :class:`~fp16doctor.live.watch.Watch` (one per optimizer) at one
host synchronisation. On an alarm the observer calls ``on_alarm`` and, unless told to keep going,
raises :class:`WatchStopped` (a ``BaseException``: a script's ``except Exception`` does not swallow it).

Under torchrun every rank is observed: a sharded model's gradients on the rank's own shard
(:mod:`~fp16doctor.live.sharding`), each rank's own gradients before the ranks reduce them
(:mod:`~fp16doctor.live.local_grads`), and the ranks against each other in ``GradScaler.update()``
(:mod:`~fp16doctor.live.ranks`).

The watch never breaks the run it observes: whatever fails inside it (never the script's own code, which
runs outside every guard) is reported once, in one line naming what failed, and from then on the watch
measures nothing; under torchrun it still meets the other ranks once more to tell them, so that none of
them waits in a collective the failed rank has left.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..engine.ddp import half_precision_comm_hooks
from ..tensors import dtype_name
from ..userfile.batches import iter_tensors
from ..userfile.compiled import CompileRecorder, compiled_in_place
from ..userfile.modules import compiled_call, unwrapped
from .local_grads import LocalGradients
from .ranks import (
    RankRow,
    disagreement_text,
    failed_row,
    first_divergent,
    first_module,
    gather,
    misuse_hint,
    parameter_checksums,
    rank_story,
    ranks_text,
    total_checksum,
)
from .sharded_capsule import NO_MEETING, TOGETHER, capture_together, ddp_hook_dtype, policy_dtypes
from .sharding import (
    Topology,
    clean_name,
    first_nonfinite_part,
    flat_label,
    flat_parameters,
    gradient_sync_on,
    local_part,
    topology,
)
from .stepstate import StepStartKeeper
from .watch import Alarm, Watch, WatchOptions, first_line

OUTPUT_GRAD_LIMIT = 1 << 24
"""Output elements above which a micro-batch's output gradient is held only once a skip has armed the capture
(an LM's logits, batch x sequence x vocabulary, are too large to hold on every step)."""

_PATCH_LOCK = threading.Lock()
COMPILED_STEP = (
    "the model's forward ran inside a compiled function, where the watch cannot see its inputs: compile the model "
    "(torch.compile(model) or model.compile()) rather than the step, or watch the run uncompiled "
    "(TORCHDYNAMO_DISABLE=1)"
)
"""Why a step compiled as one function has no capsule."""


class _ActiveObserver:
    """Where a module compiled in place reports its calls: the observer watching now, if any (a later watch of
    the same process included; the module keeps no observer alive)."""

    def call_starts(self, module: torch.nn.Module, args: Any) -> None:
        if _active is not None and _active.watching:
            _active.call_starts(module, args)

    def call_raised(self, module: torch.nn.Module) -> None:
        if _active is not None and _active.watching:
            _active.call_raised(module)

    def call_ends(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _active is not None and _active.watching:
            _active.call_ends(module, args, kwargs, output)


_ACTIVE_OBSERVER = _ActiveObserver()
_GLOBAL_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks on modules"
"""What ``OptimizedModule`` warns while the watch's global module hooks are installed (silenced while it watches:
the same warning for a script's own global hooks is silenced too)."""
_active: TrainingObserver | None = None


class WatchStopped(BaseException):
    """The watch stopped the training at an alarm."""

    def __init__(self, alarm: Alarm):
        super().__init__(alarm.pointer())
        self.alarm = alarm


@dataclass
class ModelCall:
    """One training forward of the model: what it received, and the gradients reaching its outputs."""

    module: torch.nn.Module
    batch: dict[str, Any]
    grads: list[torch.Tensor | None] = field(default_factory=list)
    scaled: bool = False
    hooked: bool = False
    """Its outputs' gradients were asked for: none arriving means this forward fed no loss (a ``.detach()``-ed use)."""
    synced: bool = True
    """Its backward reduces the gradients across the ranks: False under DDP's ``no_sync()`` or FSDP2's
    ``set_requires_gradient_sync(False)`` (micro-batches accumulated unreduced)."""

    def fed_no_loss(self) -> bool:
        return self.hooked and all(g is None for g in self.grads)

    def backward_done(self) -> bool:
        """Gradients reached its outputs: the backward of the loss it fed has run."""
        return any(g is not None for g in self.grads)


@dataclass
class StepFacts:
    """What this rank tells the others about its last checked step, at the next ``update()``."""

    alarmed: bool = False
    own: int = -1
    """Its own gradients before the reduction: 1 non-finite, 0 finite, -1 not measured."""
    own_micro_batch: int = -1
    own_first: int = -1
    reduced_first: int = -1

    def merged(self, later: StepFacts) -> StepFacts:
        """Two optimizers stepped before one ``update()``: what either found."""
        return StepFacts(
            self.alarmed or later.alarmed,
            max(self.own, later.own),
            self.own_micro_batch if self.own == 1 else later.own_micro_batch,
            self.own_first if self.own == 1 else later.own_first,
            self.reduced_first if self.reduced_first >= 0 else later.reduced_first,
        )


RANK_TIMEOUT = "rank-timeout"
"""The stop of a rank that waited too long for the others in the watch's own all-gather."""
SHARDED_DISAGREEMENT = (
    "a sharded model's capsule is written for an alarm raised before the step, not for ranks that disagree in update()"
)


LAST_COMPARISON_WAIT = 60.0
"""Seconds the ranks wait for each other in ``destroy_process_group()``'s last comparison (without
``--rank-timeout``): a rank still saving a checkpoint there is not waited for past it, and nothing is stopped."""


def torchrun_rank() -> int | None:
    """This process's rank under torchrun (capsules then carry it in their name); None in a single process."""
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return int(os.environ.get("RANK", "0")) if torchrun else None


class TrainingObserver:
    """Observes every optimizer step of the training run inside its ``with`` block."""

    def __init__(
        self,
        options: WatchOptions | None = None,
        on_alarm: Callable[[Alarm], None] | None = None,
        dtype: str | None = None,
        rank: int | None = None,
        observe_steps: bool = True,
        on_note: Callable[[str], None] | None = None,
    ):
        self.options = options or WatchOptions()
        self.on_note = on_note or _warn
        self.observe_steps = observe_steps
        """False: only the loss is observed (the callbacks check the steps themselves, in their trainer's hooks)."""
        self.on_alarm = on_alarm or (lambda alarm: None)
        self.dtype = dtype
        self.rank = rank
        self.watches: dict[int, Watch] = {}
        self.alarms: list[Alarm] = []
        self._steps: dict[int, int] = {}
        self._roots: list[torch.nn.Module] = []
        self._models: list[torch.nn.Module] = []
        self._outers: dict[int, torch.nn.Module] = {}
        """Each found model's outermost wrapper (DDP's, which holds its gradient-sync flag), by the model's id."""
        self._hook_sites: list[torch.nn.Module] = []
        """Where each found model's own hooks go: the model, or for a compiled one the wrapper whose call runs the
        compiled program (its hooks run eager, outside the graph: no guard, no graph break)."""
        self._discovering = False
        self._compiled_seen = False
        """A compiled model was called: the global module hooks then stay installed (idle once every model is
        found), because removing them changes what dynamo guarded on and recompiles the model."""
        self._compiles = CompileRecorder(_ACTIVE_OBSERVER)
        self._warning_filter: Any = None
        self._calls: list[ModelCall] = []
        self._passed_inputs: dict[int, list[tuple[tuple[Any, ...], dict[str, Any] | None]]] = {}
        """Per hooked model, the inputs of its forwards under way, as the training passed them."""
        self._losses: list[torch.Tensor] = []
        self._last_scaled: tuple[torch.Tensor, torch.Tensor] | None = None
        self._backward_scaled = False
        self._depth = 0
        self._autocast_dtype: str | None = None
        """The low precision the model's forward ran under (the capsule's dtype); None: no autocast seen."""
        self._in_scaler_step = False
        self._pending_stop: Alarm | None = None
        self._in_update = False
        self._last_step: tuple[Watch, torch.optim.Optimizer, list[ModelCall], list[torch.Tensor]] | None = None
        self._handles: list[Any] = []
        self._module_hooks: list[Any] = []
        self._unmatched: list[weakref.ref[torch.optim.Optimizer]] = []
        """Optimizers created inside the watch whose parameters no found model holds yet (the global module
        hooks stay on until each has its model)."""
        self._originals: list[tuple[Any, str, Any]] = []
        self._step_states: dict[int, StepStartKeeper] = {}
        """Per model (by id), the state its forward writes to as the current step found it: kept at the step's first
        training forward, handed to the model's watch (:mod:`.stepstate`)."""
        self.resumed_scalers: weakref.WeakSet[GradScaler] = weakref.WeakSet()
        """Scalers the script loaded a saved state into: settled, whatever their scale (``load_state_dict`` sets
        ``init_scale`` to the loaded scale, so the scale alone cannot tell)."""
        self.failure: str | None = None
        """What of the watch failed: from then on it measures nothing and the training goes on unwatched."""
        self._agreeing = True
        """Under torchrun: still meeting the other ranks in ``update()`` (until every rank has heard of a failure)."""
        self._own = LocalGradients(self.failed)
        self._backwards = 0
        self._updates = 0
        self._stopped = False
        """A stop ended the run here (an alarm, a rank that did not come): the ranks meet no more."""
        self._facts: StepFacts | None = None
        self._unsaid: list[Alarm] = []
        """Alarms of this step not printed yet: under torchrun they are said in ``update()``, with the other ranks'
        part of the story."""
        self._topologies: dict[int, Topology] = {}
        """By ``id`` of each watch: how its model's gradients travel between the ranks."""
        self._replicated: dict[int, list[tuple[str, torch.Tensor]]] = {}
        """By ``id`` of each watch: the parameters every rank holds whole (a DDP model's, less those it ignores)."""
        self._flats: dict[int, dict[int, tuple[Any, list[str]]]] = {}
        """By ``id`` of each watch: its model's FSDP1 flat parameters, with the original parameters each holds."""

    # --- never breaking the run -------------------------------------------------------------------------
    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Runs a part of the watch: whatever it raises (but a stop) is the watch's failure, not the training's."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - the watch's own failure must never reach the training
            self.failed(what, exc)

    def failed(self, what: str, exc: BaseException) -> None:
        """Say once what failed; measure nothing more."""
        if self.failure is not None:
            return
        self.failure = what
        self._own.on = False
        self._calls, self._losses, self._last_scaled = [], [], None
        self._passed_inputs.clear()
        where = f"rank {self.rank}: " if self.rank is not None else ""
        self.on_note(
            f"{where}the watch's {what} failed ({type(exc).__name__}: {first_line(exc)}); the training goes on "
            f"unwatched"
        )

    @property
    def watching(self) -> bool:
        return self.failure is None

    # --- install / restore ------------------------------------------------------------------------
    def __enter__(self) -> TrainingObserver:
        """Patch and hook. Entered again after an exit it keeps the models and optimizers it found, so it is at once
        in the state of a long watch (``benchmarks/watch_overhead.py`` switches it on and off between steps)."""
        global _active
        with _PATCH_LOCK:
            if _active is not None:
                raise RuntimeError("another fp16doctor watch is already observing this process")
            _active = self
            self._patch(torch.Tensor, "backward", _observed_backward)
            for cls in _scaler_classes():
                if "scale" in vars(cls):
                    self._patch(cls, "scale", _observed_scale(vars(cls)["scale"]))
            if not self.observe_steps:
                return self
            self._patch(GradScaler, "step", _observed_step(GradScaler.step))
            self._patch(GradScaler, "load_state_dict", _observed_scaler_load(GradScaler.load_state_dict))
            for cls in _scaler_classes():
                if "update" in vars(cls):
                    self._patch(cls, "update", _observed_update(vars(cls)["update"]))
            self._patch(
                torch.optim.Optimizer, "__init__", _observed_optimizer_init(vars(torch.optim.Optimizer)["__init__"])
            )
            self._patch(
                torch.optim.Optimizer, "zero_grad", _observed_zero_grad(vars(torch.optim.Optimizer)["zero_grad"])
            )
            self._patch(torch.nn.Module, "zero_grad", _observed_zero_grad(vars(torch.nn.Module)["zero_grad"]))
            self._patch(torch, "compile", self._compiles.observed(vars(torch)["compile"]))
            if dist.is_available():
                self._patch(dist, "destroy_process_group", _observed_destroy(vars(dist)["destroy_process_group"]))
            warnings.filterwarnings("ignore", message=_GLOBAL_HOOKS_WARNING)
            self._warning_filter = warnings.filters[0]
            group = _fsdp2_param_group()
            if group is not None:
                self._patch(group, "post_backward", _observed_post_backward(vars(group)["post_backward"]))
            self._handles = [register_optimizer_step_pre_hook(self._optimizer_pre_step)]
            self._handles += [m.register_forward_hook(self._model_forward, with_kwargs=True) for m in self._hook_sites]
            for root in self._roots:
                self._own.watch(root)
            self._handles += [m.register_forward_pre_hook(self._model_pre_forward) for m in self._hook_sites]
            self._handles += [self._inputs_hook(m) for m in self._hook_sites]
            self._discover(bool(self._unmatched) or not self._models)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        with _PATCH_LOCK:
            for handle in self._handles:
                handle.remove()
            _remove_global_hooks(self._module_hooks)
            self._handles, self._module_hooks = [], []
            self._passed_inputs.clear()
            self._own.remove()
            if self._warning_filter in warnings.filters:  # an "ignore" left no registry entry to clear
                warnings.filters.remove(self._warning_filter)  # type: ignore[attr-defined]
            self._warning_filter = None
            unsaid, self._unsaid = self._unsaid, []
            for alarm in unsaid:  # a script that stepped but never reached update()
                self.on_alarm(alarm)
            self._calls, self._losses, self._last_scaled = [], [], None  # an unchecked step's references die here
            for owner, name, original in reversed(self._originals):
                setattr(owner, name, original)
            self._originals = []
            _active = None

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._originals.append((owner, name, vars(owner)[name]))
        setattr(owner, name, replacement)

    # --- the loss -------------------------------------------------------------------------------------
    def scaled(self, scaled: Any, loss: Any) -> None:
        """``scaler.scale(loss)`` returned ``scaled``: a backward on it optimises ``loss``."""
        if isinstance(scaled, torch.Tensor) and isinstance(loss, torch.Tensor):
            self._last_scaled = (scaled, loss)

    def backward(self, tensor: torch.Tensor) -> None:
        """``tensor.backward()`` is about to run: record the loss it optimises (unscaled), as a reference."""
        last, self._last_scaled = self._last_scaled, None
        self._backward_scaled = last is not None and last[0] is tensor
        loss = last[1] if last is not None and self._backward_scaled else tensor
        if loss.numel() == 1:
            self._losses.append(loss.detach())
        self._own.micro_batch = self._backwards  # the own gradients this backward makes are of this micro-batch
        self._backwards += 1

    def take_losses(self) -> list[torch.Tensor]:
        """The losses backward ran on since the last call (references), for a callback's own check."""
        losses, self._losses = self._losses, []
        return losses

    # --- the model's forward ----------------------------------------------------------------------------
    def _discover(self, on: bool) -> None:
        """Global module hooks on (looking for the outermost modules the training runs) or off (every model found).

        Off, they are removed, but where anything was compiled: there they stay, idle (entered again, the watch
        puts them back idle), because installing or removing them changes what dynamo guarded on."""
        if on and not self._discovering:
            self._depth = 0
        self._discovering = on
        keep = on or self._compiled_seen or self._compiles.compiled_any
        if keep and not self._module_hooks:
            self._module_hooks = [
                torch.nn.modules.module.register_module_forward_pre_hook(self._global_pre_forward),
                torch.nn.modules.module.register_module_forward_hook(
                    self._global_forward, with_kwargs=True, always_call=True
                ),
            ]
        elif not keep:
            _remove_global_hooks(self._module_hooks)
            self._module_hooks = []

    def _global_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or not self._discovering:  # traced by dynamo: a no-op, guarding on nothing
            return
        if self._depth == 0 and not any(unwrapped(module) is m for m in self._models):  # a found model's own hook
            self._model_pre_forward(module, args)
            self._keep_inputs(module, args, None)  # global hooks run before FSDP's cast: the inputs as passed
        self._depth += 1

    def _model_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A forward of an outermost module is about to run: at its step's first training forward, keep the state
        it may write to (a memory module's buffers, a cache, running statistics) as it is now."""
        if self.failure is not None or not (module.training and torch.is_grad_enabled()):
            return
        try:
            if next(module.parameters(), None) is None:
                return
            model = unwrapped(module)
            keeper = self._step_states.get(id(model))
            if keeper is None:
                keeper = self._step_states[id(model)] = StepStartKeeper()
            keeper.begin(model)
        except Exception as exc:  # noqa: BLE001 - the watch's own failure
            self.failed("keeping of the state the forward writes", exc)

    def _global_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._discovering:
            return
        self._depth -= 1
        if self._depth != 0 or self.failure is not None:
            return
        try:
            if not any(module is m for m in self._roots) and any(True for _ in module.parameters()):
                self._roots.append(module)
                self._compiled_seen = self._compiled_seen or compiled_call(module) is not None
                self._own.watch(module)  # before its first backward: a DDP or FSDP1 model's own gradients
            if not any(unwrapped(module) is m for m in self._models):  # a found model's own hook records it
                self._record_forward(module, args, kwargs, output)
        except Exception as exc:  # noqa: BLE001 - the watch's own failure
            self.failed("discovery of the model", exc)

    def _model_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The found model's forward hook."""
        if self.failure is not None:
            return
        try:
            self._record_forward(module, args, kwargs, output)
        except Exception as exc:  # noqa: BLE001 - the watch's own failure
            self.failed("capture of the step's batches", exc)

    def _record_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A training forward of the model: hold its inputs, hook the gradients reaching its outputs."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self._autocast_dtype = self._autocast_dtype or autocast_dtype()
        passed = self._passed_inputs.get(id(module))
        if passed:
            args, kept = passed.pop()
            kwargs = kwargs if kept is None else kept
        call = ModelCall(unwrapped(module), {"args": tuple(args), "kwargs": dict(kwargs or {})})
        if self.rank is not None:  # under torchrun: whether this micro-batch's gradients are reduced at once
            call.synced = gradient_sync_on(self._outers.get(id(call.module), module))  # DDP's flag is the wrapper's
        outputs = [t for _, t in iter_tensors(output)]
        call.grads = [None] * len(outputs)
        if sum(t.numel() for t in outputs) <= OUTPUT_GRAD_LIMIT or self._armed(module):
            for index, tensor in enumerate(outputs):
                if tensor.requires_grad:
                    tensor.register_hook(self._grad_catcher(call, index))
        self._calls.append(call)

    def _grad_catcher(self, call: ModelCall, index: int) -> Callable[[torch.Tensor], None]:
        def catch(grad: torch.Tensor) -> None:
            call.grads[index] = grad
            call.scaled = self._backward_scaled

        call.hooked = True
        return catch

    def gradients_cleared(self, owner: Any) -> None:
        """``owner.zero_grad()`` (an optimizer or a module): the held forwards of its model whose gradients have
        arrived fed no step to come (their gradients are gone). A forward whose backward is still to come stays:
        Lightning runs the training step, then ``zero_grad``, then the backward."""
        if not self._calls:
            return
        watch = self.watches.get(id(owner))
        if isinstance(owner, torch.nn.Module):
            models = [unwrapped(owner)]
        elif watch is not None:
            models = [watch.model]
        else:  # not stepped yet: the held forwards' models whose parameters it clears
            cleared = {id(p) for group in owner.param_groups for p in group["params"]}
            models = list(
                {
                    id(c.module): c.module for c in self._calls if any(id(p) in cleared for p in c.module.parameters())
                }.values()
            )
        if models:
            self._calls = [c for c in self._calls if not (c.backward_done() and any(c.module is m for m in models))]

    def optimizer_created(self, optimizer: torch.optim.Optimizer) -> None:
        """A new optimizer: look for its model from now on, unless a found model already holds its parameters."""
        if not self._covered(optimizer):
            self._unmatched.append(weakref.ref(optimizer))
            self._discover(True)

    def _covered(self, optimizer: torch.optim.Optimizer) -> bool:
        held = {id(p) for m in self._models for p in m.parameters()}
        return all(id(p) in held for group in optimizer.param_groups for p in group["params"])

    def _settle_discovery(self) -> None:
        """The global module hooks go once every optimizer created has its model (they cost a call per module)."""
        self._unmatched = [
            r for r in self._unmatched if (o := r()) is not None and id(o) not in self.watches and not self._covered(o)
        ]
        if not self._unmatched and self._models:
            self._discover(False)

    def _armed(self, module: torch.nn.Module) -> bool:
        """A first trouble sign (the last step was skipped) arms holding large output gradients."""
        model = unwrapped(module)
        return any(w.model is model and w.history and w.history[-1].skipped for w in self.watches.values())

    def _adopt(self, model: torch.nn.Module, outer: torch.nn.Module) -> None:
        """Found the model: hook it alone (the global module hooks go once no optimizer waits for its model)."""
        self._models.append(model)
        self._outers[id(model)] = outer
        if compiled_in_place(model):  # its hooks would run inside its compiled program: observed around it
            return
        site = outer if compiled_call(outer) is not None else model
        self._hook_sites.append(site)
        self._handles.append(site.register_forward_hook(self._model_forward, with_kwargs=True))
        self._handles.append(site.register_forward_pre_hook(self._model_pre_forward))
        self._handles.append(self._inputs_hook(site))

    def _inputs_hook(self, site: torch.nn.Module) -> Any:
        """The model's inputs as the training passes them, kept before any other pre-forward hook (FSDP's cast of
        the inputs to ``param_dtype``, which hands the forward hooks the cast ones): a capsule replays the batch
        the training had, and casts it as the run's policy does."""
        return site.register_forward_pre_hook(self._model_inputs, prepend=True, with_kwargs=True)

    def _model_inputs(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        self._keep_inputs(module, args, kwargs)

    def _keep_inputs(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        """``kwargs`` None: a global hook's, which gets none; the forward hook's then stand."""
        if self.failure is None and module.training and torch.is_grad_enabled():
            under_way = self._passed_inputs.setdefault(id(module), [])
            under_way.append((tuple(args), None if kwargs is None else dict(kwargs)))
            del under_way[:-4]  # forwards that raised leave theirs: not held past a few

    def call_starts(self, module: torch.nn.Module, args: Any) -> None:
        """A module compiled in place is called (outside its compiled program): what its hooks would do."""
        if any(module is m for m in self._models):
            self._model_pre_forward(module, args)
        else:
            self._global_pre_forward(module, args)

    def call_raised(self, module: torch.nn.Module) -> None:
        """The call raised: no output to record, and the discovery's depth goes back (what ``always_call`` does)."""
        if not any(module is m for m in self._models) and self._discovering and self._depth > 0:
            self._depth -= 1

    def call_ends(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if any(module is m for m in self._models):
            self._model_forward(module, args, kwargs, output)
        else:
            self._global_forward(module, args, kwargs, output)

    # --- the optimizer step ------------------------------------------------------------------------------
    def scaler_step(self, scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """Inside ``scaler.step(optimizer)``, before the original: unscale (as step does first), then check."""
        self.check(optimizer, scaler, scaler_decision(scaler, optimizer))

    def _optimizer_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_scaler_step and self.watching:
            with self.guard("per-step measurement"):
                self.check(optimizer, None, None)

    def check(
        self, optimizer: torch.optim.Optimizer, scaler: GradScaler | None, found_inf: torch.Tensor | None
    ) -> None:
        """Check one optimizer step (one host sync); on an alarm tell ``on_alarm`` and stop unless told to keep going.

        Under torchrun with a GradScaler the alarm is told in ``update()``, where every rank meets: with the other
        ranks' part of the story, and so that every rank stops there together."""
        watch = self._watch_for(optimizer)
        self._settle_discovery()
        watch.label = (
            f"{type(optimizer).__name__} ({type(watch.model).__name__})"
            if len(self.watches) + len(self._unmatched) > 1
            else None
        )
        step = self._steps.get(id(optimizer), 0)
        self._steps[id(optimizer)] = step + 1
        calls = [c for c in self._calls if c.module is watch.model and not c.fed_no_loss()]
        for call in calls:
            watch.capture_batch(call.batch)
            watch.record_output_grads(call.grads, call.scaled)
        for loss in self._losses:
            watch.record_loss(loss)
        others = [w.model for w in self.watches.values() if w is not watch]  # e.g. a GAN's second model
        self._calls = [c for c in self._calls if any(c.module is m for m in others)]
        distributed = _world_size() > 1
        if distributed:  # held until update() has agreed across ranks
            self._last_step = (watch, optimizer, calls, self._losses)
        self._losses = []
        watch.scaler_resumed = scaler is not None and scaler in self.resumed_scalers
        own = self._own.nonfinite_count()
        try:
            alarm = watch.before_optimizer_step(
                step, optimizer, scaler, grads_scaled=False, found_inf=found_inf, own_nonfinite=own
            )
            facts = self._facts_of(watch, optimizer, alarm)
        finally:
            self._own.next_step()
            self._backwards = 0
        # the ranks meet in this scaler's update(), unless a watch failed: then an alarming rank stops alone
        meeting = scaler is not None and distributed and self._agreeing
        self._facts = facts if self._facts is None or not meeting else self._facts.merged(facts)
        if alarm is None:
            return
        self.alarms.append(alarm)
        if meeting:
            self._unsaid.append(alarm)
            if self.options.stop_on_alarm:
                self._pending_stop = alarm  # every rank stops together in update(), which all of them reach
            return
        if facts.own == 1:
            alarm.message += f"; {self._own_story(facts)}"
        if alarm.no_capsule == TOGETHER:
            alarm.no_capsule = NO_MEETING
        self.on_alarm(alarm)
        if self.options.stop_on_alarm:
            self._stopped = True
            raise WatchStopped(alarm)

    def _facts_of(self, watch: Watch, optimizer: torch.optim.Optimizer, alarm: Alarm | None) -> StepFacts:
        """What the step's check found that the other ranks should hear (where first only on trouble: a sync)."""
        numbers = watch.history[-1]
        facts = StepFacts(
            alarmed=alarm is not None, own=-1 if numbers.own_nonfinite is None else int(numbers.own_nonfinite)
        )
        if numbers.own_nonfinite:
            first = self._own.first_nonfinite(self._parameter_order(watch))
            if first is not None:
                facts.own_micro_batch, facts.own_first = first
        if numbers.nonfinite_layers:
            facts.reduced_first = self._first_reduced(watch, optimizer, numbers.nonfinite_layers[0])
        return facts

    def _parameter_order(self, watch: Watch) -> dict[str, int]:
        """Each of the model's parameters' position in it, by the user's name (a flat parameter's by those of the
        parameters it holds)."""
        flats = self._flats.get(id(watch), {})
        names: list[str] = []
        for name, param in watch.model.named_parameters():
            names += flats[id(param)][1] if id(param) in flats else [clean_name(name)]
        return {name: index for index, name in enumerate(names)}

    def _reduced_names(self, watch: Watch, optimizer: torch.optim.Optimizer) -> list[str]:
        """The optimizer's parameters by name, a flat parameter by the original parameters it holds."""
        flats = self._flats.get(id(watch), {})
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names: list[str] = []
        for param, name in zip(params, watch.param_names(optimizer)):
            names += flats[id(param)][1] if id(param) in flats else [name]
        return names

    def _first_reduced(self, watch: Watch, optimizer: torch.optim.Optimizer, first_bad: str) -> int:
        """Where in :meth:`_reduced_names` the first non-finite reduced gradient is (within a flat parameter: the
        first original parameter whose part of this rank's shard is non-finite)."""
        flats = self._flats.get(id(watch), {})
        params = [p for group in optimizer.param_groups for p in group["params"]]
        position = 0
        for param, name in zip(params, watch.param_names(optimizer)):
            flat = flats.get(id(param))
            if name == first_bad:
                part = first_nonfinite_part(flat[0], local_part(param.grad)) if flat and param.grad is not None else 0
                return position + (part or 0)
            position += len(flat[1]) if flat else 1
        return -1

    def _own_story(self, facts: StepFacts) -> str:
        who = f"rank {self.rank}'s" if self.rank is not None else "this rank's"
        name = self._own.names[facts.own_first] if 0 <= facts.own_first < len(self._own.names) else "?"
        return (
            f"{who} own gradients were non-finite before the ranks reduced them (micro-batch {facts.own_micro_batch}, "
            f"{first_module(name)})"
        )

    def _watch_for(self, optimizer: torch.optim.Optimizer) -> Watch:
        key = id(optimizer)
        if key not in self.watches:
            model, outer = self._model_of(optimizer)
            watch = Watch(model, self.options, framework="script", dtype=self.dtype or self._autocast_dtype)
            watch.rank = self.rank
            shape = topology(outer if outer is not None else model, _world_size())
            self._topologies[id(watch)] = shape
            watch.sharded = shape.sharded
            watch.no_capsule = _capsule_plan(shape)
            if shape.replicated and outer is not None:
                ignored = set(getattr(outer, "parameters_to_ignore", None) or ())
                self._replicated[id(watch)] = [(n, p) for n, p in model.named_parameters() if n not in ignored]
            flats = flat_parameters(model)
            self._flats[id(watch)] = flats
            if flats:
                names: dict[Any, str] = {p: clean_name(n) for n, p in model.named_parameters()}
                watch.name_parameters({**names, **{flat: flat_label(held) for flat, held in flats.values()}})
            watch.step_state = self._step_states.setdefault(id(watch.model), StepStartKeeper())
            watch.compiled = self._compiles.options_of(outer) if outer is not None else None
            if watch.compiled is None:  # compiled per block, the model around them eager
                watch.compiled = self._compiles.parts_of(model)
            if outer is None and self._compiles.functions_compiled:
                watch.unseen_forward = COMPILED_STEP
            self.watches[key] = watch
        return self.watches[key]

    def _model_of(self, optimizer: torch.optim.Optimizer) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """The outermost module seen in training holding most of the optimizer's parameters (DDP and
        ``torch.compile`` unwrapped: the module the capsule rebuilds), and that outermost module itself."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        scored = [(sum(1 for p in m.parameters() if id(p) in stepped), m) for m in self._roots]
        count, outer = max(scored, key=lambda s: s[0], default=(0, None))
        if outer is None or count == 0:
            holder = torch.nn.Module()
            holder.params = torch.nn.ParameterList([p for g in optimizer.param_groups for p in g["params"]])
            return holder, None
        model = unwrapped(outer)
        if model not in self._models:
            self._adopt(model, outer)
            self._own.watch(outer)
            half = half_precision_comm_hooks(outer)
            if half and not self.rank:  # the same hook on every rank: said once, by rank 0 (or a lone process)
                self.on_note(
                    f"DDP gradients are all-reduced in half precision ({', '.join(half)}): "
                    "remove the compression hook to reduce them in fp32 (cause ddp-half-allreduce)"
                )
        return model, outer

    # --- under torchrun ---------------------------------------------------------------------------------
    def before_update(self, scaler: GradScaler) -> None:
        """Inside ``scaler.update()``, which every rank reaches (also a rank whose step was skipped): agree.

        One all-gather of each rank's :class:`~fp16doctor.live.ranks.RankRow` per step. Ranks that disagree on the
        scale or on a skip are an alarm of their own, and so are replicated parameters that differ; an alarm on
        any rank stops every rank here, so that none is left waiting in a collective the alarming rank never
        reaches. A rank whose watch failed says so here once; then no rank meets the others again."""
        world = _world_size()
        if world < 2 or scaler._scale is None or not self._agreeing:
            return
        step = self._step_of_last()
        checksums: torch.Tensor | None = None
        try:
            mine, checksums = self._row(scaler)
        except Exception as exc:  # noqa: BLE001 - the watch's own failure: the rank still meets the others
            self.failed("report to the other ranks", exc)
            mine = failed_row(scaler._scale.device)
        table = [RankRow.of(row) for row in torch.stack(self._gather(mine, step)).tolist()]  # one transfer
        self._updates += 1
        if any(row.failed for row in table):
            self._agreeing = False
            others = [r for r, row in enumerate(table) if row.failed and r != self.rank]
            if others and self.failure is None:
                self.on_note(f"the watch failed on {ranks_text(others)}: the ranks are compared no more")
        elif self.watching:
            with self.guard("comparison of the ranks"):
                self._compare(table, scaler, checksums, step)
        capsule = self._capsule_together(table, scaler)
        self._say_unsaid(table)
        self._last_step = None
        together = self._stops_every_rank(table)  # then this rank stops too, whatever it found itself
        stopping = [rank for rank, row in enumerate(table) if row.stop] or (
            [self.rank or 0] if self._pending_stop else []
        )
        if (stopping or together) and self.options.stop_on_alarm:
            raised = stopping or [rank for rank, row in enumerate(table) if row.alarmed] or list(range(len(table)))
            alarm = self._pending_stop or Alarm(
                "stopped", step, f"{ranks_text(raised)} raised an alarm", rank=self.rank
            )
            if self._pending_stop is None:
                alarm.capsule, alarm.no_capsule = capsule
                self.on_alarm(alarm)
            if together:
                self._said_together(scaler._scale.device)
            self._stopped = True
            raise WatchStopped(alarm)

    def _stops_every_rank(self, table: list[RankRow]) -> bool:
        """Whether the table alone stops every rank: a rank's stop in its row, or an alarm the ranks raise from the
        table (a disagreement, a divergence). Every rank computes it from the same table, so that all of them meet
        once more or none does; a rank that stops on what only it knows (its watch failed) leaves alone."""
        wanted = self.options.alarms
        if not self.options.stop_on_alarm or any(row.failed for row in table):
            return False
        return (
            any(row.stop for row in table)
            or (disagree(table) and "rank-disagreement" in wanted)
            or (diverged(table) and "rank-divergence" in wanted)
        )

    def _said_together(self, device: torch.device) -> None:
        """Meet the others once more before stopping: torchrun ends every rank when the first one exits, so a rank
        still printing its own alarms of this step would lose them. A rank that does not come is not waited for
        beyond the rank timeout: the stop stands."""
        try:
            gather(torch.zeros(1, device=device), self.options.rank_timeout)
        except RuntimeError:  # a rank that failed or left (gloo's and NCCL's errors are RuntimeErrors)
            pass

    def _capsule_together(self, table: list[RankRow], scaler: GradScaler) -> tuple[Path | None, str | None]:
        """Where a rank of a sharded run alarmed at this step, its capsule, captured by every rank together
        (:mod:`.sharded_capsule`): its folder or why there is none, set on this rank's alarms of the step. Every
        rank decides from the same table, so that all make its collectives or none."""
        last = self._last_step
        if last is None or not any(row.alarmed or row.stop for row in table) or any(row.failed for row in table):
            return None, None
        watch, optimizer, calls, _ = last
        if watch.no_capsule != TOGETHER:
            return None, None
        try:
            reduction = self._reduction_of(watch, calls)
            capsule = capture_together(watch, optimizer, scaler, calls, [row.skipped for row in table], reduction)
        except Exception as exc:  # noqa: BLE001 - the watch's own failure: the training goes on
            capsule = None, f"capturing it failed ({type(exc).__name__}: {first_line(exc)})"
        for alarm in self._unsaid:
            if alarm.no_capsule == TOGETHER:
                alarm.capsule, alarm.no_capsule = capsule
        return capsule

    def _reduction_of(self, watch: Watch, calls: list[ModelCall]) -> dict[str, Any]:
        """How the ranks computed and reduced, as a sharded capsule's ``sharding`` config says it: with several
        micro-batches, whether each was reduced at its backward or only the last (sync off before it)."""
        shape = self._topologies.get(id(watch))
        common = {
            "autocast": self._autocast_dtype is not None,
            "sync_each_micro_batch": all(c.synced for c in calls[:-1]),
        }
        if shape is not None and shape.wrapper == "DistributedDataParallel":
            hooks = [h.strip() for h in (shape.half_reduction or "").split(",")]
            return {"wrapper": "ddp", "param_dtype": None, "reduce_dtype": ddp_hook_dtype(hooks), **common}
        wrapper = "fsdp1" if shape is not None and shape.wrapper == "FullyShardedDataParallel" else "fully_shard"
        return {"wrapper": wrapper, **policy_dtypes(watch.model), **common}

    def _row(self, scaler: GradScaler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What this rank says (device tensors: read in the all-gather's one transfer), and its parameters'
        checksums where it takes them this time."""
        assert scaler._scale is not None
        if self.failure is not None:
            return failed_row(scaler._scale.device), None
        device = scaler._scale.device
        flags = [
            f.to(device).reshape(())
            for state in scaler._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        skipped = (torch.stack(flags).sum() > 0).float() if flags else torch.zeros((), device=device)
        facts, self._facts = self._facts or StepFacts(), None
        replicated = self._replicated_parameters()
        checksums = None
        checksum = torch.zeros((), device=device)
        if replicated and self._updates % max(1, self.options.checksum_every) == 0:
            checksums = parameter_checksums([p for _, p in replicated]).to(device)
            checksum = total_checksum(checksums)
        rest = [
            float(self._pending_stop is not None),
            0.0,
            float(facts.alarmed),
            float(facts.own),
            float(facts.own_micro_batch),
            float(facts.own_first),
            float(facts.reduced_first),
            float(len(replicated) if checksums is not None else 0),
        ]
        return RankRow.tensor(scaler._scale, skipped, checksum, rest), checksums

    def _gather(self, tensor: torch.Tensor, step: int) -> list[torch.Tensor]:
        """All the ranks' ``tensor``; a wait that times out or fails stops this rank with a line naming it."""
        try:
            return gather(tensor, self.options.rank_timeout)
        except RuntimeError as exc:
            limit = f" within {self.options.rank_timeout:g} s" if self.options.rank_timeout is not None else ""
            alarm = Alarm(
                RANK_TIMEOUT,
                step,
                f"the watch's all-gather of the ranks' scale and skip decision in GradScaler.update() did not "
                f"complete{limit} ({type(exc).__name__}: {first_line(exc)}): another rank did not reach update()",
                rank=self.rank,
            )
            self._tell(alarm)
            self._agreeing = False
            self._stopped = True
            raise WatchStopped(alarm) from exc

    def _replicated_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters every rank holds whole (a DDP model's, less those DDP was told to ignore), in the order
        the models were found (the same on every rank)."""
        found: list[tuple[str, torch.Tensor]] = []
        for watch in self.watches.values():
            found += self._replicated.get(id(watch), [])
        return found

    def _compare(self, table: list[RankRow], scaler: GradScaler, checksums: torch.Tensor | None, step: int) -> None:
        if disagree(table):
            self._disagreement(table, scaler)
        if diverged(table):
            self._divergence(table, checksums, step)

    def _divergence(self, table: list[RankRow], checksums: torch.Tensor | None, step: int) -> None:
        """Replicated parameters differ across the ranks: name the first (a second all-gather, of each parameter's
        checksum: every rank reads the same table, so every rank makes it)."""
        names = [n for n, _ in self._replicated_parameters()]
        counts = {row.checksummed for row in table}
        if len(counts) > 1 or checksums is None:
            said = ", ".join(f"rank {r}: {row.checksummed}" for r, row in enumerate(table))
            message = f"the ranks hold different replicated parameters ({said})"
        else:
            per_rank = [t.tolist() for t in self._gather(checksums, step)]
            index = first_divergent(per_rank)
            copies = (
                self._divergent_copies(names, per_rank, index) if index is not None else "the ranks' copies of ? differ"
            )
            message = (
                f"{copies} after optimizer step {step} (the first replicated parameter to differ, compared every "
                f"{self.options.checksum_every} steps): the ranks trained apart"
            )
        if "rank-divergence" not in self.options.alarms:
            return
        alarm = Alarm("rank-divergence", step, message, rank=self.rank)
        self._tell(alarm)
        if self._pending_stop is None:
            self._pending_stop = alarm

    def before_destroy(self) -> None:
        """Inside ``destroy_process_group()``, which every rank of a finished training reaches: the replicated
        parameters compared once more where the last comparison was steps ago (a drift after it, or in a training
        with no GradScaler to meet in, would end unseen). Every rank decides from what they all share: the number
        of ``update()`` calls and the parameters found."""
        replicated = self._replicated_parameters()
        # what every rank knows alike: the updates they met in, whether they still agreed there, whether a stop
        # ended the run (a rank alone in a collective the others never make would wait for them)
        last_compared = (self._updates - 1) % max(1, self.options.checksum_every) == 0
        shared = self._updates > 0 and self._agreeing and not self._stopped
        if _world_size() < 2 or not shared or not replicated or last_compared:
            return
        checksums = parameter_checksums([p for _, p in replicated]).to(replicated[0][1].device)
        step = max(self._steps.values(), default=0) - 1  # the last optimizer step taken
        try:
            per_rank = [t.tolist() for t in gather(checksums, self.options.rank_timeout or LAST_COMPARISON_WAIT)]
        except RuntimeError as exc:  # a rank that left early, or reached this much later: no comparison, no stop
            self.on_note(f"the ranks' last comparison of their parameters did not complete ({first_line(exc)})")
            return
        index = first_divergent(per_rank)
        if index is None or "rank-divergence" not in self.options.alarms:
            return
        alarm = Alarm(
            "rank-divergence",
            step,
            f"{self._divergent_copies([n for n, _ in replicated], per_rank, index)} at the end of the training, "
            f"after optimizer step {step} (compared there once more)",
            rank=self.rank,
        )
        self._tell(alarm)

    def _tell(self, alarm: Alarm) -> None:
        """An alarm raised here: kept (the exit code counts them) and told."""
        self.alarms.append(alarm)
        self.on_alarm(alarm)

    @staticmethod
    def _divergent_copies(names: list[str], per_rank: list[list[float]], index: int) -> str:
        """ "the ranks' copies of NAME differ (ranks 0 vs 1)": the first replicated parameter whose checksums differ."""
        groups: dict[float, list[int]] = {}
        for r, values in enumerate(per_rank):
            groups.setdefault(values[index], []).append(r)
        name = names[index] if index < len(names) else "?"
        return f"the ranks' copies of {name} differ ({' vs '.join(ranks_text(g) for g in groups.values())})"

    def _say_unsaid(self, table: list[RankRow]) -> None:
        """Tell this step's alarms, each with the ranks' story of the step."""
        unsaid, self._unsaid = self._unsaid, []
        story = None
        if self.watching and self._last_step is not None:
            with self.guard("comparison of the ranks"):
                watch, optimizer = self._last_step[0], self._last_step[1]
                story = rank_story(
                    table, self._own.names, self._reduced_names(watch, optimizer), self._topologies.get(id(watch))
                )
        for alarm in unsaid:
            if story:
                alarm.message += f"; {story}"
            self.on_alarm(alarm)

    def _disagreement(self, table: list[RankRow], scaler: GradScaler) -> None:
        """Ranks disagree: the skipping ranks (rank 0 where only the scale differs) write a capsule."""
        said = disagreement_text(table)
        skips_differ = len({row.skipped for row in table}) > 1
        writers = [r for r, row in enumerate(table) if row.skipped] if skips_differ else [0]
        message = f"the ranks disagree ({said})"
        last = self._last_step
        if skips_differ:
            message += f": {misuse_hint(self._topologies.get(id(last[0])) if last else None, scaler)}"
        alarm = Alarm("rank-disagreement", self._step_of_last(), message, rank=self.rank)
        if last is not None and self.rank in writers and "rank-disagreement" in self.options.alarms:
            watch, optimizer, calls, losses = last
            for call in calls:
                watch.capture_batch(call.batch)
                watch.record_output_grads(call.grads, call.scaled)
            for loss in losses:
                watch.record_loss(loss)
            if watch.alarm is None:
                watch.alarm = alarm
            self._capsule_alone(watch, alarm, optimizer, scaler)
            watch.forget_step()
        elif last is not None:
            alarm.no_capsule = self._written_elsewhere(last[0], writers)
        if "rank-disagreement" in self.options.alarms:
            self._tell(alarm)
            if self._pending_stop is None:
                self._pending_stop = alarm

    def _written_elsewhere(self, watch: Watch, writers: list[int]) -> str:
        """What a rank that writes no capsule of a disagreement says of it: which rank writes it (the skipping ranks,
        or rank 0 where only the scale differs), or what stops that rank too."""
        shape = self._topologies.get(id(watch))
        if watch.no_capsule == TOGETHER and (shape is None or not shape.replicated):
            return SHARDED_DISAGREEMENT
        if watch.no_capsule not in (None, TOGETHER):
            return watch.no_capsule  # what stops the writing rank stops it too
        return f"{ranks_text(writers)} {'is' if len(writers) == 1 else 'are'} to write it (its line says where)"

    def _capsule_alone(self, watch: Watch, alarm: Alarm, optimizer: torch.optim.Optimizer, scaler: GradScaler) -> None:
        """The capsule of an alarm the ranks raise in ``update()`` from their table (a disagreement), which the
        writing rank writes alone: a replicated model's state is whole on every rank, even where its alarms raised
        before the step are captured by every rank together (a reduction in half precision)."""
        plan = watch.no_capsule
        shape = self._topologies.get(id(watch))
        if plan == TOGETHER and shape is not None and shape.replicated:
            watch.no_capsule = None
        try:
            watch.capsule_for(alarm, optimizer, scaler, watch.history[-1])
        finally:
            watch.no_capsule = plan
        if alarm.no_capsule == TOGETHER:
            alarm.no_capsule = SHARDED_DISAGREEMENT

    def _step_of_last(self) -> int:
        return self._last_step[0].history[-1].step if self._last_step and self._last_step[0].history else -1


def _remove_global_hooks(handles: list[Any]) -> None:
    """Remove global module hooks, and the with-kwargs mark of each: the pinned torch's handle leaves it behind
    (measured), and ``OptimizedModule`` then warns of global hooks on every call after."""
    with_kwargs = getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {})
    for handle in handles:
        handle.remove()
        with_kwargs.pop(handle.id, None)


def _warn(text: str) -> None:
    """Where no one was given to tell: a Python warning."""
    warnings.warn(f"fp16doctor: {text}", RuntimeWarning, stacklevel=2)


def _capsule_plan(shape: Topology) -> str | None:
    """Who writes a capsule of this topology: each alarming rank alone (None) or every rank together
    (:data:`TOGETHER`: an FSDP model's state is spread over the ranks; a DDP reduction in half precision is made
    by all of them)."""
    if shape.sharded or (shape.wrapper == "DistributedDataParallel" and shape.half_reduction):
        return TOGETHER
    return None


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def autocast_dtype() -> str | None:
    """The dtype of the autocast region the current code runs in (``float16``/``bfloat16``), None outside one."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return dtype_name(torch.get_autocast_dtype(device_type))
    return None


def disagree(table: list[RankRow]) -> bool:
    """The ranks disagree on the scale or on the skip."""
    return len({r.scale for r in table}) > 1 or len({r.skipped for r in table}) > 1


def diverged(table: list[RankRow]) -> bool:
    """The ranks' replicated parameters differ (or only some ranks took their checksum)."""
    taken = [row for row in table if row.checksummed > 0]
    return bool(taken) and (len(taken) < len(table) or len({row.checksum for row in taken}) > 1)


def watching_steps() -> bool:
    """Whether ``fp16doctor watch`` already observes this process's optimizer steps (a callback then stands down:
    one check, one capsule and one line per alarm)."""
    return _active is not None and _active.observe_steps


def scaler_decision(scaler: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The scaler's skip decision for this step: its found-inf flags summed over devices (non-zero: skipped).

    Unscales first where the scaler has not yet (``step`` does exactly that first, so nothing changes) and
    reads no value: the flags stay on the device for the watch's one synchronisation. None without an
    enabled scaler that scaled this step."""
    if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
        return None
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    flags = list(state["found_inf_per_device"].values())
    if len(flags) == 1:  # one device: its flag as it is (a stack and a sum cost a healthy step microseconds)
        return flags[0]
    return torch.stack([f.to(flags[0].device).reshape(()) for f in flags]).sum() if flags else None


def _scaler_classes() -> list[type]:
    """GradScaler and FSDP's ShardedGradScaler (which overrides ``scale``), where importable."""
    classes: list[type] = [GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        classes.append(ShardedGradScaler)
    except ImportError:  # pragma: no cover - builds without distributed
        pass
    return classes


def _fsdp2_param_group() -> type | None:
    """FSDP2's ``FSDPParamGroup``, whose ``post_backward`` reduce-scatters a group's gradients, where importable."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # pragma: no cover - builds without distributed, or a torch that moved it
        return None
    return FSDPParamGroup if "post_backward" in vars(FSDPParamGroup) else None


def _observing() -> TrainingObserver | None:
    """The observer, while its watch still measures (after a failure of its own it measures nothing)."""
    observer = _active
    return observer if observer is not None and observer.failure is None else None


def _observed_optimizer_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        observer = _observing()
        if observer is not None:
            with observer.guard("discovery of the optimizer's model"):
                observer.optimizer_created(self)

    return __init__


def _observed_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        observer = _observing()
        if observer is not None:
            with observer.guard("capture of the step's batches"):
                observer.gradients_cleared(self)
        return original(self, *args, **kwargs)

    return zero_grad


_original_backward = torch.Tensor.backward


def _observed_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    observer = _observing()
    if observer is not None:
        with observer.guard("capture of the loss"):
            observer.backward(self)
    return _original_backward(self, *args, **kwargs)


def _observed_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    def scale(self: GradScaler, outputs: Any) -> Any:
        result = original(self, outputs)
        observer = _observing()
        if observer is not None and self.is_enabled():
            with observer.guard("capture of the loss"):
                observer.scaled(result, outputs)
        return result

    return scale


def _observed_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        observer = _observing()
        if observer is None or not self.is_enabled() or observer._in_scaler_step or "closure" in kwargs:
            return original(self, optimizer, *args, **kwargs)
        stage = self._per_optimizer_states[id(optimizer)]["stage"]
        if stage is not OptState.STEPPED:  # else: the scaler's own error
            if stage is OptState.READY:
                self.unscale_(optimizer)  # what step does first, outside the guard: its errors are the script's
            with observer.guard("per-step measurement"):
                observer.scaler_step(self, optimizer)
        observer._in_scaler_step = True
        try:
            return original(self, optimizer, *args, **kwargs)
        finally:
            observer._in_scaler_step = False

    return step


def _observed_scaler_load(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: GradScaler, state_dict: Any) -> Any:
        observer = _observing()
        if observer is not None:
            observer.resumed_scalers.add(self)
        return original(self, state_dict)

    return load_state_dict


def _observed_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update(self: GradScaler, new_scale: Any = None) -> None:
        observer = _active  # also after a failure: the rank meets the others once more, to tell them
        if observer is None or not self.is_enabled() or observer._in_update:
            return original(self, new_scale)
        observer._in_update = True  # a subclass's update calling GradScaler.update agrees once
        try:
            with observer.guard("comparison of the ranks"):
                observer.before_update(self)
            return original(self, new_scale)
        finally:
            observer._in_update = False

    return update


def _observed_destroy(original: Callable[..., Any]) -> Callable[..., Any]:
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        observer = _active
        group = args[0] if args else kwargs.get("group")
        if observer is not None and (group is None or group is dist.GroupMember.WORLD):  # every rank's group
            with observer.guard("last comparison of the ranks"):  # its own failure: said, and the group destroyed
                observer.before_destroy()
        return original(*args, **kwargs)

    return destroy_process_group


def _observed_post_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        observer = _observing()
        if observer is not None:
            observer._own.group_backward(self)  # before the reduce-scatter: the rank's own gradients
        return original(self, *args, **kwargs)

    return post_backward
