"""``serve-check``: the trained model as it will be served, in half precision, against FP32.

A model trained with AMP keeps fp32 weights and runs the sensitive ops in fp32. Served in pure fp16
(``model.half()``, an fp16 engine), every op runs in fp16: logits past 65504 become inf, a normalisation's
statistics overflow, small weights flush to zero. So the model runs its forward, as the training file's loss calls
it, on the file's batches, without gradients, four ways:

* ``fp32``: the reference;
* ``fp16``: ``model.half()``, its floating inputs cast to fp16 (what an fp16 export serves);
* ``fp16-autocast``: fp32 weights under fp16 autocast (what the training ran);
* ``bf16``: ``model.to(torch.bfloat16)``.

Each mode's outputs are compared with FP32's (largest absolute and relative deviation, non-finite values). In the
FP32 pass every module's output is measured against fp16's range (past 65504; non-zero values below fp16's
smallest subnormal, which flush to zero), and every parameter is cast to fp16 to see what overflows or flushes.

Where fp16 serving fails, the smallest set of modules to keep in fp32 is searched the way the precision-gap search
works, and verified: the culprit of the failing run (the first module whose fp16 output is non-finite from finite
inputs, else the one past fp16's range, else the one deviating most), added one at a time until the outputs are
finite and within the tolerance, then each member dropped again where the rest still pass. A kept module runs in
fp32 as an fp16 export with a block list runs it (ONNX converters keeping the inputs' and outputs' types): the
model's inputs handed in fp32, a kept module's inputs cast up and its outputs left in fp32, and every other module
that holds parameters casting its inputs to fp16.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch

from ..errors import TrainingFileError
from ..precision.autocast_policy import cuda_policy_on_cpu
from ..tensors import FP16_MAX
from ..userfile.batches import floats_to, iter_tensors, map_tensors, to_device
from .compare import json_number

SERVING_MODES = ("fp16", "fp16-autocast", "bf16")
"""The half-precision ways of serving compared with FP32."""
FP16_TINY = 2.0**-24
"""fp16's smallest subnormal: non-zero values below it flush to zero."""
DEFAULT_TOLERANCE = 1e-2
"""Safe when every output's largest deviation is within 1% of the output's largest FP32 magnitude."""
HALF_SCALAR_OVERFLOW = "cannot be converted to type c10::Half without overflow"
"""PyTorch's message when a Python number written into an fp16 tensor (a fill, ``full_like``, ``masked_fill``) is
past 65504: the exception's text is the only signal of it (a plain RuntimeError)."""
MAX_KEPT = 8
"""The keep-set search stops after this many modules: a model that needs more is not one to serve in fp16."""

LossFn = Callable[[torch.nn.Module, Any], Any]


@dataclass
class ModeResult:
    """One way of serving, against FP32."""

    mode: str
    """``fp16``, ``fp16-autocast`` or ``bf16``."""
    outputs: pd.DataFrame
    """One row per output tensor: ``output`` (its path in what the model returns), ``max_abs_dev``, ``rel_dev``
    (the largest deviation over the output's largest FP32 magnitude; inf where a value turned inf or NaN),
    ``nonfinite`` (values that are inf or NaN where FP32's are finite)."""
    error: str | None = None
    """The exception the forward raised in this mode (an op without a half kernel on this device), or None."""

    @property
    def rel_dev(self) -> float:
        """The largest relative deviation of any floating output (inf where the mode raised or a value turned inf
        or NaN; 0 where the model returns no floating output, which no precision changes)."""
        if self.error is not None:
            return math.inf
        return float(self.outputs["rel_dev"].max()) if len(self.outputs) else 0.0

    @property
    def finite(self) -> bool:
        """The mode ran, and no output is inf or NaN where FP32's is finite."""
        return self.error is None and int(self.outputs["nonfinite"].sum()) == 0

    def within(self, tolerance: float) -> bool:
        return self.finite and self.rel_dev <= tolerance

    @property
    def scalar_overflow(self) -> bool:
        """The forward raised because it wrote a number past 65504 into a half tensor (a mask's -1e9)."""
        return self.error is not None and HALF_SCALAR_OVERFLOW in self.error

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "rel_dev": json_number(self.rel_dev),
            "finite": self.finite,
            "error": self.error,
            "outputs": [
                {k: json_number(v) if isinstance(v, float) else v for k, v in r.items()}
                for r in table_rows(self.outputs)
            ],
        }


@dataclass
class KeepSet:
    """The modules to keep in fp32 for fp16 serving, and what serving so measured."""

    modules: list[str]
    """The modules' names (``model.get_submodule`` paths), the fewest found."""
    verified: bool
    """fp16 serving with these modules in fp32 is finite and within the tolerance (measured)."""
    rel_dev: float
    """Its largest relative deviation from FP32."""
    tried: list[list[str]] = field(default_factory=list)
    """Every set run, in order."""
    first_nonfinite: str | None = None
    """In fp16 with nothing kept: the first module whose output is non-finite from finite inputs (None: none)."""
    whole_model: bool = False
    """The set holds every module that holds parameters: nothing of the model is served in fp16."""
    why: dict[str, str] = field(default_factory=dict)
    """Per kept module, why the search kept it (its fp16 output turned inf or NaN, its FP32 output passes 65504,
    or it strayed furthest from FP32's)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "modules": self.modules,
            "verified": self.verified,
            "rel_dev": json_number(self.rel_dev),
            "tried": self.tried,
            "first_nonfinite": self.first_nonfinite,
            "whole_model": self.whole_model,
            "why": self.why,
        }


@dataclass(frozen=True)
class Conversion:
    """One fp16 conversion of the model, run on onnxruntime against FP32."""

    JSON_KEY_DOCS: ClassVar[dict[str, str]] = {
        "provider_fp32_ops": "Its fp16 operators the provider ran in fp32 (no fp16 kernel there): ``op``, ``count``.",
        "clamped_initializers": "Weights and constants past 65504 it stores as +-65504: ``initializer`` (the "
        "exporter's name), ``value`` (its value of largest magnitude), ``used_by`` (the module and operator of its "
        "first reader).",
    }
    """What the keys ``to_json`` computes hold: the JSON reference reads them."""

    result: ModeResult
    """Its outputs on onnxruntime against FP32's (mode ``onnx-fp16``, or ``onnx-fp16-kept`` with the keep-set
    blocked)."""
    as_written: ModeResult
    """Its outputs against FP32's with every operator computed in the dtype the graph gives it (``onnx``'s reference
    evaluator, in NumPy): what an engine with fp16 kernels for all of them computes, where a provider would
    upcast. Its ``error`` where the evaluator lacks an operator: then not measured."""
    upcast: pd.DataFrame
    """``op``, ``count``: its fp16 operators the provider ran in fp32 (no fp16 kernel there)."""
    half_ops: int
    """Its operators, other than casts, that the converter left in fp16."""
    clamped: pd.DataFrame
    """``initializer``, ``value``, ``used_by``: weights and constants past 65504 it stores as +-65504."""

    @property
    def upcast_ops(self) -> int:
        return int(self.upcast["count"].sum())

    def within(self, tolerance: float) -> bool:
        """Finite and within the tolerance on onnxruntime, and as written where the evaluator could run it."""
        as_written = self.as_written.error is not None or self.as_written.within(tolerance)
        return self.result.within(tolerance) and as_written

    def to_json(self) -> dict[str, Any]:
        return {
            "result": self.result.to_json(),
            "as_written": self.as_written.to_json(),
            "provider_fp32_ops": table_rows(self.upcast),
            "half_ops": self.half_ops,
            "clamped_initializers": table_rows(self.clamped),
        }


@dataclass(frozen=True)
class OnnxServing:
    """The fp16 ONNX conversions of the model, run on onnxruntime against FP32."""

    provider: str
    """The onnxruntime execution provider that ran them."""
    converted: Conversion | None
    """The whole model converted to fp16; None where the export or the converter failed (``error``)."""
    kept: Conversion | None
    """Converted with the keep-set's nodes on the block list; None without a keep-set."""
    blocked_nodes: list[str]
    """The ONNX nodes the keep-set's modules made, given to the converter as its block list."""
    round_trips_folded: int
    """Casts to fp16 and straight back to fp32, at the block list's edges, folded away."""
    batches: int
    """The batches served: those whose inputs have the exported shapes."""
    written: str | None = None
    """Where the served conversion was written (``--onnx-out``), or None."""
    error: str | None = None
    """Why there is no conversion (the export or the converter failed), or None."""

    @property
    def served(self) -> Conversion | None:
        """The conversion a release would ship: with the keep-set where there is one."""
        return self.kept if self.kept is not None else self.converted

    def within(self, tolerance: float) -> bool:
        return self.served is not None and self.served.within(tolerance)

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "converted": self.converted.to_json() if self.converted is not None else None,
            "kept": self.kept.to_json() if self.kept is not None else None,
            "blocked_nodes": self.blocked_nodes,
            "round_trips_folded": self.round_trips_folded,
            "batches": self.batches,
            "written": self.written,
            "error": self.error,
        }


@dataclass
class ServeCheck:
    """What ``serve-check`` measured; the CLI renders it."""

    JSON_KEY_DOCS: ClassVar[dict[str, str]] = {
        "verdict": "``safe`` where fp16 serving (``model.half()``) is finite and within the tolerance, and with "
        "``--onnx`` the fp16 ONNX conversion a release would ship too; else ``unsafe``.",
        "modes": "Per way of serving (``fp16``, ``fp16-autocast``, ``bf16``), its outputs against FP32.",
        "overflowing_modules": "Modules whose FP32 outputs pass 65504 (inf in fp16): ``module``, ``max_abs``.",
        "flushing_modules": "Modules with non-zero FP32 outputs below fp16's smallest subnormal (zero in fp16): "
        "``module``, ``flushed`` (their count), ``share`` (of the module's non-zero outputs).",
        "parameters": "Parameters that overflow or flush when cast to fp16: ``name``, ``overflow``, ``flushed`` "
        "(element counts), ``max_abs``.",
        "keep_fp32": "The smallest set of modules to keep in fp32 for fp16 serving, and what it measured; null "
        "where fp16 serving is safe as it is.",
    }
    """What the keys ``to_json`` computes hold: the JSON reference reads them."""

    tolerance: float
    """Safe within this share of each output's largest FP32 magnitude (``--tolerance``)."""
    batches: int
    """The batches of ``data()`` served."""
    modes: dict[str, ModeResult]
    overflowing: pd.DataFrame
    """``module``, ``max_abs``: the modules whose FP32 outputs pass 65504, largest first."""
    flushing: pd.DataFrame
    """``module``, ``flushed``, ``share``: the modules with non-zero FP32 outputs fp16 flushes to zero."""
    cast_parameters: pd.DataFrame
    """``name``, ``overflow``, ``flushed``, ``max_abs``: the parameters fp16 cannot hold."""
    keep: KeepSet | None = None
    """Where fp16 serving fails: the modules to keep in fp32, searched and verified."""
    onnx: OnnxServing | None = None
    """With ``--onnx``: the fp16 ONNX conversions run on onnxruntime."""

    @property
    def safe(self) -> bool:
        """fp16 serving (``model.half()``) is finite and within the tolerance, and so is the ONNX conversion a release
        would ship, where it was checked."""
        onnx_safe = self.onnx is None or self.onnx.within(self.tolerance)
        return self.modes["fp16"].within(self.tolerance) and onnx_safe

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": "safe" if self.safe else "unsafe",
            "tolerance": self.tolerance,
            "batches": self.batches,
            "modes": {name: result.to_json() for name, result in self.modes.items()},
            "overflowing_modules": table_rows(self.overflowing),
            "flushing_modules": table_rows(self.flushing),
            "parameters": table_rows(self.cast_parameters),
            "keep_fp32": self.keep.to_json() if self.keep is not None else None,
            "onnx": self.onnx.to_json() if self.onnx is not None else None,
        }


def table_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict("records")]


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return json_number(value)
    return value.item() if hasattr(value, "item") else value


# --- running the model ---------------------------------------------------------------------------------
def served_outputs(
    model: torch.nn.Module, batches: list[Any], loss_fn: LossFn, input_dtype: torch.dtype | None
) -> list[Any]:
    """What the model returns on each batch, called as the training file's loss calls it, without gradients;
    the floating inputs cast to ``input_dtype`` where given. The loss computed after the model's forward is not
    the served value: an error in it (a half loss) is left aside once the model has returned."""
    captured: list[Any] = []
    handle = model.register_forward_hook(lambda m, args, out: captured.append(map_tensors(out, _detached)))
    try:
        with torch.no_grad():
            for batch in batches:
                before = len(captured)
                try:
                    loss_fn(model, to_device(batch, torch.device("cpu"), input_dtype))
                except Exception:
                    if len(captured) == before:
                        raise
                del captured[before + 1 :]  # the model's own calls inside its forward are not what it returns
    finally:
        handle.remove()
    return captured


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def compare_outputs(ours: list[Any], reference: list[Any]) -> pd.DataFrame:
    """Per output tensor over the batches: the largest deviation from the reference, relative to its largest
    magnitude, and the values that are non-finite where the reference's are finite."""
    stats: dict[str, list[float]] = {}
    for mine, theirs in zip(ours, reference):
        for (name, a), (_, b) in zip(iter_tensors(mine, "output"), iter_tensors(theirs, "output")):
            if not b.is_floating_point():
                continue
            a, b = a.double(), b.double()
            finite = torch.isfinite(b)
            bad = int((~torch.isfinite(a) & finite).sum())
            both = finite & torch.isfinite(a)
            dev = float((a - b).abs()[both].max()) if bool(both.any()) else 0.0
            scale = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
            entry = stats.setdefault(name, [0.0, 0.0, 0])
            entry[0], entry[1], entry[2] = max(entry[0], dev), max(entry[1], scale), entry[2] + bad
    rows = [
        {
            "output": name,
            # a value turned inf or NaN is off by more than any finite deviation: not the finite values' 0
            "max_abs_dev": math.inf if bad else dev,
            "rel_dev": math.inf if bad else (dev / scale if scale > 0 else (0.0 if dev == 0 else math.inf)),
            "nonfinite": bad,
        }
        for name, (dev, scale, bad) in stats.items()
    ]
    return pd.DataFrame(rows, columns=["output", "max_abs_dev", "rel_dev", "nonfinite"])


@contextlib.contextmanager
def kept_in_fp32(model: torch.nn.Module, names: list[str], source: torch.nn.Module) -> Iterator[None]:
    """The modules ``names`` of a half model in fp32 while the block runs, as an fp16 export with a block list
    runs them: their weights and buffers ``source``'s (the fp32 model: a value past 65504 did not survive the cast
    to fp16), their inputs cast up and their outputs left fp32 (a model output they make is served in fp32); every
    other module that holds parameters casts its floating inputs to fp16 again."""
    handles = []
    try:
        for name, module in model.named_modules():
            if name in names:
                module.float().load_state_dict(source.get_submodule(name).state_dict())
                handles.append(module.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True))
            elif names and not _inside(name, names) and any(True for _ in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(_cast_inputs(torch.float16), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _cast_inputs(dtype: torch.dtype) -> Callable[..., Any]:
    def cast(module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        return floats_to(args, dtype), floats_to(kwargs, dtype)

    return cast


# --- what FP32 shows against fp16's range --------------------------------------------------------------
def module_ranges(model: torch.nn.Module, batches: list[Any], loss_fn: LossFn) -> tuple[pd.DataFrame, pd.DataFrame]:
    """In FP32: the modules whose outputs pass 65504, and those with non-zero outputs fp16 flushes to zero."""
    peaks: dict[str, float] = {}
    flushed: dict[str, list[int]] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for _, t in iter_tensors(output):
                if not t.is_floating_point() or not t.numel():
                    continue
                magnitude = t.detach().abs().float()
                finite = magnitude[torch.isfinite(magnitude)]
                peaks[name] = max(peaks.get(name, 0.0), float(finite.max()) if finite.numel() else 0.0)
                counts = flushed.setdefault(name, [0, 0])
                counts[0] += int(((magnitude > 0) & (magnitude < FP16_TINY)).sum())
                counts[1] += int((magnitude > 0).sum())

        return hook

    handles = [m.register_forward_hook(record(n or "(model)")) for n, m in model.named_modules()]
    try:
        served_outputs(model, batches, loss_fn, None)
    finally:
        for handle in handles:
            handle.remove()
    over = [{"module": n, "max_abs": v} for n, v in peaks.items() if v > FP16_MAX]
    flush = [{"module": n, "flushed": c[0], "share": c[0] / c[1]} for n, c in flushed.items() if c[0] and c[1]]
    return (
        pd.DataFrame(over, columns=["module", "max_abs"]).sort_values("max_abs", ascending=False, ignore_index=True),
        pd.DataFrame(flush, columns=["module", "flushed", "share"]),
    )


def parameter_casts(model: torch.nn.Module) -> pd.DataFrame:
    """Parameters that overflow (past 65504) or flush (non-zero, below fp16's smallest subnormal) cast to fp16."""
    rows = []
    for name, p in model.named_parameters():
        magnitude = p.detach().abs().float()
        overflow = int((magnitude > FP16_MAX).sum())
        flush = int(((magnitude > 0) & (magnitude < FP16_TINY)).sum())
        if overflow or flush:
            rows.append({"name": name, "overflow": overflow, "flushed": flush, "max_abs": float(magnitude.max())})
    return pd.DataFrame(rows, columns=["name", "overflow", "flushed", "max_abs"])


# --- the check ------------------------------------------------------------------------------------------
def serve_check(
    build: Callable[[], torch.nn.Module],
    batches: list[Any],
    loss_fn: LossFn,
    tolerance: float = DEFAULT_TOLERANCE,
    onnx: OnnxRequest | None = None,
) -> ServeCheck:
    """Serve ``build()``'s model in each half-precision way against FP32, and where fp16 fails, find the modules
    to keep in fp32; with ``onnx``, check the fp16 ONNX conversions too. ``build`` makes the trained model in fp32,
    in eval mode, anew for each way."""
    reference = _reference(build, batches, loss_fn)
    overflowing, flushing = module_ranges(build(), batches, loss_fn)
    modes = {mode: _serve(mode, build, batches, loss_fn, reference) for mode in SERVING_MODES}
    result = ServeCheck(tolerance, len(batches), modes, overflowing, flushing, parameter_casts(build()))
    if not modes["fp16"].within(tolerance):
        result.keep = search_keep_set(build, batches, loss_fn, reference, tolerance, overflowing)
    if onnx is not None:
        from .serving_onnx import onnx_serving

        kept = result.keep.modules if result.keep is not None and result.keep.verified else []
        result.onnx = onnx_serving(build, batches, loss_fn, kept, onnx.write_to)
    return result


@dataclass(frozen=True)
class OnnxRequest:
    """``--onnx``: check the fp16 ONNX conversions (the optional extras installed)."""

    write_to: Path | None = None
    """Write the conversion a release would ship here (``--onnx-out``)."""


def _reference(build: Callable[[], torch.nn.Module], batches: list[Any], loss_fn: LossFn) -> list[Any]:
    """FP32's outputs: the model as the training file calls it must run, or it is the file's error (exit 2)."""
    try:
        return served_outputs(build(), batches, loss_fn, None)
    except Exception as exc:  # noqa: BLE001 - the user's code: its error, said as bad input
        raise TrainingFileError(
            f"the model's FP32 forward raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
            hint="serve-check calls the model as loss(model, batch) does, on the CPU, in eval mode, without gradients.",
        ) from exc


def _serve(
    mode: str, build: Callable[[], torch.nn.Module], batches: list[Any], loss_fn: LossFn, reference: list[Any]
) -> ModeResult:
    model = build()
    try:
        if mode == "fp16":
            outputs = served_outputs(model.half(), batches, loss_fn, torch.float16)
        elif mode == "bf16":
            outputs = served_outputs(model.to(torch.bfloat16), batches, loss_fn, torch.bfloat16)
        else:  # autocast with CUDA's op lists, as the training ran on a GPU (CPU autocast's lists are shorter)
            with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
                outputs = served_outputs(model, batches, loss_fn, None)
    except Exception as exc:  # noqa: BLE001 - the model's own error in this precision: measured, not a crash
        return ModeResult(
            mode, compare_outputs([], []), error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
    return ModeResult(mode, compare_outputs(outputs, reference))


Culprit = tuple[str, str]
"""A module to keep in fp32 next, and why, in words."""


def fp16_with_kept(
    build: Callable[[], torch.nn.Module], batches: list[Any], loss_fn: LossFn, reference: list[Any], kept: list[str]
) -> tuple[ModeResult, Culprit | None]:
    """fp16 serving with ``kept`` in fp32, and its culprit with why: the first module whose fp16 output is
    non-finite from finite inputs, else the module holding parameters whose output on the first batch deviates most
    from FP32's (None where nothing is left to keep)."""
    model = build().half()
    source = build()
    first_bad: list[str] = []
    half_outputs = _FirstOutputs(model, kept, first_bad)
    try:
        with kept_in_fp32(model, kept, source):
            try:
                # with modules kept, the inputs arrive in fp32 as an fp16 export keeping its inputs' types takes
                # them; each module holding parameters casts them to its own dtype
                outputs = served_outputs(model, batches, loss_fn, None if kept else torch.float16)
            except Exception as exc:  # noqa: BLE001 - measured: this keep-set does not serve
                return ModeResult("fp16", compare_outputs([], []), error=type(exc).__name__), None
    finally:
        half_outputs.close()
    result = ModeResult("fp16", compare_outputs(outputs, reference))
    if first_bad or not result.finite:  # a non-finite run's culprit is where it turned non-finite, or none
        return result, (first_bad[0], "its fp16 output is inf or NaN from finite inputs") if first_bad else None
    fp32_outputs = _FirstOutputs(source, [], [])
    try:
        served_outputs(source, batches[:1], loss_fn, None)
    finally:
        fp32_outputs.close()
    return result, _deviating_most(half_outputs.seen, fp32_outputs.seen, model, kept)


class _FirstOutputs:
    """Hooks that keep each module's first floating output (the first batch's), and note in ``first_bad`` the first
    module (not kept) whose output is non-finite from inputs that reached it finite: made before the keep-set's own
    casts to fp16, whose overflow is the module's (its input cannot be held in fp16)."""

    def __init__(self, model: torch.nn.Module, kept: list[str], first_bad: list[str]):
        self.seen: dict[str, torch.Tensor] = {}
        self._finite_in: dict[str, bool] = {}
        self.handles = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_pre_hook(self._arrived(name)))
                self.handles.append(module.register_forward_hook(self._left(name, kept, first_bad)))

    def _arrived(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            inputs = [t for _, t in iter_tensors(args) if t.is_floating_point()]
            self._finite_in[name] = all(bool(torch.isfinite(t).all()) for t in inputs)

        return hook

    def _left(self, name: str, kept: list[str], first_bad: list[str]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensor = next((t for _, t in iter_tensors(output) if t.is_floating_point()), None)
            if tensor is None:
                return
            if name not in self.seen:
                self.seen[name] = tensor.detach().double()
            if first_bad or name in kept or _inside(name, kept) or not self._finite_in.get(name, False):
                return
            if not bool(torch.isfinite(tensor).all()):
                first_bad.append(name)

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _deviating_most(
    half: dict[str, torch.Tensor], full: dict[str, torch.Tensor], model: torch.nn.Module, kept: list[str]
) -> Culprit | None:
    """The module holding parameters, not kept, whose first output strays furthest from FP32's (relative)."""
    worst, name_of_worst = 0.0, None
    for name, module in model.named_modules():
        if not name or name in kept or _inside(name, kept) or name not in half or name not in full:
            continue
        if not any(True for _ in module.parameters(recurse=False)) or half[name].shape != full[name].shape:
            continue
        scale = float(full[name].abs().max()) or 1.0
        deviation = float((half[name] - full[name]).abs().max()) / scale
        if math.isfinite(deviation) and deviation > worst:
            worst, name_of_worst = deviation, name
    if name_of_worst is None:
        return None
    return name_of_worst, f"its fp16 output strays furthest from FP32's ({worst:.2%} of its largest value)"


def search_keep_set(
    build: Callable[[], torch.nn.Module],
    batches: list[Any],
    loss_fn: LossFn,
    reference: list[Any],
    tolerance: float,
    overflowing: pd.DataFrame,
) -> KeepSet:
    """Add the failing run's culprit until fp16 serving passes, then drop each member the rest pass without."""
    kept: list[str] = []
    why: dict[str, str] = {}
    tried: list[list[str]] = []
    pending = [m for m in overflowing["module"] if m != "(model)"]
    result, culprit = fp16_with_kept(build, batches, loss_fn, reference, kept)
    first_nonfinite = culprit[0] if culprit is not None and not result.finite else None
    while not result.within(tolerance) and len(kept) < MAX_KEPT:
        past_range = next((m for m in pending if m not in kept and not _inside(m, kept)), None)
        candidate = culprit or ((past_range, "its FP32 output passes fp16's 65504") if past_range else None)
        if candidate is None or candidate[0] in kept:
            break
        kept.append(candidate[0])
        why[candidate[0]] = candidate[1]
        tried.append(list(kept))
        result, culprit = fp16_with_kept(build, batches, loss_fn, reference, kept)
    if not result.within(tolerance):
        return KeepSet(kept, False, result.rel_dev, tried, first_nonfinite, why=why)
    for member in list(kept):
        fewer = [m for m in kept if m != member]
        tried.append(fewer)
        smaller, _ = fp16_with_kept(build, batches, loss_fn, reference, fewer)
        if smaller.within(tolerance):
            kept, result = fewer, smaller
    whole = _covers_every_weight(build(), kept)
    return KeepSet(kept, True, result.rel_dev, tried, first_nonfinite, whole, {m: why[m] for m in kept})


def _covers_every_weight(model: torch.nn.Module, kept: list[str]) -> bool:
    """Every module holding parameters is kept, or inside a kept one."""
    holders = [name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    return all(name in kept or _inside(name, kept) for name in holders)


def _inside(name: str, kept: list[str]) -> bool:
    return any(name.startswith(k + ".") for k in kept)


def fresh_copies(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """A builder of copies of ``model`` in fp32 and eval mode: each way of serving starts from the same weights."""
    template = copy.deepcopy(model).float().eval()
    return lambda: copy.deepcopy(template)
