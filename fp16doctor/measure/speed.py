"""``speed``: is AMP faster here, and if not, which of its two conditions fails.

Mixed precision speeds a step up when the half-precision matrix products fit the tensor cores (dimensions that are
multiples of 8, matrices not tiny) and when most of the step runs in half precision (no swarm of small element-wise
ops, no casts back and forth, no host synchronisations). The training file's own step (its loss, its optimizer, its
scaler, as the probes run it) is:

* **timed**, FP32 and AMP side by side, the median of a few steps after warm-up; on CUDA with CUDA's clock and its
  peak memory, on a CPU by the wall clock, labelled as not predicting a GPU;
* **counted**, exactly and on any machine, on one AMP step under a dispatch mode that sees every aten operator of
  the forward, the backward and the optimizer step: the FLOPs that run in half precision and those autocast leaves
  in fp32 (by operator), the casts with their bytes, the half-precision matrix products whose dimensions are not
  multiples of 8 (with the module that ran them), the host synchronisations with the line of the training file that
  asked for them, the element-wise operators with the bytes they move, and whether the optimizer is fused.

The doctor's own bookkeeping inside the probe's step (its loss read, its finite checks) is in the counts of
operators too; host synchronisations are counted only where a line of the training file asked for them.
"""

from __future__ import annotations

import statistics
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker

from ..errors import TrainingFileError
from ..precision.autocast_policy import emulated_low_dtype
from .speed_changes import (
    TENSOR_CORE_MULTIPLE,
    WARMUP_STEPS,
    ChangeMeasured,
    CompileModule,
    FuseOptimizer,
    PadLinear,
    SpeedChange,
    measure_change,
    padded_size,
    step_seconds,
)

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)
CONVOLUTIONS = {aten.convolution, aten._convolution, aten.convolution_backward}
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, *CONVOLUTIONS}
"""The products tensor cores run (a convolution's backward too: it is one operator, where a linear layer's backward
is two ``mm``)."""
MASKED_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
"""Indexing that waits for the host where an index is a boolean mask: the result's size is the mask's count."""
SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_consecutive}
"""Operators whose result the host waits for: ``.item()``, ``float(t)``, ``if t:``, printing a tensor, ``nonzero``,
boolean indexing (a data-dependent size)."""
PAD_WORTH = 0.01
"""A module's misaligned products worth padding: at least this share of the step's FLOPs (a 1-output gate is not)."""
SMALL_OPS_WORTH_FUSING = 12
"""A module running this many element-wise operators a step is a swarm worth fusing."""
SCALER_SOURCE = str(Path("torch", "amp", "grad_scaler.py"))
PLUMBING = tuple(str(Path("torch", *part)) for part in (("_compile.py",), ("_dynamo", "eval_frame.py")))
"""Frames between an operator and the counter's dispatch: dynamo's wrappers of the mode's own code."""
TIMED_STEPS = 6


@dataclass
class StepCounts:
    """What one AMP step ran, operator by operator (device-independent)."""

    flops_half: int = 0
    flops_fp32: int = 0
    fp32_ops: Counter[str] = field(default_factory=Counter)
    """FLOPs of the operators that ran in fp32 under autocast, by operator."""
    casts: int = 0
    cast_bytes: int = 0
    elementwise: int = 0
    elementwise_bytes: int = 0
    misaligned: list[dict[str, Any]] = field(default_factory=list)
    """Half-precision matrix products with a dimension that is not a multiple of 8: ``op``, ``module``, ``shape``,
    ``flops``."""
    syncs: Counter[str] = field(default_factory=Counter)
    """Host synchronisations per line of the training file (``file:line  code``)."""
    scaler_syncs: int = 0
    """Host synchronisations inside ``GradScaler.step`` (its skip check reads ``found_inf`` on the host, for an
    optimizer that is not fused; a fused one takes it on the device): not a line of the file to move."""
    elementwise_by_module: Counter[str] = field(default_factory=Counter)
    """Element-wise operators per module of the model (forward and backward), the optimizer's under ``(outside)``."""

    @property
    def half_share(self) -> float:
        total = self.flops_half + self.flops_fp32
        return self.flops_half / total if total else 0.0


class StepCounter(TorchDispatchMode):
    """Counts every aten operator of what runs inside it (see :class:`StepCounts`); ``user_file``: the training
    file, whose lines a host synchronisation is charged to."""

    def __init__(self, user_file: Path, low: torch.dtype | None = None, host_tensors: set[int] | None = None):
        super().__init__()
        self.user_file = str(user_file.resolve())
        self.low = low
        """The AMP dtype: on a CPU the doctor emulates half-precision products in fp32 on rounded inputs."""
        self.host_tensors = host_tensors or set()
        """The ``id`` of tensors a GPU training keeps on the host (see :func:`host_resident`): reading one waits for
        nothing."""
        self.counts = StepCounts()
        self.modules = ModuleTracker()

    def __enter__(self) -> StepCounter:
        self.modules.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.modules.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._count(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - an operator the counts cannot read is left out, the step goes on
            pass
        return out

    def _count(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        packet = func.overloadpacket
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        floating = [t for t in inputs if t.is_floating_point()]
        emulated = emulated_low_dtype()
        dtype = emulated or (floating[0].dtype if floating else None)
        if packet in SYNCS and not (inputs and id(inputs[0]) in self.host_tensors) or _masked(packet, args):
            self._sync()
        if emulated is not None and packet is aten._to_copy:
            return  # the emulation's own rounding: a GPU's tensor core reads half precision as it is
        if packet in GEMMS and dtype not in HALF and self._holds_low(floating):
            dtype = self.low  # a product's backward in the emulation: fp32 tensors holding half-precision values
        if packet is aten._to_copy and floating and outputs and outputs[0].dtype != floating[0].dtype:
            self.counts.casts += 1
            self.counts.cast_bytes += outputs[0].nbytes
        if packet in flop_registry:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            if dtype in HALF:
                self.counts.flops_half += flops
                if packet in GEMMS:
                    self._gemm(packet, floating, flops)
            else:
                self.counts.flops_fp32 += flops
                self.counts.fp32_ops[packet.__name__] += flops
        elif torch.Tag.pointwise in func.tags and outputs:
            self.counts.elementwise += 1
            self.counts.elementwise_bytes += sum(t.nbytes for t in inputs + outputs)
            self.counts.elementwise_by_module[self._module() or "(outside)"] += 1

    def _holds_low(self, tensors: list[torch.Tensor]) -> bool:
        """Every floating input holds only values the AMP dtype holds exactly (and so came from it)."""
        if self.low is None or not tensors:
            return False
        return all(bool(torch.equal(t, t.to(self.low).to(t.dtype))) for t in tensors)

    def _gemm(self, packet: Any, tensors: list[torch.Tensor], flops: int) -> None:
        dims = _gemm_dims(packet, tensors)
        if dims and any(d % TENSOR_CORE_MULTIPLE for d in dims.values()):
            module = self._module() or "(model)"
            self.counts.misaligned.append({"op": packet.__name__, "module": module, "shape": dims, "flops": flops})

    def _module(self) -> str:
        """The deepest module running now, by its path in the model ("" for the root or none)."""
        deepest = max((p for p in self.modules.parents if p != "Global"), key=len, default="")
        return deepest.partition(".")[2]  # the tracker names the root by its class

    def _sync(self) -> None:
        stack = traceback.extract_stack()
        if _asked_by(stack).endswith(SCALER_SOURCE):  # GradScaler's own read, not an optimizer's step inside it
            self.counts.scaler_syncs += 1
            return
        frames = [f for f in stack if f.filename == self.user_file]
        if frames:
            frame = frames[-1]
            self.counts.syncs[f"{Path(frame.filename).name}:{frame.lineno}  {(frame.line or '').strip()}"] += 1


def _asked_by(stack: list[traceback.FrameSummary]) -> str:
    """The file of the code that asked for the operator: the innermost frame outside this counter and the dispatch
    machinery between them."""
    for frame in reversed(stack):
        if frame.filename != __file__ and not frame.filename.endswith(PLUMBING):
            return frame.filename
    return ""


def _masked(packet: Any, args: Any) -> bool:
    """``x[mask]`` or ``x[mask] = y``: indexing by a boolean mask, whose size the host must read. ``x[mask] =
    scalar`` is not: PyTorch fills it (``masked_fill_``) without reading the mask's count."""
    if packet not in MASKED_INDEXING or len(args) < 2:
        return False
    masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    if not masks:
        return False
    if packet is not aten.index and len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].numel() == 1:
        return len(args[1]) != 1  # one mask and one value: a masked fill
    return True


def _gemm_dims(packet: Any, tensors: list[torch.Tensor]) -> dict[str, int] | None:
    """The dimensions a tensor core tiles: M, K, N of a matrix product (the batch left out), channels of a conv."""
    if packet in CONVOLUTIONS and len(tensors) >= 2:
        weight = tensors[2] if packet is aten.convolution_backward else tensors[1]  # after the output's gradient
        return {"out_channels": weight.shape[0], "in_channels": weight.shape[1]}
    mats = tensors[-2:] if packet in (aten.addmm, aten.baddbmm) else tensors[:2]
    if len(mats) < 2 or mats[0].dim() < 2 or mats[1].dim() < 2:
        return None
    return {"M": mats[0].shape[-2], "K": mats[0].shape[-1], "N": mats[1].shape[-1]}


@dataclass
class Advice:
    """One change, ranked by its estimated effect, with the arithmetic shown."""

    what: str
    """The change, naming its layer or line."""
    why: str
    """What was counted, with its share."""
    effect: float
    """Its estimated share of the step's work (0..1): the larger, the earlier it is listed."""
    change: SpeedChange | None = None
    """How the doctor applies it to its own copy of the training to measure it (None: it rewrites the file's code,
    which the doctor does not)."""
    measured: ChangeMeasured | None = None
    """The AMP step with the change against the step as it is (see :mod:`fp16doctor.measure.speed_changes`); None where not
    measured."""
    not_measured: str | None = None
    """Why it was not measured, where it was asked to be."""

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "why": self.why,
            "effect": round(self.effect, 4),
            "change": self.change.to_json() if self.change is not None else None,
            "measured": self.measured.to_json() if self.measured is not None else None,
            "not_measured": self.not_measured,
        }


@dataclass
class SpeedReport:
    """What ``speed`` measured and counted; the CLI renders it."""

    JSON_KEY_DOCS: ClassVar[dict[str, str]] = {
        "timing": "Per mode (``fp32``, ``amp``): ``step_ms`` (median), ``peak_memory_bytes`` (CUDA only, else "
        "null), and ``device``; on a CPU the times do not predict a GPU's.",
        "flops": "The AMP step's FLOPs (matrix products, convolutions) by the precision they ran in: ``half``, "
        "``fp32``.",
        "half_flop_share": "The share of the AMP step's FLOPs (matrix products, convolutions) run in fp16/bf16.",
        "fp32_ops": "The operators autocast left in fp32, with their FLOPs.",
        "misaligned_gemms": "Half-precision matrix products with a dimension not a multiple of 8: ``op``, "
        "``module``, ``shape``, ``flops``.",
        "host_syncs": "Host synchronisations per AMP step by line of the training file: ``line``, ``count``.",
        "scaler_syncs": "Host synchronisations per AMP step inside ``GradScaler.step`` (its skip check, read on the "
        "host for an optimizer that is not fused).",
        "casts": "Casts between floating dtypes in the AMP step: ``count``, ``bytes``.",
        "elementwise": "Element-wise operators in the AMP step: ``count``, ``bytes`` moved, ``by_module``.",
        "speedup": "FP32's step time over AMP's (above 1: AMP is faster); null where either is missing.",
    }

    device: str
    """Where the step ran: ``cuda`` or ``cpu``."""
    timing: dict[str, dict[str, Any]]
    counts: StepCounts
    optimizer: dict[str, Any]
    """``optimizers``: per optimizer, ``name``, ``class``, ``fused`` (null: the class has no fused kernel),
    ``foreach``, ``default`` (true: the file makes no optimizer, and this is the doctor's own AdamW, so no advice
    is given on it)."""
    advice: list[Advice]
    """The changes the counts call for, largest estimated effect first."""

    @property
    def speedup(self) -> float | None:
        fp32, amp = self.timing.get("fp32", {}).get("step_ms"), self.timing.get("amp", {}).get("step_ms")
        return fp32 / amp if fp32 and amp else None

    def misaligned_table(self) -> pd.DataFrame:
        return pd.DataFrame(self.counts.misaligned, columns=["op", "module", "shape", "flops"])

    def to_json(self) -> dict[str, Any]:
        c = self.counts
        return {
            "device": self.device,
            "timing": self.timing,
            "speedup": self.speedup,
            "flops": {"half": c.flops_half, "fp32": c.flops_fp32},
            "half_flop_share": round(c.half_share, 4),
            "fp32_ops": dict(c.fp32_ops.most_common()),
            "casts": {"count": c.casts, "bytes": c.cast_bytes},
            "elementwise": {
                "count": c.elementwise,
                "bytes": c.elementwise_bytes,
                "by_module": dict(c.elementwise_by_module.most_common()),
            },
            "misaligned_gemms": c.misaligned,
            "host_syncs": [{"line": line, "count": n} for line, n in c.syncs.most_common()],
            "scaler_syncs": c.scaler_syncs,
            "optimizer": self.optimizer,
            "advice": [a.to_json() for a in self.advice],
        }


def time_steps(probe: Any, device: torch.device) -> dict[str, Any]:
    """The median step time of ``probe`` after warm-up, and on CUDA its peak memory."""
    for _ in range(WARMUP_STEPS):
        probe.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = [step_seconds(probe) for _ in range(TIMED_STEPS)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_ms": statistics.median(times) * 1e3, "peak_memory_bytes": peak, "device": device.type}


def host_resident(optimizers: dict[str, torch.optim.Optimizer]) -> set[int]:
    """The ``id`` of the optimizers' step counts that live on the host in a GPU training too: a torch optimizer
    that is neither fused nor capturable keeps its ``step`` as a CPU scalar, and its ``.item()`` reads it there."""
    return {
        id(state["step"])
        for optimizer in optimizers.values()
        if not (optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].dim() == 0
    }


def optimizer_kinds(optimizers: dict[str, torch.optim.Optimizer], default: bool = False) -> list[dict[str, Any]]:
    """Per optimizer: its name, class, ``fused`` (None: the class has no fused kernel) and ``foreach``; ``default``:
    the file makes none, and this is the doctor's own AdamW."""
    return [
        {
            "name": name,
            "class": type(opt).__name__,
            "fused": bool(opt.defaults["fused"]) if "fused" in opt.defaults else None,
            "foreach": opt.defaults.get("foreach"),
            "default": default,
        }
        for name, opt in optimizers.items()
    ]


def advise(counts: StepCounts, optimizers: list[dict[str, Any]]) -> list[Advice]:
    """The changes the counts call for, ranked by their estimated share of the step's work."""
    found: list[Advice] = []
    total_flops = max(counts.flops_half + counts.flops_fp32, 1)
    for module, sizes, flops in _misaligned_by_module(counts.misaligned):
        if flops / total_flops < PAD_WORTH:
            continue
        padding = ", ".join(f"{size} to {padded_size(size)}" for size in sizes)
        found.append(
            Advice(
                f"pad the dimension(s) {padding} of module '{module}'",
                f"its half-precision products (forward and backward) have dimension(s) {', '.join(map(str, sizes))}, "
                f"not multiples of {TENSOR_CORE_MULTIPLE}: tensor cores cannot take them whole "
                f"({flops / total_flops:.0%} of the step's FLOPs)",
                flops / total_flops,
                PadLinear(module),
            )
        )
    for line, n in counts.syncs.most_common():
        found.append(
            Advice(
                f"move the host synchronisation at {line.split('  ')[0]} out of the step",
                f"`{line.split('  ', 1)[-1]}` waits for the device {n} time(s) a step: every queued kernel must "
                "finish first",
                0.05 * n,
            )
        )
    for module, n in counts.elementwise_by_module.most_common(3):
        if module != "(outside)" and n >= SMALL_OPS_WORTH_FUSING:
            found.append(
                Advice(
                    f"fuse module '{module}' (torch.compile it, or a fused kernel)",
                    f"it runs {n} element-wise operators a step (forward and backward), each a kernel of its own "
                    "that reads and writes its whole tensor",
                    n / max(counts.elementwise, 1) * 0.1,
                    CompileModule(module),
                )
            )
    for opt in optimizers:
        # None: the class has no fused kernel to ask for; the doctor's own default is not the training's optimizer
        if opt["fused"] is False and not opt.get("default"):
            found.append(
                Advice(
                    f"{opt['class']}(..., fused=True)",
                    f"optimizer '{opt['name']}' is not fused: its update runs as many small element-wise kernels "
                    f"({counts.elementwise} element-wise operators in the step, {counts.elementwise_bytes / 2**20:.1f} "
                    "MiB moved)"
                    + (
                        f", and GradScaler.step waits for the device {counts.scaler_syncs} time(s) a step to read its "
                        "skip check on the host, which a fused optimizer reads on the device"
                        if counts.scaler_syncs
                        else ""
                    ),
                    0.02 + (0.05 * counts.scaler_syncs if counts.scaler_syncs else 0.0),
                    FuseOptimizer(opt["name"]),
                )
            )
    if counts.flops_fp32 and counts.flops_fp32 / total_flops > 0.2:
        top = ", ".join(f"{op} ({flops / total_flops:.0%})" for op, flops in counts.fp32_ops.most_common(3))
        found.append(
            Advice(
                "run more of the step in half precision",
                f"{counts.flops_fp32 / total_flops:.0%} of the FLOPs stay in fp32 under autocast: {top}",
                counts.flops_fp32 / total_flops,
            )
        )
    return sorted(found, key=lambda a: -a.effect)


def _misaligned_by_module(misaligned: list[dict[str, Any]]) -> list[tuple[str, list[int], int]]:
    """Per module: its dimensions that are not multiples of 8, and its misaligned products' FLOPs, largest first."""
    sizes: dict[str, set[int]] = {}
    flops: Counter[str] = Counter()
    for gemm in misaligned:
        sizes.setdefault(gemm["module"], set()).update(d for d in gemm["shape"].values() if d % TENSOR_CORE_MULTIPLE)
        flops[gemm["module"]] += gemm["flops"]
    return [(module, sorted(sizes[module]), total) for module, total in flops.most_common(5)]


def measure_speed(bench: Any, user_file: Path, measure_advice: bool | None = None) -> SpeedReport:
    """Time FP32 and AMP on ``bench`` (a :class:`~fp16doctor.engine.probe.Workbench` with enough batches), then
    count one more step of the timed AMP probe, a steady one (its optimizer's state made, its scaler calibrated),
    and advise. ``measure_advice``: apply each piece of advice the doctor can apply and time the step with it
    (None: on CUDA only, where the times predict the training's)."""
    timing: dict[str, dict[str, Any]] = {}
    for mode in ("fp32", "amp"):
        probe = bench.probe(mode, instruments=None)
        try:
            timing[mode] = time_steps(probe, probe.device)
            _raise_failure(probe)
            if mode == "amp":
                host = host_resident(probe.optimizers.by_name)
                with StepCounter(user_file, probe.settings.low_dtype, host) as counter:
                    probe.step()
                _raise_failure(probe)
                optimizers = optimizer_kinds(probe.optimizers.by_name, default=not probe.spec.defines_optimizer)
                device = probe.device.type
        finally:
            probe.close()
    advice = advise(counter.counts, optimizers)
    if measure_advice or (measure_advice is None and device == "cuda"):
        for piece in advice:
            measure_piece(bench, piece)
    return SpeedReport(device, timing, counter.counts, {"optimizers": optimizers}, advice)


def measure_piece(bench: Any, advice: Advice) -> None:
    """``advice`` applied and timed (:func:`~.speed_changes.measure_change`), or why it cannot be."""
    if advice.change is None:
        advice.not_measured = "it changes your code, which the doctor does not rewrite"
        return
    result = measure_change(bench, advice.change)
    if isinstance(result, str):
        advice.not_measured = result
    else:
        advice.measured = result


def _raise_failure(probe: Any) -> None:
    failed = probe.failed
    if failed is not None:
        raise TrainingFileError(
            f"the training step raised {failed.exception_type}: {failed.exception}",
            location=failed.exception_location,
            hint="speed times the step as the training runs it: it must run.",
        )
