"""Operator-level precision attribution: which lines of the user's code make a same-state loss gap.

The module-level search (keep a module in fp32, see whether the gap closes) cannot see an error made by operators
that belong to no module it can keep: the model's own forward code (``h * std + mean`` with a mean near -10,000,
which bf16 rounds to multiples of 64), the loss, one line of a module too large to keep. This looks at every
operator instead, on the same weights and batch:

1. **The shadowed AMP pass.** One AMP step with a torch-function mode on: each torch call whose result is in half
   precision is computed again, at once, in fp32 from its actual inputs, upcast (autocast off, the same random
   numbers). The difference is the rounding error that call adds, given what it was handed. A gradient hook on its
   output takes the loss's gradient there in AMP's backward, dotted with the error.
2. **The FP32 pass.** One FP32 step on the same state, the same torch calls in the same program order: each is
   matched to its AMP twin by its line, its module and its output's shape (an op the other pass lacks is skipped
   over, and counted), and a hook dots FP32's gradient with the twin's error.

Each operator's *weighted error* is the mean of the two dot products: the loss change its rounding makes, to first
order in the error with the gradient taken midway (the trapezoid rule, exact for a quadratic loss: a regression's
MSE whose FP32 residual is near 0 has a near-0 FP32 gradient exactly where rounding hurts most, so the first-order
term, FP32's gradient alone, is kept beside it but does not rank). The operators are summed by call site (the
line of the user's code that called them, :mod:`fp16doctor.precision.call_sites`), and each line's sum divided by
AMP's loss minus FP32's is its share of the gap.

The same-state gap is a forward quantity (the loss of one step from the same weights), so the backward's own
rounding does not enter it: the backward is run for its gradients, not attributed. Cost: one AMP step with each
half-precision operator computed twice, and one FP32 step (``benchmarks/attribution_cost.py``).
"""

from __future__ import annotations

import linecache
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..engine.probe import Probe
from ..precision.autocast_policy import CUDA_LOWER
from ..precision.call_sites import calling_frame, in_call_site_code, site_label
from ..precision.fp32_mode import NeutraliseHalfCasts
from ..precision.overrides import writes_in_place
from ..userfile.modules import module_names
from .records import OUTSIDE_MODEL, OperatorAttribution, SiteShare

LOW = (torch.float16, torch.bfloat16)
EXACT = frozenset(
    """
relu neg abs clone contiguous cat concat concatenate stack max min maximum minimum where masked_fill flatten
reshape view view_as permute transpose t squeeze unsqueeze expand expand_as repeat flip roll gather index_select
narrow split chunk unbind getitem select movedim tile detach clamp clip sort topk amax amin sign hardtanh
""".split()
)
"""Torch calls whose result holds exactly values their inputs hold (selections, copies, reshapes): they add no
rounding error, and are not computed again."""
MATCH_WINDOW = 64
"""An FP32 torch call is looked for this far ahead of the next unmatched AMP call, past calls the FP32 pass lacks."""
SITES_KEPT = 8
NO_LINE = "<no line of your code>"
"""The site of calls no frame of the user's code made (the doctor's default loss)."""


def operator_name(func: Any) -> str:
    """``mul`` for ``Tensor.__mul__``, ``add_`` for ``Tensor.add_``, ``linear`` for ``F.linear``."""
    name = getattr(func, "__name__", None) or str(func)
    return name.strip("_") if name.startswith("__") else name


def _floats(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    return []


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.is_floating_point() and value.dtype in LOW else value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    if isinstance(value, dict):
        return {k: _upcast(v) for k, v in value.items()}
    return value


def _has_low(values: Any) -> bool:
    """Whether a half-precision tensor is among ``values`` (or in a list or tuple among them)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype in LOW:
                return True
        elif isinstance(v, (list, tuple)) and _has_low(v):
            return True
    return False


def _views_of_inputs(outputs: list[torch.Tensor], args: tuple) -> bool:
    """Every output is a view of an input (a reshape, a transpose, a slice): it holds the input's values exactly.
    A call that computes and returns a view of its own result (attention's ``out.view(...).transpose(...)``) is no
    such call."""
    inputs = _floats(list(args))
    bases = {id(t) for t in inputs} | {id(t._base) for t in inputs if t._base is not None}
    return all(t._base is not None and id(t._base) in bases for t in outputs)


@dataclass
class _Op:
    """One torch call of a pass with a floating result."""

    name: str
    filename: str | None
    lineno: int | None
    module: str
    """Whose code the line is: the innermost running module whose forward is not PyTorch's own, else the loss."""
    running: str
    shapes: tuple[tuple[int, ...], ...]
    errors: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(output index, the rounding error it added, fp32) for each half-precision output with a non-zero error."""
    amp_dots: list[torch.Tensor] = field(default_factory=list)
    fp32_dots: list[torch.Tensor] = field(default_factory=list)
    matched: bool = False

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.filename, self.lineno, self.running, self.shapes)


class _Recorder(TorchFunctionMode):
    """The torch calls of one probe step's forward (and loss), recorded in order; in the AMP pass (``shadow``) each
    half-precision result is computed again in fp32 and its error kept, in the FP32 pass (``twins``: the AMP pass's
    calls) each call is matched to its AMP twin. Either way a gradient hook dots the loss's gradient with the
    error."""

    def __init__(self, probe: Probe, twins: list[_Op] | None = None) -> None:
        super().__init__()
        self.shadow = twins is None
        self.twins = twins or []
        self.next_twin = 0
        self.ops: list[_Op] = []
        self.device = probe.device
        self.names = module_names(probe.model)
        self.stack: list[str] = []
        """The modules whose forward is running, outermost first."""
        self.coded: list[str] = [OUTSIDE_MODEL]
        """For each depth of ``stack``: the innermost running module whose forward is code outside PyTorch (the
        user's or a library's), whose lines the torch calls there are; the loss outside every module."""
        self.in_optimizer = False
        self._neutral = NeutraliseHalfCasts()
        self._functions: dict[Any, tuple[str, bool, bool]] = {}
        self._handles: list[Any] = []
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        for optimizer in probe.optimizers.all():
            self._handles.append(optimizer.register_step_pre_hook(lambda *_: setattr(self, "in_optimizer", True)))
            self._handles.append(optimizer.register_step_post_hook(lambda *_: setattr(self, "in_optimizer", False)))

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self.names[module])
        self.coded.append(self.names[module] if _has_own_code(type(module)) else self.coded[-1])

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()
            self.coded.pop()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.in_optimizer or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            # the optimizer's update, a custom backward and what no gradient reaches are no part of the loss
            return func(*args, **kwargs)
        name, exact, in_place = self._described(func)
        shadowed = self.shadow and not exact and "out" not in kwargs
        before = None
        if shadowed and in_place and args and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW:
            before = args[0].detach().float()  # what the in-place call read, before it wrote over it
        rng = self._rng_state() if shadowed and (_has_low(args) or _has_low(kwargs.values())) else None
        out = func(*args, **kwargs)
        outputs = _floats(out)
        if not any(t.requires_grad for t in outputs):
            return out  # no gradient reaches it (the gradients' own norms after the backward): it weighs nothing
        op = self._op(name, outputs, sys._getframe(1))
        if shadowed and any(t.dtype in LOW for t in outputs) and (in_place or not _views_of_inputs(outputs, args)):
            self._shadow(op, func, types_, args, kwargs, outputs, before, rng)
        if self.shadow:
            self._hook(op, outputs, op.amp_dots, dict(op.errors))
        else:
            twin = self._match(op)
            if twin is not None and twin.errors:
                self._hook(op, outputs, twin.fp32_dots, dict(twin.errors))
        self.ops.append(op)
        return out

    def _described(self, func: Any) -> tuple[str, bool, bool]:
        """(its name, whether it adds no rounding error, whether it writes its first argument), once per function."""
        try:
            return self._functions[func]
        except (KeyError, TypeError):
            name = operator_name(func)
            described = (name, name.rstrip("_") in EXACT, writes_in_place(func))
            try:
                self._functions[func] = described
            except TypeError:  # an unhashable callable: described again at each call
                pass
            return described

    def _op(self, name: str, outputs: list[torch.Tensor], start: types.FrameType) -> _Op:
        frame = calling_frame(start)
        return _Op(
            name=name,
            filename=frame.f_code.co_filename if frame is not None else None,
            lineno=frame.f_lineno if frame is not None else None,
            module=self.coded[-1],  # the call site is in its code: a module of PyTorch's own has no line of its own
            running=self.stack[-1] if self.stack else OUTSIDE_MODEL,
            shapes=tuple(tuple(t.shape) for t in outputs),
        )

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def _shadow(
        self,
        op: _Op,
        func: Any,
        types_: Any,
        args: tuple,
        kwargs: dict,
        outputs: list[torch.Tensor],
        before: torch.Tensor | None,
        rng: tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> None:
        """The call again in fp32 from its inputs, upcast, with the random numbers it drew: its outputs' errors."""
        after = self._rng_state() if rng is not None else None
        inputs = _upcast(args)
        if before is not None:
            inputs = (before, *inputs[1:])
        try:
            if rng is not None:
                self._set_rng_state(rng)
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                reference = _floats(self._neutral.__torch_function__(func, types_, inputs, _upcast(kwargs)))
        except Exception:  # noqa: BLE001 - a call that will not run in fp32 adds no measurable error: it is skipped
            return
        finally:
            if after is not None:
                self._set_rng_state(after)
        for index, (made, exact) in enumerate(zip(outputs, reference)):
            if made.dtype not in LOW or made.shape != exact.shape:
                continue
            error = made.detach().float() - exact.float()
            if bool(error.ne(0).any()):
                op.errors.append((index, error))

    def _hook(
        self, op: _Op, outputs: list[torch.Tensor], into: list[torch.Tensor], errors: dict[int, torch.Tensor]
    ) -> None:
        for index, error in errors.items():
            t = outputs[index] if index < len(outputs) else None
            if t is not None and t.requires_grad and t.shape == error.shape:

                def dot(grad: torch.Tensor, error: torch.Tensor = error) -> None:
                    into.append(torch.dot(grad.detach().reshape(-1).double(), error.reshape(-1).double()))

                t.register_hook(dot)

    def _match(self, op: _Op) -> _Op | None:
        """The AMP call this FP32 call is the twin of: the next unmatched one with the same key, looked for a few
        calls ahead (the AMP calls passed over stay unmatched, and are counted as such)."""
        end = min(self.next_twin + MATCH_WINDOW, len(self.twins))
        for index in range(self.next_twin, end):
            if self.twins[index].key == op.key:
                self.next_twin = index + 1
                self.twins[index].matched = op.matched = True
                return self.twins[index]
        return None


def _has_own_code(cls: type) -> bool:
    """Whether a module class's forward is code outside PyTorch (``nn.Linear``'s is PyTorch's: the torch calls it
    makes are the line's that called the module)."""
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and in_call_site_code(code.co_filename)


def _step(probe: Probe, twins: list[_Op] | None) -> tuple[_Recorder, float, float]:
    """One step of ``probe`` recorded: the recorder, the step's loss, and the loss scale its backward ran at."""
    recorder = _Recorder(probe, twins)
    try:
        with recorder:
            record = probe.step()
    finally:
        recorder.remove_hooks()
    trace = record.trace
    scale = float(trace.scale_used) if trace is not None and trace.scaled else 1.0
    return recorder, float(record.loss), scale


def attribute_operators(make_probe: Callable[[str], Probe], base: Path | None = None) -> OperatorAttribution:
    """The lines of the user's code ranked by their share of the same-state gap (see the module docstring).
    ``make_probe(mode)``: a probe of ``amp`` or ``fp32`` about to take the step on the state compared (made one at
    a time, each closed before the next); ``base``: the folder the sites are named from (the training file's)."""
    probe = make_probe("amp")
    try:
        amp, loss_amp, scale = _step(probe, None)
    finally:
        probe.close()
    del probe
    probe = make_probe("fp32")
    try:
        _, loss_fp32, _ = _step(probe, amp.ops)
    finally:
        probe.close()
    del probe
    shadowed = [op for op in amp.ops if op.errors]
    sites = _sites(shadowed, scale, loss_amp - loss_fp32, base)
    for op in shadowed:
        op.errors.clear()  # the errors are as large as the activations: let them go now
    return OperatorAttribution(
        loss_amp=loss_amp,
        loss_fp32=loss_fp32,
        explained=sum(s.share for s in sites.values()),
        operators=len(shadowed),
        unmatched=sum(1 for op in shadowed if not op.matched),
        sites=sorted(sites.values(), key=lambda s: s.share, reverse=True)[:SITES_KEPT],
    )


def _weights(op: _Op, scale: float) -> tuple[float | None, float | None]:
    """(the mean of AMP's and FP32's weighted errors where each is known, FP32's alone) of one operator."""
    amp = float(sum(float(d) for d in op.amp_dots)) / scale if op.amp_dots else None
    fp32 = float(sum(float(d) for d in op.fp32_dots)) if op.fp32_dots else None
    ends = [w for w in (amp, fp32) if w is not None and math.isfinite(w)]
    return (sum(ends) / len(ends) if ends else None), (fp32 if fp32 is not None and math.isfinite(fp32) else None)


def _sites(ops: list[_Op], scale: float, gap: float, base: Path | None) -> dict[tuple[Any, Any], SiteShare]:
    sites: dict[tuple[Any, Any], SiteShare] = {}
    for op in ops:
        weighted, first = _weights(op, scale)
        if weighted is None:
            continue  # its output leads to no gradient: it does not reach the loss
        key = (op.filename, op.lineno)
        known = sites.get(key)
        if known is None:
            label = site_label(op.filename, op.lineno, base) if op.filename and op.lineno else NO_LINE
            code = linecache.getline(op.filename, op.lineno).strip() if op.filename and op.lineno else ""
            known = SiteShare(label, op.module, [], 0.0, 0.0, [], 0.0, None, code or None)
        own = op.running == op.module
        total = known.weighted_error + weighted
        sites[key] = replace(
            known,
            operators=known.operators if op.name in known.operators else [*known.operators, op.name],
            share=total / gap if gap else 0.0,
            own_share=known.own_share + (weighted / gap if own and gap else 0.0),
            inside=known.inside if own or op.running in known.inside else [*known.inside, op.running],
            weighted_error=total,
            first_order=(known.first_order or 0.0) + first if first is not None else known.first_order,
            lower_precision=known.lower_precision or op.name.rstrip("_") in CUDA_LOWER,
        )
    return sites
