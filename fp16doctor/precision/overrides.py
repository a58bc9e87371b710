"""Runtime fixes and observers the probe applies around the user's code.

Fixes (``config.overrides``) let a diagnosis try a change without editing the
training file; the observers (clip calls) feed the evidence. Each is a small
context or a module wrapper, so the probe composes exactly the ones in force.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.utils.clip_grad as clip_grad_module

from ..errors import ConfigError
from ..userfile.batches import map_tensors
from ..userfile.modules import module_names
from .call_sites import SourceLines, calling_frame
from .fp32_mode import NeutraliseHalfCasts
from .recording import RecordingGradScaler, global_grad_norm

LOW = (torch.float16, torch.bfloat16)


def _to_fp32(value: Any) -> Any:
    """Cast low-precision floating tensors (also inside tuples, lists, dicts, ModelOutputs) to fp32."""
    return map_tensors(value, lambda t: t.float() if t.dtype in LOW else t)


def keep_modules_in_fp32(model: torch.nn.Module, paths: list[str], device_type: str) -> None:
    """Run each named submodule with autocast off, on fp32 inputs and fp32 weights."""
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError as exc:
            names = [n for n, _ in model.named_modules() if n][:12]
            raise ConfigError(
                f"overrides.fp32_modules names '{path}', which is not a module of this model.",
                hint="Valid paths include: " + ", ".join(names) + ("..." if len(names) == 12 else "") + ".",
            ) from exc
        module.float()
        forward = module.forward

        @functools.wraps(forward)
        def fp32_forward(*args: Any, __forward: Callable = forward, **kwargs: Any) -> Any:
            with torch.autocast(device_type, enabled=False):
                return __forward(*_to_fp32(args), **_to_fp32(kwargs))

        module.forward = fp32_forward  # instance attribute: Module.__call__ picks it up


class Fp32AtLines(NeutraliseHalfCasts):
    """The torch calls made at the given source lines (``overrides.fp32_lines``) run with autocast off, on fp32
    inputs, and what they ask of low precision (``.half()``, ``dtype=torch.bfloat16``) becomes fp32: the
    operator-level fallback, for code that belongs to no module that could be kept in fp32 alone (the model's
    own forward, ``h * std + mean``) or to a module too large to keep (one line of it).

    A call's line is its call site (:func:`~.call_sites.calling_frame`, as the precision-gap attribution names
    it). An in-place operator keeps its tensor's dtype: it is computed in fp32 and written back. Every other call
    anywhere runs untouched."""

    def __init__(self, lines: list[str], device_type: str) -> None:
        super().__init__()
        self.lines = SourceLines(lines)
        self.device_type = device_type

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.lines.holds(calling_frame(sys._getframe(1))):
            return func(*args, **kwargs)
        with torch.autocast(self.device_type, enabled=False):
            if writes_in_place(func) and args and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW:
                target, work = args[0], args[0].float()
                result = super().__torch_function__(func, types_, (work, *_to_fp32(args[1:])), _to_fp32(kwargs))
                target.copy_(work)  # written back in the tensor's own dtype, as the call would have
                return target if result is work else result
            return super().__torch_function__(func, types_, _to_fp32(args), _to_fp32(kwargs))


def writes_in_place(func: Any) -> bool:
    """An in-place torch call by its name: ``add_``, ``mul_``, ``__iadd__``, ``x[i] = v`` (it changes its first
    argument)."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or (name.startswith("__i") and name.endswith("__")):
        return True
    return name.endswith("_") and not name.endswith("__")


def autocast_forward(model: torch.nn.Module, autocast: Callable[[], Any]) -> None:
    """Run the model's forward under the probe's autocast (for loops that cast the model to half instead)."""
    forward = model.forward

    @functools.wraps(forward)
    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            return forward(*args, **kwargs)

    model.forward = forward_under_autocast


class LossInFp32(NeutraliseHalfCasts):
    """Outside the model's modules: half casts neutralised and autocast off, so the loss runs in fp32.

    "Inside the model" is inside any of its modules' forwards, not only the root's: a GAN's step calls
    ``model.generator`` and ``model.discriminator`` directly, and with only the root hooked its whole step
    would run in fp32 (AMP switched off, not the loss moved to fp32: a repair that proves nothing). A module
    without parameters entered from outside (a criterion kept on the model, ``model.loss_fn``) is the loss's,
    not the model's. A module's output is cast to fp32 where it leaves the outermost forward; inside, the
    user's code runs untouched.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.entered: list[torch.nn.Module] = []
        """The model's modules whose forward is running, outermost first."""

    @property
    def depth(self) -> int:
        return len(self.entered)

    def attach(self, model: torch.nn.Module) -> list[Any]:
        def enter(module: torch.nn.Module, args: Any) -> None:
            if self.entered or _has_parameters(module):
                self.entered.append(module)

        def leave(module: torch.nn.Module, args: Any, output: Any) -> Any:
            # always_call: also when the forward raised; only a module whose own enter ran leaves (a user's
            # pre-hook that raised before it never entered)
            if not self.entered or self.entered[-1] is not module:
                return None
            self.entered.pop()
            return _to_fp32(output) if not self.entered and output is not None else None

        handles: list[Any] = []
        for module in module_names(model):  # no TorchScript module: it refuses hooks
            handles.append(module.register_forward_pre_hook(enter, prepend=True))
            handles.append(module.register_forward_hook(leave, always_call=True))
        return handles

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.entered:
            return func(*args, **(kwargs or {}))
        with torch.autocast(self.device_type, enabled=False):
            return super().__torch_function__(func, types_, args, kwargs)


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


@dataclass(frozen=True)
class ClipObserver:
    """What a probe's steps do with the clip calls they make: record each against the step's trace, and
    with ``unscale_first`` unscale the gradients before clipping (the fix for clipping scaled gradients)."""

    scaler: RecordingGradScaler
    optimizers: tuple[torch.optim.Optimizer, ...]
    """Every optimizer the probe steps: with ``unscale_first`` each is unscaled before the clip."""
    unscale_first: bool

    def clip(self, name: str, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        trace = self.scaler.trace
        still_scaled = trace.scaled and not trace.unscaled
        if still_scaled and self.unscale_first:
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer, _implicit=True)  # the doctor's fix, not a call of the loop's
        trace.clip_calls.append(
            {"function": name, "scaled": still_scaled and not self.unscale_first, "scale": trace.scale_used}
        )
        if not trace.scaled and not trace.unscaled:
            # No scaler records the norm at unscale_ (FP32, bf16): record it here, before the clip, where AMP's
            # canonical loop records it (unscale_, then clip), over the parameters clipped so far this iteration
            # (a GAN clips D, then G); at the optimizer step it would be the clipped norm, and compare's columns
            # set AMP's raw norm beside FP32's clipped one.
            given = args[0] if args else kwargs.get("parameters")
            params = [given] if isinstance(given, torch.Tensor) else list(given or [])
            trace.clipped_params.update({id(p): p for p in params})
            trace.grad_norm = global_grad_norm(trace.clipped_params.values())
            # handed on as the list: a generator (model.parameters()) was consumed above
            args, kwargs = ((params, *args[1:]), kwargs) if args else (args, {**kwargs, "parameters": params})
        return original(*args, **kwargs)


_CLIP_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "clip_grad_norm_": clip_grad_module.clip_grad_norm_,
    "clip_grad_value_": clip_grad_module.clip_grad_value_,
}


class _ClipPatch:
    """The clip functions replaced in ``torch.nn.utils`` and in each user module that imported them by name,
    reference-counted per module and locked: nested and concurrent probes share one patch, and the last to
    leave a module puts its functions back. The observers are kept per thread, so another thread's clip call
    (a trainer's, while a probe steps) reaches the original function unobserved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._patched: dict[int, tuple[int, list[tuple[Any, str, Any]]]] = {}
        self._local = threading.local()
        self._wrapped = {name: self._wrap(name, fn) for name, fn in _CLIP_FUNCTIONS.items()}

    def _observers(self) -> list[ClipObserver]:
        if not hasattr(self._local, "observers"):
            self._local.observers = []
        return self._local.observers

    @property
    def patched_modules(self) -> int:
        return len(self._patched)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def clipped(*args: Any, **kwargs: Any) -> Any:
            observers = self._observers()
            if not observers:
                return original(*args, **kwargs)
            return observers[-1].clip(name, original, args, kwargs)

        return clipped

    def _patch(self, target: types.ModuleType) -> list[tuple[Any, str, Any]]:
        saved = []
        for name, original in _CLIP_FUNCTIONS.items():
            for attr, value in list(vars(target).items()):
                if value is original:
                    saved.append((target, attr, value))
                    setattr(target, attr, self._wrapped[name])
        return saved

    def _acquire(self, targets: list[types.ModuleType]) -> None:
        with self._lock:
            for target in targets:
                count, saved = self._patched.get(id(target), (0, []))
                self._patched[id(target)] = (count + 1, saved if count else self._patch(target))

    def _release(self, targets: list[types.ModuleType]) -> None:
        with self._lock:
            for target in reversed(targets):
                count, saved = self._patched[id(target)]
                if count > 1:
                    self._patched[id(target)] = (count - 1, saved)
                    continue
                del self._patched[id(target)]
                for module, attr, value in reversed(saved):
                    setattr(module, attr, value)

    @contextlib.contextmanager
    def observing(self, observer: ClipObserver, user_module: types.ModuleType) -> Iterator[None]:
        targets = list({id(t): t for t in (torch.nn.utils, clip_grad_module, user_module)}.values())
        self._acquire(targets)
        observers = self._observers()
        observers.append(observer)
        try:
            yield
        finally:
            observers.remove(observer)
            self._release(targets)


_CLIP_PATCH = _ClipPatch()


def watch_clipping(observer: ClipObserver, user_module: types.ModuleType) -> contextlib.AbstractContextManager[None]:
    """Every clip_grad_norm_/clip_grad_value_ call this thread makes inside goes through ``observer``.

    Clipping gradients that are still scaled uses a threshold off by the scale
    factor: the record says whether that happened.
    """
    return _CLIP_PATCH.observing(observer, user_module)
