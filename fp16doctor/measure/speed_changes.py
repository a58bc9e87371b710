"""``speed``'s advice, applied to the doctor's copy of the training and measured.

A piece of advice is a claim ("this would make the step faster") until the step runs with it. Three kinds can be
applied without editing the training file:

* **pad a linear layer** to dimensions tensor cores take whole: the layer is replaced by one whose weight is
  zero-padded (its input zero-padded where ``in_features`` is padded) and whose output is sliced back, so the rest of
  the model, the loss and the optimizer see the shapes they expect;
* **compile a module** (``module.compile()``): its element-wise swarm fused into a few kernels;
* **fuse an optimizer**: its parameter groups switched to ``fused=True``, as the constructor would have made them.

Each is measured the way a benchmark is: the AMP step as the file has it and the AMP step with the change, two
probes from the same weights over the same batches, stepped in turn (interleaved, so a machine's drift falls on
both), after the same warm-up (which a compile spends compiling). The ratio is taken round by round; its median is
the speedup, its quartiles the spread. On a CPU the measurement is made too, and labelled: a CPU neither has tensor
cores nor runs half-precision products natively, so it does not predict a GPU.

The other advice (a host synchronisation, which is a line of the file; the fp32 share autocast leaves) changes the
user's code, which the doctor does not rewrite: it is left unmeasured, and says why.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import DoctorError, first_line
from ..tensors import OUT_OF_MEMORY

TENSOR_CORE_MULTIPLE = 8
"""fp16/bf16 matrix dimensions tensor cores take whole: multiples of 8 (of 64 for the best tiles)."""
ROUNDS = 8
"""Timed rounds, each one step of either probe, the order alternating."""
WARMUP_STEPS = 2
"""Untimed steps of a timed probe first: the optimizer's state made, the scaler calibrated, a compile done."""


class PaddedLinear(nn.Linear):
    """``linear`` with its output and input features zero-padded to ``out_to`` and ``in_to``: the same outputs,
    sliced back to ``linear``'s, computed by a product whose dimensions tensor cores take whole. Still an
    ``nn.Linear``: a file that groups its optimizer's parameters by ``isinstance(m, nn.Linear)`` (minGPT's weight
    decay) groups it as it grouped the layer."""

    def __init__(self, linear: nn.Linear, out_to: int, in_to: int) -> None:
        weight = linear.weight.detach()
        super().__init__(in_to, out_to, bias=linear.bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: linear.out_features, : linear.in_features] = weight
            if self.bias is not None and linear.bias is not None:
                self.bias.zero_()
                self.bias[: linear.out_features] = linear.bias.detach()
        self.out_features = linear.out_features  # what the layer hands on, as the file's code reads it
        self.in_padding = in_to - linear.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_padding:
            x = F.pad(x, (0, self.in_padding))
        return F.linear(x, self.weight, self.bias)[..., : self.out_features]


@dataclass(frozen=True)
class SpeedChange:
    """One piece of advice as the doctor applies it to its own copy of the training."""

    JSON_KEY_DOCS: ClassVar[dict[str, str]] = {
        "kind": "``pad-linear`` (a linear layer zero-padded to multiples of 8, its output sliced back), "
        "``compile-module`` (``module.compile()``) or ``fuse-optimizer`` (its groups made ``fused=True``)."
    }
    KIND: ClassVar[str] = ""
    target: str
    """The module's path (as ``named_modules()`` names it) or the optimizer's name."""

    def applicable(self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> str | None:
        """Why the change cannot be applied to this training (None: it can)."""
        return None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The model with the change made, in place, before the optimizers are built over its parameters."""
        return model

    def on_optimizers(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        """The change made to the built optimizers."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "target": self.target}


@dataclass(frozen=True)
class PadLinear(SpeedChange):
    KIND: ClassVar[str] = "pad-linear"

    def applicable(self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> str | None:
        module = _submodule(model, self.target)
        if not isinstance(module, nn.Linear):
            kind = type(module).__name__ if module is not None else "model's own forward"
            return f"'{self.target or 'the model'}' is a {kind}: the doctor pads only nn.Linear layers"
        if _shared(model, module.weight):
            return (
                f"'{self.target}'s weight is shared with another module (a head tied to its embedding): padding it "
                "alone would untie them"
            )
        if padded_features(module) == (module.out_features, module.in_features):
            return (
                f"'{self.target}' has {module.in_features} input and {module.out_features} output features, "
                f"multiples of {TENSOR_CORE_MULTIPLE}: the misaligned dimension is the batch's rows (batch x tokens), "
                "which the data sets"
            )
        return None

    def wrap_model(self, model: nn.Module) -> nn.Module:
        parent, _, name = self.target.rpartition(".")
        linear = model.get_submodule(self.target)
        assert isinstance(linear, nn.Linear)  # applicable() said so
        model.get_submodule(parent).register_module(name, PaddedLinear(linear, *padded_features(linear)))
        return model


def padded_size(size: int) -> int:
    """The size to pad to: a multiple of 64 for a large dimension (a vocabulary of 50257 to 50304), else of 8."""
    step = 64 if size >= 512 else TENSOR_CORE_MULTIPLE
    return math.ceil(size / step) * step


def padded_features(linear: nn.Linear) -> tuple[int, int]:
    """``linear``'s output and input features, each padded where it is not a multiple of 8."""
    return tuple(  # type: ignore[return-value]
        padded_size(n) if n % TENSOR_CORE_MULTIPLE else n for n in (linear.out_features, linear.in_features)
    )


@dataclass(frozen=True)
class CompileModule(SpeedChange):
    KIND: ClassVar[str] = "compile-module"

    def applicable(self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> str | None:
        return None if _submodule(model, self.target) is not None else f"the model has no module '{self.target}'"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model.get_submodule(self.target).compile()
        return model


@dataclass(frozen=True)
class FuseOptimizer(SpeedChange):
    KIND: ClassVar[str] = "fuse-optimizer"

    def applicable(self, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> str | None:
        optimizer = optimizers.get(self.target)
        if optimizer is None:
            return f"the training has no optimizer '{self.target}'"
        params = [p for group in optimizer.param_groups for p in group["params"]]
        probe = torch.zeros(1, device=params[0].device if params else "cpu", requires_grad=True)
        try:  # the constructor knows which classes, devices and dtypes have a fused kernel
            type(optimizer)([probe], fused=True)  # type: ignore[call-arg]
        except (TypeError, ValueError, RuntimeError) as exc:
            return f"{type(optimizer).__name__} takes no fused=True here ({str(exc).splitlines()[0][:120]})"
        return None

    def on_optimizers(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        optimizer = optimizers[self.target]
        for settings in [optimizer.defaults, *optimizer.param_groups]:
            settings["fused"], settings["foreach"] = True, False
        # what the constructor sets with fused=True: GradScaler hands it the scale instead of unscaling first
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def _shared(model: nn.Module, tensor: torch.Tensor) -> bool:
    return sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is tensor) > 1


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


@dataclass
class ChangeMeasured:
    """The AMP step with one change against the step as the file has it, measured in turn."""

    before_ms: float
    """The median step time as the file has it."""
    after_ms: float
    """The median step time with the change."""
    speedup: float
    """The median, round by round, of the time before over the time after (above 1: the change is faster)."""
    spread: tuple[float, float]
    """The quartiles of those ratios."""
    rounds: int
    """The timed rounds, each one step as it is and one with the change."""
    device: str
    """``cuda`` or ``cpu`` (a CPU's measurement does not predict a GPU)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "before_ms": round(self.before_ms, 4),
            "after_ms": round(self.after_ms, 4),
            "speedup": round(self.speedup, 4),
            "spread": [round(q, 4) for q in self.spread],
            "rounds": self.rounds,
            "device": self.device,
        }


def measure_change(bench: Any, change: SpeedChange) -> ChangeMeasured | str:
    """``change`` applied to a fresh AMP probe of ``bench`` and timed against one without it; where it cannot be
    applied (or the changed step fails), why, as a sentence."""
    states: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    probes: list[Any] = []
    try:
        with bench.spec.own_file_state(states[0]):
            probes.append(bench.probe("amp", instruments=None))
        reason = change.applicable(probes[0].model, probes[0].optimizers.by_name)
        if reason is not None:
            return reason
        with bench.spec.own_file_state(states[1]):
            probes.append(bench.probe("amp", instruments=None, parallelize=change.wrap_model))
        change.on_optimizers(probes[1].optimizers.by_name)
        return _timed_in_turn(bench.spec, probes, states)
    except (DoctorError, *OUT_OF_MEMORY) as exc:  # the changed training's own failure is what was measured
        return f"the training with the change could not run ({type(exc).__name__}: {first_line(exc)})"
    finally:
        for probe in probes:
            probe.close()


def _timed_in_turn(spec: Any, probes: list[Any], states: tuple[dict[str, Any], ...]) -> ChangeMeasured | str:
    """Each probe's warm-up, then rounds of one step each, the order alternating from round to round; each probe
    steps with its own module-level state of the file (a micro-batch counter counts its own steps)."""

    def seconds(which: int) -> float:
        with spec.own_file_state(states[which]):
            return step_seconds(probes[which])

    for _ in range(WARMUP_STEPS):
        seconds(0)
        seconds(1)
    before, after = [], []
    for round_ in range(ROUNDS):
        if round_ % 2:
            after.append(seconds(1))
            before.append(seconds(0))
        else:
            before.append(seconds(0))
            after.append(seconds(1))
    as_is, changed = probes
    if changed.failed is not None:
        return f"the step with the change raised {changed.failed.exception_type}: {changed.failed.exception}"
    if as_is.failed is not None:
        return f"the step raised {as_is.failed.exception_type}: {as_is.failed.exception}"
    ratios = sorted(b / a for b, a in zip(before, after))
    quartiles = statistics.quantiles(ratios, n=4)
    return ChangeMeasured(
        before_ms=statistics.median(before) * 1e3,
        after_ms=statistics.median(after) * 1e3,
        speedup=statistics.median(ratios),
        spread=(quartiles[0], quartiles[2]),
        rounds=ROUNDS,
        device=as_is.device.type,
    )


def step_seconds(probe: Any) -> float:
    """One step of ``probe``, timed; on CUDA from an idle device to the step's last kernel."""
    synchronise = torch.cuda.synchronize if probe.device.type == "cuda" else (lambda *_: None)
    synchronise(probe.device)
    began = time.perf_counter()
    probe.step()
    synchronise(probe.device)
    return time.perf_counter() - began
