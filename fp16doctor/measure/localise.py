"""Localisation: which module and which operator first produced a non-finite value.

Monitoring stays cheap (the instruments). When a probe meets its first
non-finite step, that step is replayed (probes are deterministic: a fresh
probe of the same mode is run to the step before, or restored from a
snapshot) with a per-operator tracer on: a ``TorchDispatchMode`` that checks
every aten op's inputs and outputs. The first op whose output is non-finite
while all its floating inputs are finite is the culprit; it is attributed to
the innermost module running at that moment (forward), to the module whose
output gradient was last produced (backward), to the loss (forward ops outside
the model) or to the optimizer.

On CPU the emulated low-precision GEMM computes in fp32 and rounds the result
to fp16; an overflow then shows up at the rounding cast. The tracer blames
the op that produced the cast's input (e.g. ``aten::mm``), as a GPU would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import traceback
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine.emulated_ranks import reducing
from ..engine.kept import StateKeeper
from ..engine.probe import Probe, ProbeSnapshot, Workbench
from ..tensors import FP16_MAX
from ..userfile.modules import module_names
from .records import OUTSIDE_MODEL, FlushedConstant, Localisation  # re-exported: the record types' old home

CASTS = {"aten::_to_copy", "aten::to", "aten::copy_", "aten::_to_dtype"}
RESHAPES = {
    "aten::_unsafe_view",
    "aten::view",
    "aten::reshape",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::squeeze",
    "aten::unsqueeze",
    "aten::alias",
    "aten::contiguous",
    "aten::clone",
}
"""Ops that move values without computing: they pass their input's producer on."""
CONSTANT_MAKERS = {
    "aten::full",
    "aten::full_like",
    "aten::new_full",
    "aten::fill_",
    "aten::fill",
    "aten::scalar_tensor",
    "aten::lift_fresh",
    "aten::lift_fresh_copy",
    "aten::masked_fill",
    "aten::masked_fill_",
    "aten::where",
    "aten::add",
    "aten::add_",
    "aten::sub",
    "aten::sub_",
    "aten::rsub",
    "aten::mul",
    "aten::mul_",
    "aten::div",
    "aten::div_",
    "aten::neg",
    "aten::clamp",
    "aten::clamp_min",
    "aten::clamp_max",
    "aten::maximum",
    "aten::minimum",
    "aten::cat",
    "aten::stack",
    "aten::tril",
    "aten::triu",
    "aten::repeat",
    "aten::index_select",
    "aten::gather",
    "aten::index",
    "aten::copy",
    "aten::roll",
    "aten::flip",
    "aten::expand_copy",
}
"""Ops whose output carries a constant beyond fp16's range when they were given one (a Python number or a tensor
that carries one): fills, selections and arithmetic. Every other op computes: its output is an activation, however
few distinct values it holds (``exp(1/tau)`` on a cosine attention's diagonal is one value, 4.9e8)."""
LIFTS = {"aten::lift_fresh", "aten::lift_fresh_copy"}
"""``torch.tensor(-1e9)``: a constant made outside the dispatcher, lifted into the step."""
UNINITIALISED = {"aten::empty_like", "aten::empty", "aten::new_empty", "aten::empty_strided", "aten::new_empty_strided"}
"""Ops whose output is uninitialised memory (garbage may be NaN): never a culprit."""


def _floats(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out.extend(_floats(v))
    elif isinstance(value, dict):
        for v in value.values():
            out.extend(_floats(v))
    return out


def _finite(t: torch.Tensor) -> bool:
    return all(math.isfinite(end) for end in _range(t))


def _range(t: torch.Tensor) -> tuple[float, float]:
    """``t``'s exact ``(min, max)`` (NaN in both where it holds one), read in its own dtype: no temporary copy (a
    float64 copy of every traced op's inputs, four times an fp16 activation's size, put the localisation stage
    20 MB above the AMP probe on a small transformer)."""
    if t.numel() == 0:
        return (0.0, 0.0)
    lo, hi = torch.aminmax(t.detach())
    return (float(lo), float(hi))


SPREAD_CAP = 64
"""Distinct values beyond fp16's range are counted up to this many: a constant fill shows one or two, an
activation that grew past 65504 (an ``exp`` of large scores) shows many."""


def _spread(t: torch.Tensor, value_range: tuple[float, float]) -> int:
    """How many distinct values beyond fp16's range ``t`` holds, told apart at about three significant digits
    (0 when none; counted up to ``SPREAD_CAP``): -1e9 plus scores of a few hundred is one value (fp32 rounds
    most of them away), an ``exp`` that grew past 65504 many. Computed only for a tensor whose range already
    passes 65504, so the tracer's cost stays where it was."""
    if max(abs(value_range[0]), abs(value_range[1])) < FP16_MAX or not t.is_floating_point() or t.is_complex():
        return 0
    flat = t.detach().reshape(-1)
    wide = flat[torch.isfinite(flat) & (flat.abs() >= FP16_MAX)][: SPREAD_CAP * 1024].double()
    bins = torch.round(torch.log10(wide.abs()) * 1000) * torch.sign(wide)  # 0.23% wide, signed
    return min(int(torch.unique(bins).numel()), SPREAD_CAP)


def _described(inputs: list[torch.Tensor]) -> tuple[list[tuple[float, float]], list[int]]:
    """Each input's range and its spread beyond fp16's range."""
    ranges = [_range(t) for t in inputs]
    return ranges, [_spread(t, r) for t, r in zip(inputs, ranges)]


OVERWRITES = {
    "aten::copy_",
    "aten::fill_",
    "aten::zero_",
    "aten::normal_",
    "aten::uniform_",
    "aten::bernoulli_",
    "aten::random_",
    "aten::exponential_",
}
"""In-place ops that overwrite their first argument without reading it: its old values are no input."""


def _first_bad_element(name: str, args: tuple, written: list[torch.Tensor]) -> int | None:
    """For a foreach op over lists of tensors (one per parameter), the index of the first tensor it left
    non-finite; None for any other op."""
    if not name.startswith("aten::_foreach") or not args or not isinstance(args[0], (list, tuple)):
        return None
    return next((i for i, t in enumerate(written) if not _finite(t)), None)


def _elements(args: tuple | list, index: int) -> list[torch.Tensor]:
    """Element ``index`` of every list argument (the operands of that tensor's update), and tensor arguments."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, (list, tuple)) and len(a) > index and isinstance(a[index], torch.Tensor):
            out += _floats(a[index])
        elif isinstance(a, torch.Tensor):
            out += _floats(a)
    return out


def _writes_first_argument(func: Any) -> bool:
    """Whether the op overwrites its first argument (``add_``, ``copy_``, ``_foreach_addcdiv_``): its schema
    marks that argument as written."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _nonfinite_field(batch: Any) -> tuple[str, torch.Tensor] | None:
    from ..userfile.batches import iter_tensors

    for name, tensor in iter_tensors(batch):
        if tensor.is_floating_point() and not _finite(tensor):
            return name, tensor
    return None


def _scalars(args: tuple, kwargs: dict) -> list[float]:
    """The Python numbers among an op's arguments (not bools, not sizes of 0 or 1)."""
    values = [a for a in list(args) + list(kwargs.values()) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return [float(v) for v in values if abs(v) > 1]


LOW_PRECISION = (torch.float16, torch.bfloat16)
OUTSIDE_CODE = (str(Path(torch.__file__).resolve().parent) + os.sep, str(Path(__file__).resolve().parents[1]) + os.sep)
"""PyTorch's and the doctor's own folders: the frames under every op, never the code that wrote a constant."""


def _unheld_constant(args: tuple, kwargs: dict, outputs: list[torch.Tensor]) -> tuple[float, float, torch.dtype] | None:
    """A Python float argument, not 0, that is 0 in the op's low-precision output dtype (``clamp(min=1e-10)`` of an
    fp16 tensor: its bound is 0 there), with what it is there. Constants past the dtype's largest value are the
    constant-carrying records' (``_Made.carries_constant``)."""
    dtypes = {t.dtype for t in outputs if t.dtype in LOW_PRECISION}
    for v in (a for a in list(args) + list(kwargs.values()) if isinstance(a, float)):
        if v == 0.0 or not abs(v) < 1e-4:
            continue  # every low-precision dtype holds it: the tracer's hot path checks no further
        for dtype in dtypes:
            held = float(torch.tensor(v, dtype=dtype))
            if held == 0.0:
                return v, held, dtype
    return None


def _calling_line(user_path: Path | None) -> str | None:
    """``file:line`` of the code that called the running op: the training file's deepest frame, else the deepest
    frame outside PyTorch and the doctor (a helper module, a library's model)."""
    frames = [f for f in traceback.extract_stack() if not str(Path(f.filename).resolve()).startswith(OUTSIDE_CODE)]
    if user_path is not None:
        target = str(user_path.resolve())
        own = [f for f in frames if str(Path(f.filename).resolve()) == target]
        if own:
            return f"{user_path}:{own[-1].lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _asks_for_nonfinite(args: tuple, kwargs: dict) -> bool:
    """A non-finite scalar argument: the op writes inf/NaN because it was told to (attention masks)."""
    scalars = [a for a in list(args) + list(kwargs.values()) if isinstance(a, float)]
    return any(not math.isfinite(a) for a in scalars)


def _describe_bad(t: torch.Tensor) -> str:
    kinds = []
    if torch.isnan(t).any():
        kinds.append("nan")
    if (t == math.inf).any():
        kinds.append("+inf")
    if (t == -math.inf).any():
        kinds.append("-inf")
    return "/".join(kinds) + f" ({str(t.dtype).replace('torch.', '')})"


@dataclass(frozen=True)
class _Made:
    """How a tensor the traced step made was made: its operator, that operator's inputs (ranges, spreads beyond
    fp16's range, origins) and Python numbers, and whether the tensor carries a constant beyond fp16's range."""

    tensor: weakref.ref
    operator: str
    ranges: list[tuple[float, float]]
    scalars: list[float]
    spreads: list[int]
    origins: list[bool | None]
    carries_constant: bool


@dataclass
class _Context:
    stack: list[str] = field(default_factory=list)
    backward_module: str | None = None
    in_optimizer: bool = False


class NonFiniteTracer(TorchDispatchMode):
    """Checks every aten op for the first one that turns finite inputs into non-finite outputs.

    Models make infinities on purpose and clean them up (T5's relative-position buckets take log(0) and
    then cast to integers; masks fill -inf): a forward op that makes inf/NaN is only a candidate, and its
    non-finite values are followed through the ops that carry them on. The culprit is the first candidate
    whose values reach a module's output; in backward, the optimizer and the loss, the first candidate.
    """

    def __init__(
        self,
        context: _Context,
        parameters: dict[int, tuple[torch.nn.Parameter, str]] | None = None,
        user_path: Path | None = None,
    ):
        super().__init__()
        self.context = context
        self.user_path = user_path
        self.parameters = parameters or {}
        """The model's parameters by id, with their names: a cast of one that overflows is a weight fp16 cannot hold."""
        self.candidates: list[dict[str, Any]] = []
        self.confirmed: int | None = None
        self._taint: dict[int, tuple[weakref.ref, int]] = {}
        self._producers: dict[int, _Made] = {}
        """Who made each tensor, by id: what a rounding cast of it reports as the culprit."""
        self._unheld: dict[int, tuple[weakref.ref, FlushedConstant]] = {}
        """Tensors made by an op given a Python number their dtype cannot hold, by id (through casts and views)."""

    @property
    def found(self) -> dict[str, Any] | None:
        """The culprit: the first confirmed candidate, else the first candidate."""
        if self.confirmed is not None:
            return self.candidates[self.confirmed]
        return self.candidates[0] if self.candidates else None

    def confirm(self, tensors: list[torch.Tensor]) -> None:
        """A module's output: non-finite values that came from a candidate make that candidate the culprit."""
        if self.confirmed is not None:
            return
        for t in tensors:
            source = self._source_of(t)
            if source is not None and not _finite(t):
                self.confirmed = source
                return

    def _source_of(self, t: torch.Tensor) -> int | None:
        entry = self._taint.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _mark(self, outputs: list[torch.Tensor], source: int) -> None:
        for t in outputs:
            if not _finite(t):
                self._taint[id(t)] = (weakref.ref(t), source)
                base = t._base  # a write into a view (buf[0].copy_(x)) taints the tensor it views too
                if base is not None and id(base) not in self._taint:
                    self._taint[id(base)] = (weakref.ref(base), source)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.confirmed is not None:
            return func(*args, **kwargs)
        name = func._schema.name if hasattr(func, "_schema") else str(func)
        # An in-place op (the optimizer's foreach updates, add_, relu_) overwrites its first argument, and the
        # foreach ones return nothing: its values before the op are read first, what it wrote after. An op
        # that overwrites without reading (copy_, fill_) has no "before" to read: garbage there is no input.
        written = _floats(args[0]) if args and _writes_first_argument(func) else []
        before = _described(written) if written and name not in OVERWRITES else ([], [])
        out = func(*args, **kwargs)
        inputs = _floats(args) + _floats(kwargs)
        outputs = _floats(out) or written
        if not outputs:
            return out
        overwritten = {id(t) for t in written}
        read = [t for t in inputs if id(t) not in overwritten]  # the inputs as they were: the rest, unchanged
        prior = written if before[0] else []  # the written tensors whose earlier values the op read
        bad = next((t for t in outputs if not _finite(t)), None)
        if bad is None:
            self._note_unheld(func, name, [*prior, *read], outputs, args, kwargs)
            self._remember(func, name, prior, read, outputs, args, kwargs, before)
            return out
        sources = [s for s in (self._source_of(t) for t in [*prior, *read]) if s is not None]
        if sources:
            self._mark(outputs, min(sources))  # an earlier candidate's values, carried on
            return out
        if name in UNINITIALISED or not inputs or _asks_for_nonfinite(args, kwargs):
            return out  # factories (uninitialised memory), or an infinity on purpose: masked_fill(mask, -inf)
        index = _first_bad_element(name, args, written)
        if index is not None:  # a foreach op over every parameter: the one tensor that went bad, and its operands
            prior = [written[index]] if prior else []
            before = ([before[0][index]], [before[1][index]]) if before[0] else ([], [])
            read = _elements(args[1:], index) + _floats(kwargs)
        read_ranges, read_spreads = _described(read)
        ranges, spreads = before[0] + read_ranges, before[1] + read_spreads
        scalars = _scalars(args, kwargs)
        origins = [self._carries_constant(t) for t in [*prior, *read]]
        operator, note, peak, parameter = name, "", None, None
        if index is not None:
            known = self.parameters.get(id(written[index]))
            parameter = known[1] if known is not None and known[0] is written[index] else None
            note = f"tensor {index} of its list" + (f", the parameter '{parameter}'" if parameter else "")
        if not all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in ranges):
            # Infinite inputs (an attention mask's -inf) are legitimate until an op turns them into NaN:
            # inf - inf, 0 * inf, a softmax over a row that is -inf everywhere.
            if not (torch.isnan(bad).any() and not any(math.isnan(lo) or math.isnan(hi) for lo, hi in ranges)):
                return out
            note = "NaN from infinite inputs (inf - inf, 0 * inf, or a softmax over a row that is -inf everywhere)"
        elif name in CASTS and read:
            source = read[0]  # copy_(dst, src): the source is what was cast
            producer = self._made(source)
            if producer is not None:
                operator, ranges, scalars = producer.operator, producer.ranges, producer.scalars
                spreads, origins = producer.spreads, producer.origins
                peak = max(abs(v) for v in _range(source))
                note = f"its result, max |x| = {peak:.4g}, overflowed when rounded to {str(bad.dtype).replace('torch.', '')}"
            else:
                note = f"overflowed when cast to {str(bad.dtype).replace('torch.', '')}"
                known = self.parameters.get(id(source))
                if known is not None and known[0] is source:
                    peak, parameter = max(abs(v) for v in _range(source)), known[1]
                    note = (
                        f"the parameter '{known[1]}' (max |x| = {peak:.4g}) overflowed when autocast cast it to "
                        f"{str(bad.dtype).replace('torch.', '')}: a weight fp16 cannot hold"
                    )
        phase = self._phase()
        self.candidates.append(
            {
                "phase": phase,
                "module": self._module(),
                "operator": operator,
                "input_ranges": ranges,
                "output": _describe_bad(bad),
                "note": note,
                "peak": peak,
                "scalars": scalars,
                "input_spreads": spreads,
                "input_constants": origins,
                "parameter": parameter,
                # a rounding cast reports its input's producer, whose inputs these are not
                "flushed_constant": self._unheld_input([*prior, *read]) if operator == name else None,
                # the line that called it, where a line of code did (a backward op is autograd's: its node says)
                "line": _calling_line(self.user_path) if operator == name and phase in ("forward", "loss") else None,
                **(_autograd_node() if phase == "backward" else {}),
            }
        )
        self._mark(outputs, len(self.candidates) - 1)
        if phase != "forward":
            self.confirmed = len(self.candidates) - 1  # no module output to wait for
        return out

    def _remember(
        self,
        func: Any,
        name: str,
        prior: list[torch.Tensor],
        read: list[torch.Tensor],
        outputs: list[torch.Tensor],
        args: tuple,
        kwargs: dict,
        before: tuple[list[tuple[float, float]], list[int]],
    ) -> None:
        """Who produced each tensor, to see through rounding casts; views pass their input's producer on.
        ``prior``: an in-place op's first argument, ``before`` its ranges and spreads as they were; ``read``: the
        other inputs, described here, only where a record is kept (not for casts and views: the tracer's hot path)."""
        if name in CASTS:
            return
        inputs = [*prior, *read]
        if (getattr(func, "is_view", False) or name in RESHAPES) and inputs:
            known = self._made(inputs[0])
            if known is not None:
                for t in outputs:
                    self._producers[id(t)] = dataclasses.replace(known, tensor=weakref.ref(t))
            return
        read_ranges, read_spreads = _described(read)
        ranges, spreads, scalars = before[0] + read_ranges, before[1] + read_spreads, _scalars(args, kwargs)
        origins = [self._carries_constant(t) for t in inputs]
        carries = name in CONSTANT_MAKERS and (
            any(abs(v) >= FP16_MAX for v in scalars)
            or any(origins)
            or (name in LIFTS and any(max(abs(lo), abs(hi)) >= FP16_MAX for lo, hi in ranges))
        )
        if carries:  # only where a value beyond fp16's range came out: clamp(min=-1e9) of scores carries none
            carries = any(max(abs(v) for v in _range(t)) >= FP16_MAX for t in outputs if t.is_floating_point())
        for t in outputs:
            self._producers[id(t)] = _Made(weakref.ref(t), name, ranges, scalars, spreads, origins, carries)

    def _note_unheld(
        self, func: Any, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], args: tuple, kwargs: dict
    ) -> None:
        """Remember the outputs of an op given a Python number their dtype cannot hold; casts and views pass it on."""
        if name in CASTS or getattr(func, "is_view", False) or name in RESHAPES:
            known = self._unheld_of(inputs[0]) if inputs else None
            if known is not None:
                for t in outputs:
                    self._unheld[id(t)] = (weakref.ref(t), known)
            return
        if name not in CONSTANT_MAKERS:
            return
        found = _unheld_constant(args, kwargs, outputs)
        if found is None or self._phase() != "forward":
            return  # the optimizer's epsilon in fp16 state is half-optimizer-state's, not a constant in the model
        value, held, dtype = found
        record = FlushedConstant(value, held, str(dtype).replace("torch.", ""), name, -1, _calling_line(self.user_path))
        for t in outputs:
            self._unheld[id(t)] = (weakref.ref(t), record)

    def _unheld_of(self, t: torch.Tensor) -> FlushedConstant | None:
        entry = self._unheld.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _unheld_input(self, inputs: list[torch.Tensor]) -> FlushedConstant | None:
        """The first of the culprit's inputs made by an op given a constant its dtype cannot hold, as a record."""
        for i, t in enumerate(inputs):
            known = self._unheld_of(t)
            if known is not None:
                return dataclasses.replace(known, input=i)
        return None

    def _made(self, t: torch.Tensor) -> _Made | None:
        known = self._producers.get(id(t))
        return known if known is not None and known.tensor() is t else None

    def _carries_constant(self, t: torch.Tensor) -> bool | None:
        """Whether ``t`` carries a constant beyond fp16's range (made by a fill, or by arithmetic on one), or
        holds only what the step computed (False); None for a tensor the step did not make (a parameter, a
        buffer, a batch field): its values tell."""
        known = self._made(t)
        return None if known is None else known.carries_constant

    def _phase(self) -> str:
        if self.context.in_optimizer:
            return "optimizer"
        if reducing():
            return "reduction"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self.context.stack else "loss"

    def _module(self) -> str | None:
        phase = self._phase()
        if phase == "backward":
            return self.context.backward_module or OUTSIDE_MODEL  # no module output reached yet: the loss's backward
        if phase in ("optimizer", "reduction"):
            return None
        return self.context.stack[-1] if self.context.stack else OUTSIDE_MODEL


def _autograd_node() -> dict[str, str | None]:
    """The autograd node running now, and the custom ``torch.autograd.Function`` behind it: a hand-written
    ``backward`` runs outside autocast, on whatever dtype its forward saved."""
    node = torch._C._current_autograd_node()
    if node is None:
        return {}
    function = getattr(type(node), "_forward_cls", None)
    return {"autograd_node": node.name(), "custom_function": function.__name__ if function is not None else None}


def _run_eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled programs run eager inside the block, their compiled code kept for after it (torch >= 2.6's
    ``set_stance``; before it, dynamo is turned off for the block, which keeps the compiled code too)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        return set_stance("force_eager")  # type: ignore[no-any-return]
    return torch._dynamo.config.patch(disable=True)  # type: ignore[no-any-return]


def trace_step(
    probe: Probe, batch: Any = None, batch_index: int | None = None, absorbed: bool = False
) -> Localisation | None:
    """Take ``probe``'s next step (on ``batch`` if given) with the tracer on; the first non-finite op, or None.

    ``absorbed``: instead, the first operator of the forward pass that made a result past fp16's range whose
    non-finite values no module's output shows (an infinity divided away, ``x / inf = 0``: a linear attention's
    normaliser, a hand-written variance of large values), or None. Such an overflow leaves the run finite and shows
    only as a gap to FP32."""
    context = _Context()
    names = module_names(probe.model)

    def push(module: torch.nn.Module, args: Any) -> None:
        context.stack.append(names[module])

    hooked: dict[int, torch.Tensor] = {}  # by id; holding the tensor keeps its id from being reused this step
    own = None if probe.spec.replays_capsule else Path(probe.spec.path)  # a capsule's file is the doctor's
    tracer = NonFiniteTracer(context, {id(p): (p, n) for n, p in probe.model.named_parameters()}, own)

    def pop(module: torch.nn.Module, args: Any, output: Any) -> None:
        if context.stack:
            context.stack.pop()
        tracer.confirm(_floats(output))
        for t in _floats(output):
            # A tensor a parent returns as it is (``return self.head(h)``) keeps its innermost module: the
            # backward ops that follow its gradient are that module's.
            if t.requires_grad and id(t) not in hooked:
                hooked[id(t)] = t
                t.register_hook(lambda g, n=names[module]: setattr(context, "backward_module", n))

    def optimizer_on(*_: Any) -> None:
        context.in_optimizer = True

    def optimizer_off(*_: Any) -> None:
        context.in_optimizer = False

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop))
    for optimizer in probe.optimizers.all():  # every optimizer the training steps (optimizers(model) gives several)
        handles.append(optimizer.register_step_pre_hook(optimizer_on))
        handles.append(optimizer.register_step_post_hook(optimizer_off))
    step = probe.iteration
    stepped = batch
    if batch is None:
        index, stepped = probe.batch_at_cursor()
        batch_index = index if batch_index is None else batch_index
    elif batch_index is None:
        batch_index = probe.cursor
    bad_field = _nonfinite_field(stepped)
    if bad_field is not None:  # the values came in with the data: no operator made them
        for h in handles:
            h.remove()
        if absorbed:
            return None
        name, tensor = bad_field
        return Localisation(
            step=step,
            batch_index=batch_index,
            mode=probe.mode,
            phase="data",
            module=None,
            operator=f"<batch field '{name}'>",
            input_ranges=[],
            output=_describe_bad(tensor),
            note="the batch itself holds non-finite values",
        )
    # A compiled probe's step runs eager under the tracer (dynamo then neither traces the tracer's mode nor decides,
    # for the rest of the run, to leave the program eager): its operators are eager's, as the tracer names them.
    eager = _run_eager() if probe.runs_compiled else contextlib.nullcontext()
    try:
        with tracer, eager:
            probe.step(batch, batch_index)
    finally:
        for h in handles:
            h.remove()
    if absorbed:
        made = (
            Localisation(step=step, batch_index=batch_index, mode=probe.mode, **found)
            for index, found in enumerate(tracer.candidates)
            if found["phase"] == "forward" and index != tracer.confirmed
        )
        return next((loc for loc in made if loc.made_past_range), None)
    if tracer.found is None:
        return None
    return Localisation(
        step=step, batch_index=batch_index, mode=probe.mode, loss_scale=backward_scale(probe), **tracer.found
    )


def backward_scale(probe: Probe) -> float:
    """The loss scale the step just taken ran its backward with: 1 where it never called ``scaler.scale`` (a
    plain ``loss.backward()``, whatever the config's scaler says)."""
    trace = probe.scaler.trace
    return float(trace.scale_used) if trace is not None and trace.scaled else 1.0


def localise(
    bench: Workbench,
    mode: str,
    step: int,
    config: Any = None,
    align: bool = False,
    keep: MutableMapping[int, ProbeSnapshot] | None = None,
) -> Localisation | None:
    """Replay ``mode`` deterministically up to ``step`` and trace that step.

    When the weights are already non-finite as that step starts, or nothing in it turns finite values
    non-finite, the step before is traced from a snapshot: an optimizer update that wrote inf/NaN into
    the weights leaves that step's loss and gradients finite, and shows only in the next forward.
    ``keep`` receives that snapshot (by the step it starts), for later work on the failing step.
    """
    probe = bench.probe(
        mode, config, align_on_taken_steps=align, instruments=None
    )  # the tracer reads the step, not the instruments
    try:
        with bench.progress.planned(localise_steps(step)):
            return _replay_and_trace(probe, step, keep)
    finally:
        probe.close()


def localise_steps(step: int) -> int:
    """The probe steps :func:`localise` takes to trace ``step``: the replay up to it and the traced step (one
    more when the step before must be traced too)."""
    return step + 1


def _replay_and_trace(probe: Probe, step: int, keep: MutableMapping[int, ProbeSnapshot] | None) -> Localisation | None:
    """:func:`localise`'s work on its fresh ``probe`` (see there)."""
    while probe.iteration < step - 1 and probe.failed is None:
        probe.step()
    kept = keep if keep is not None else StateKeeper().kept()
    before = probe.iteration if step > 0 and probe.failed is None else None
    if before is not None:
        kept[before] = probe.snapshot(copy_state=False)  # kept as a copy: in memory, or straight to disk
        probe.step()
    weights_broken = not all(_finite(p) for p in probe.model.parameters())
    found = trace_step(probe) if probe.failed is None and not weights_broken else None
    if found is None and before is not None:
        probe.restore_kept(kept, before)  # no second copy of the optimizer's state
        found = trace_step(probe)
    if found is not None:
        found.replayed = [(r.loss, r.loss_scale) for r in probe.records if r.step < found.step]
    return found
