"""Runtime fixes and observers the probe applies around the user's code.

Fixes (``config.overrides``) let a diagnosis try a change without editing the
training file; the observers (clip calls) feed the evidence. Each is a small
context or a module wrapper, so the probe composes exactly the ones in force.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterator

import torch
import torch.nn.utils.clip_grad as clip_grad_module

from ..errors import ConfigError
from ..userfile.batches import map_tensors
from .fp32_mode import NeutraliseHalfCasts
from .recording import RecordingGradScaler

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


def autocast_forward(model: torch.nn.Module, autocast: Callable[[], Any]) -> None:
    """Run the model's forward under the probe's autocast (for loops that cast the model to half instead)."""
    forward = model.forward

    @functools.wraps(forward)
    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            return forward(*args, **kwargs)

    model.forward = forward_under_autocast


class LossInFp32(NeutraliseHalfCasts):
    """Outside the model's forward: half casts neutralised and autocast off, so the loss runs in fp32.

    The model's output is cast to fp32 by :meth:`attach`'s forward hook; inside the
    forward the user's code runs untouched.
    """

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.depth = 0

    def attach(self, model: torch.nn.Module) -> list[Any]:
        def enter(module: Any, args: Any) -> None:
            self.depth += 1

        def leave(module: Any, args: Any, output: Any) -> Any:
            self.depth -= 1
            return _to_fp32(output)

        return [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.depth > 0:
            return func(*args, **(kwargs or {}))
        with torch.autocast(self.device_type, enabled=False):
            return super().__torch_function__(func, types_, args, kwargs)


@contextlib.contextmanager
def watch_clipping(scaler: RecordingGradScaler, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                   user_module: types.ModuleType, unscale_first: bool) -> Iterator[None]:
    """Record every clip_grad_norm_/clip_grad_value_ call; with ``unscale_first``, unscale before it.

    Clipping gradients that are still scaled uses a threshold off by the scale
    factor (mixed-precision-notes.md): the record says whether that happened.
    """
    originals = {"clip_grad_norm_": clip_grad_module.clip_grad_norm_, "clip_grad_value_": clip_grad_module.clip_grad_value_}

    def wrap(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def clipped(*args: Any, **kwargs: Any) -> Any:
            trace = scaler.trace
            still_scaled = trace.scaled and not trace.unscaled
            if still_scaled and unscale_first:
                for opt in [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer:
                    scaler.unscale_(opt, _implicit=True)  # the doctor's fix, not a call of the loop's
            trace.clip_calls.append({"function": name, "scaled": still_scaled and not unscale_first, "scale": trace.scale_used})
            return original(*args, **kwargs)

        return clipped

    wrapped = {name: wrap(name, fn) for name, fn in originals.items()}
    targets = [torch.nn.utils, clip_grad_module, user_module]
    saved: list[tuple[Any, str, Any]] = []
    for target in targets:
        for name, original in originals.items():
            for attr, value in list(vars(target).items()):
                if value is original:
                    saved.append((target, attr, value))
                    setattr(target, attr, wrapped[name])
    try:
        yield
    finally:
        for target, attr, value in reversed(saved):
            setattr(target, attr, value)
