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
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..engine.ddp import half_precision_comm_hooks
from ..tensors import dtype_name
from ..userfile.batches import iter_tensors
from ..userfile.modules import unwrapped
from .stepstate import StepStartKeeper
from .watch import Alarm, Watch, WatchOptions

OUTPUT_GRAD_LIMIT = 1 << 24
"""Output elements above which a micro-batch's output gradient is held only once a skip has armed the capture
(an LM's logits, batch x sequence x vocabulary, are too large to hold on every step)."""

_PATCH_LOCK = threading.Lock()
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

    def fed_no_loss(self) -> bool:
        return self.hooked and all(g is None for g in self.grads)

    def backward_done(self) -> bool:
        """Gradients reached its outputs: the backward of the loss it fed has run."""
        return any(g is not None for g in self.grads)


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
        self.on_note = on_note or (lambda text: None)
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
        self._calls: list[ModelCall] = []
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
            self._handles = [register_optimizer_step_pre_hook(self._optimizer_pre_step)]
            self._handles += [m.register_forward_hook(self._model_forward, with_kwargs=True) for m in self._models]
            self._handles += [m.register_forward_pre_hook(self._model_pre_forward) for m in self._models]
            self._discover(bool(self._unmatched) or not self._models)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        with _PATCH_LOCK:
            for handle in self._handles + self._module_hooks:
                handle.remove()
            self._handles, self._module_hooks = [], []
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

    def take_losses(self) -> list[torch.Tensor]:
        """The losses backward ran on since the last call (references), for a callback's own check."""
        losses, self._losses = self._losses, []
        return losses

    # --- the model's forward ----------------------------------------------------------------------------
    def _discover(self, on: bool) -> None:
        """Global module hooks on (looking for the outermost modules the training runs) or off (every model found)."""
        if on and not self._module_hooks:
            self._depth = 0
            self._module_hooks = [
                torch.nn.modules.module.register_module_forward_pre_hook(self._global_pre_forward),
                torch.nn.modules.module.register_module_forward_hook(
                    self._global_forward, with_kwargs=True, always_call=True
                ),
            ]
        elif not on:
            for handle in self._module_hooks:
                handle.remove()
            self._module_hooks = []

    def _global_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0 and not any(unwrapped(module) is m for m in self._models):  # a found model's own hook
            self._model_pre_forward(module, args)
        self._depth += 1

    def _model_pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A forward of an outermost module is about to run: at its step's first training forward, keep the state
        it may write to (a memory module's buffers, a cache, running statistics) as it is now."""
        if not (module.training and torch.is_grad_enabled()) or next(module.parameters(), None) is None:
            return
        model = unwrapped(module)
        self._step_states.setdefault(id(model), StepStartKeeper()).begin(model)

    def _global_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth != 0:
            return
        if not any(module is m for m in self._roots) and any(True for _ in module.parameters()):
            self._roots.append(module)
        if not any(unwrapped(module) is m for m in self._models):  # a found model's own hook records it
            self._model_forward(module, args, kwargs, output)

    def _model_forward(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A training forward of the model: hold its inputs, hook the gradients reaching its outputs."""
        if not (module.training and torch.is_grad_enabled()):
            return
        self._autocast_dtype = self._autocast_dtype or autocast_dtype()
        call = ModelCall(unwrapped(module), {"args": tuple(args), "kwargs": dict(kwargs or {})})
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

    def _adopt(self, model: torch.nn.Module) -> None:
        """Found the model: hook it alone (the global module hooks go once no optimizer waits for its model)."""
        self._models.append(model)
        self._handles.append(model.register_forward_hook(self._model_forward, with_kwargs=True))
        self._handles.append(model.register_forward_pre_hook(self._model_pre_forward))

    # --- the optimizer step ------------------------------------------------------------------------------
    def scaler_step(self, scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """Inside ``scaler.step(optimizer)``, before the original: unscale (as step does first), then check."""
        self.check(optimizer, scaler, scaler_decision(scaler, optimizer))

    def _optimizer_pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_scaler_step:
            self.check(optimizer, None, None)

    def check(
        self, optimizer: torch.optim.Optimizer, scaler: GradScaler | None, found_inf: torch.Tensor | None
    ) -> None:
        """Check one optimizer step (one host sync); on an alarm tell ``on_alarm`` and stop unless told to keep going."""
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
        if _world_size() > 1:  # held until update() has agreed across ranks
            self._last_step = (watch, optimizer, calls, self._losses)
        self._losses = []
        watch.scaler_resumed = scaler is not None and scaler in self.resumed_scalers
        alarm = watch.before_optimizer_step(step, optimizer, scaler, grads_scaled=False, found_inf=found_inf)
        if alarm is None:
            return
        self.alarms.append(alarm)
        self.on_alarm(alarm)
        if not self.options.stop_on_alarm:
            return
        if scaler is not None and _world_size() > 1:
            self._pending_stop = alarm  # every rank stops together in update(), which all of them reach
            return
        raise WatchStopped(alarm)

    def _watch_for(self, optimizer: torch.optim.Optimizer) -> Watch:
        key = id(optimizer)
        if key not in self.watches:
            watch = Watch(
                self._model_of(optimizer), self.options, framework="script", dtype=self.dtype or self._autocast_dtype
            )
            watch.rank = self.rank
            watch.step_state = self._step_states.setdefault(id(watch.model), StepStartKeeper())
            self.watches[key] = watch
        return self.watches[key]

    def _model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The outermost module seen in training holding most of the optimizer's parameters (DDP and
        ``torch.compile`` unwrapped: the module the capsule rebuilds)."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        scored = [(sum(1 for p in m.parameters() if id(p) in stepped), m) for m in self._roots]
        count, outer = max(scored, key=lambda s: s[0], default=(0, None))
        if outer is None or count == 0:
            holder = torch.nn.Module()
            holder.params = torch.nn.ParameterList([p for g in optimizer.param_groups for p in g["params"]])
            return holder
        model = unwrapped(outer)
        if model not in self._models:
            self._adopt(model)
            half = half_precision_comm_hooks(outer)
            if half:
                self.on_note(
                    f"DDP gradients are all-reduced in half precision ({', '.join(half)}): "
                    "remove the compression hook to reduce them in fp32 (cause ddp-half-allreduce)"
                )
        return model

    # --- under torchrun ---------------------------------------------------------------------------------
    def before_update(self, scaler: GradScaler) -> None:
        """Inside ``scaler.update()``, which every rank reaches (also a rank whose step was skipped): agree.

        One all-gather of (scale, skipped, alarmed) per step. Ranks that disagree on the scale or on a skip
        are an alarm of their own; an alarm on any rank stops every rank here, so that none is left waiting
        in a collective the alarming rank never reaches."""
        world = _world_size()
        if world < 2 or scaler._scale is None:
            return
        import torch.distributed as dist

        device = scaler._scale.device
        flags = [
            f.to(device).reshape(())
            for state in scaler._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        skipped = (torch.stack(flags).sum() > 0).float() if flags else torch.zeros((), device=device)
        mine = torch.stack(
            [
                scaler._scale.reshape(()).float(),
                skipped,
                torch.tensor(float(self._pending_stop is not None), device=device),
            ]
        )
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).tolist()  # one transfer
        if len({r[0] for r in table}) > 1 or len({r[1] for r in table}) > 1:
            self._disagreement(table, scaler)
        alarmed = [rank for rank, r in enumerate(table) if r[2]] or ([self.rank or 0] if self._pending_stop else [])
        step = self._step_of_last()
        self._last_step = None
        if alarmed and self.options.stop_on_alarm:
            alarm = self._pending_stop or Alarm("stopped", step, f"rank {', '.join(map(str, alarmed))} raised an alarm")
            if self._pending_stop is None:
                self.on_alarm(alarm)
            raise WatchStopped(alarm)

    def _disagreement(self, table: list[list[float]], scaler: GradScaler) -> None:
        """Ranks disagree: the skipping ranks (rank 0 where only the scale differs) write a capsule."""
        said = ", ".join(
            f"rank {r}: scale {row[0]:g}, {'skipped' if row[1] else 'stepped'}" for r, row in enumerate(table)
        )
        writers = [r for r, row in enumerate(table) if row[1]] if len({row[1] for row in table}) > 1 else [0]
        alarm = Alarm("rank-disagreement", self._step_of_last(), f"the ranks disagree ({said})")
        if self._last_step is not None and self.rank in writers and "rank-disagreement" in self.options.alarms:
            watch, optimizer, calls, losses = self._last_step
            for call in calls:
                watch.capture_batch(call.batch)
                watch.record_output_grads(call.grads, call.scaled)
            for loss in losses:
                watch.record_loss(loss)
            if watch.alarm is None:
                watch.alarm = alarm
            alarm.capsule = watch.write_capsule(optimizer, scaler, watch.history[-1])
            watch.forget_step()
        if "rank-disagreement" in self.options.alarms:
            self.alarms.append(alarm)
            self.on_alarm(alarm)
            if self._pending_stop is None:
                self._pending_stop = alarm

    def _step_of_last(self) -> int:
        return self._last_step[0].history[-1].step if self._last_step and self._last_step[0].history else -1


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def autocast_dtype() -> str | None:
    """The dtype of the autocast region the current code runs in (``float16``/``bfloat16``), None outside one."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return dtype_name(torch.get_autocast_dtype(device_type))
    return None


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


def _observed_optimizer_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if _active is not None:
            _active.optimizer_created(self)

    return __init__


def _observed_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _active is not None:
            _active.gradients_cleared(self)
        return original(self, *args, **kwargs)

    return zero_grad


_original_backward = torch.Tensor.backward


def _observed_backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if _active is not None:
        _active.backward(self)
    return _original_backward(self, *args, **kwargs)


def _observed_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    def scale(self: GradScaler, outputs: Any) -> Any:
        result = original(self, outputs)
        if _active is not None and self.is_enabled():
            _active.scaled(result, outputs)
        return result

    return scale


def _observed_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(self: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        observer = _active
        if observer is None or not self.is_enabled() or observer._in_scaler_step or "closure" in kwargs:
            return original(self, optimizer, *args, **kwargs)
        if self._per_optimizer_states[id(optimizer)]["stage"] is not OptState.STEPPED:  # else: the scaler's own error
            observer.scaler_step(self, optimizer)
        observer._in_scaler_step = True
        try:
            return original(self, optimizer, *args, **kwargs)
        finally:
            observer._in_scaler_step = False

    return step


def _observed_scaler_load(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: GradScaler, state_dict: Any) -> Any:
        observer = _active
        if observer is not None:
            observer.resumed_scalers.add(self)
        return original(self, state_dict)

    return load_state_dict


def _observed_update(original: Callable[..., Any]) -> Callable[..., Any]:
    def update(self: GradScaler, new_scale: Any = None) -> None:
        observer = _active
        if observer is None or not self.is_enabled() or observer._in_update:
            return original(self, new_scale)
        observer._in_update = True  # a subclass's update calling GradScaler.update agrees once
        try:
            observer.before_update(self)
            return original(self, new_scale)
        finally:
            observer._in_update = False

    return update
