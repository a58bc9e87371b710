"""A live watch on a running training: cheap per-step numbers, alarms, and replay capsules.

The engine under the Hugging Face and Lightning callbacks (``fp16doctor.live.integrations``),
usable from a hand-written loop too. Per optimizer step, at one host
synchronisation, it records the loss, the unscaled global gradient norm, the
loss scale, whether the GradScaler skips the step (its inf/NaN check: the
gradients are non-finite), the learning rate, and per layer whether the
gradients are finite and their largest magnitude. It raises an alarm on the
first non-finite loss or gradient, a streak of skipped steps, a scale
collapsing towards its minimum, or a loss spike; on an alarm it writes a
*replay capsule*: the model and optimizer state the bad step started from, its
batch(es), the scaler's state, RNG states, the config, and a small training
file that rebuilds it all, so that ``fp16doctor diagnose --capsule DIR``
diagnoses hours-into-a-run failures offline, in seconds, on CPU.

The watch is called *before* the optimizer step, where everything an alarm
needs is known and the weights have not moved yet: the capsule holds exactly
the state the failing step started from.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine.rng import callers_rng_kept, rng_state
from ..files import atomic_torch_save, atomic_write_text
from ..tensors import grad_values
from ..userfile.batches import map_tensors

ALARMS = ("nonfinite", "skip-streak", "scale-collapse", "loss-spike")


@dataclass
class WatchOptions:
    """When the watch alarms and what it does then."""

    capsule_dir: Path = Path("fp16doctor_capsules")
    """Where replay capsules are written (one folder per alarm)."""
    stop_on_alarm: bool = True
    """Stop the training at the first alarm (the callbacks ask their trainer to stop)."""
    skip_streak: int = 5
    """This many optimizer steps skipped in a row is an alarm (a settling scale skips a few, not in a row this long)."""
    min_scale: float = 1.0
    """A loss scale at or below this has collapsed: the gradients overflow even unscaled."""
    spike_factor: float = 10.0
    """A loss above this multiple of the recent median is a spike."""
    spike_window: int = 20
    """Steps in the running median the spike compares against (and the earliest step that can spike)."""
    alarms: tuple[str, ...] = ALARMS
    """Which alarms are raised."""


@dataclass
class StepNumbers:
    """What the watch measured at one optimizer step."""

    step: int
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    lr: float
    nonfinite_layers: list[str] = field(default_factory=list)
    largest_layer: str | None = None
    largest_abs: float = 0.0


@dataclass
class Alarm:
    """Why the watch raised, at which step, and where its capsule is."""

    kind: str
    step: int
    message: str
    capsule: Path | None = None

    def pointer(self) -> str:
        """The one line a user sees."""
        where = f" Capsule: {self.capsule}. Diagnose it: fp16doctor diagnose --capsule {self.capsule}" if self.capsule else ""
        return f"fp16doctor: {self.kind} at optimizer step {self.step}: {self.message}.{where}"


class Watch:
    """Attach to a model; feed it micro-batches and losses; call :meth:`before_optimizer_step` once per optimizer step."""

    def __init__(self, model: torch.nn.Module, options: WatchOptions | None = None, framework: str = "torch",
                 dtype: str | None = None):
        self.model = model
        self.options = options or WatchOptions()
        self.framework = framework
        self.dtype = dtype
        """The low precision the training runs in (float16 / bfloat16); None: float16 with a scaler, else bfloat16."""
        self.history: list[StepNumbers] = []
        self.alarm: Alarm | None = None
        self._batches: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._streak = 0
        self._names = {p: n for n, p in model.named_parameters()}

    # --- feeding -------------------------------------------------------------------------------------
    def capture_batch(self, batch: Any) -> None:
        """A micro-batch of the current optimizer step (kept on the CPU until the step is checked)."""
        self._batches.append(map_tensors(batch, _cpu_copy))

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """A micro-batch's loss (a device tensor: no synchronisation here)."""
        self._losses.append(loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss)))

    # --- the check -------------------------------------------------------------------------------------
    def before_optimizer_step(self, step: int, optimizer: torch.optim.Optimizer, scaler: Any = None,
                              grads_scaled: bool = False) -> Alarm | None:
        """Measure this optimizer step (one host sync), decide on an alarm, write its capsule; then forget the step.

        The training's random generators are left as they were (see :func:`callers_rng_kept`)."""
        with callers_rng_kept():
            return self._check_step(step, optimizer, scaler, grads_scaled)

    def _check_step(self, step: int, optimizer: torch.optim.Optimizer, scaler: Any, grads_scaled: bool) -> Alarm | None:
        try:
            numbers = self._measure(step, optimizer, scaler, grads_scaled)
            self.history.append(numbers)
            kind, message = self._decide(numbers)
            if kind is not None and self.alarm is None:
                self.alarm = Alarm(kind, step, message)
                self.alarm.capsule = self.write_capsule(optimizer, scaler, numbers)
                return self.alarm
            return None
        finally:
            self._batches, self._losses = [], []

    def _measure(self, step: int, optimizer: torch.optim.Optimizer, scaler: Any, grads_scaled: bool) -> StepNumbers:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
        divide = scale if grads_scaled else 1.0
        device = params[0].grad.device if params else torch.device("cpu")
        grads = [grad_values(p) for p in params]
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads)]) if grads else torch.zeros(0, device=device)
        peaks = torch.stack([n.float() for n in torch._foreach_norm(grads, ord=math.inf)]) if grads else torch.zeros(0, device=device)
        loss = torch.stack([l.to(device) for l in self._losses]).sum() if self._losses else torch.tensor(math.nan, device=device)
        values = torch.cat([loss.reshape(1), norms.pow(2).sum().sqrt().reshape(1), peaks]).tolist()  # the one transfer
        loss_value, norm, peak_values = values[0], values[1] / divide, [v / divide for v in values[2:]]
        names = [self._names.get(p, "?") for p in params]
        bad = [n for n, v in zip(names, peak_values) if not math.isfinite(v)]
        finite = [(v, n) for n, v in zip(names, peak_values) if math.isfinite(v)]
        largest = max(finite, default=(0.0, None))
        return StepNumbers(step=step, loss=loss_value, grad_norm=norm, loss_scale=scale,
                           skipped=bool(bad) and scaler is not None and scaler.is_enabled(),
                           lr=float(optimizer.param_groups[0]["lr"]), nonfinite_layers=bad[:20],
                           largest_layer=largest[1], largest_abs=largest[0])

    def _decide(self, n: StepNumbers) -> tuple[str | None, str]:
        wanted = self.options.alarms
        self._streak = self._streak + 1 if n.skipped else 0
        if "nonfinite" in wanted and not math.isfinite(n.loss):
            return "nonfinite", f"the loss is {n.loss}"
        if "nonfinite" in wanted and n.nonfinite_layers and not n.skipped:  # no scaler caught them: they reach the weights
            return "nonfinite", f"non-finite gradients in {', '.join(n.nonfinite_layers[:3])}"
        if "skip-streak" in wanted and self._streak >= self.options.skip_streak:
            return "skip-streak", f"{self._streak} optimizer steps skipped in a row (inf/NaN gradients in {', '.join(n.nonfinite_layers[:3])})"
        if "scale-collapse" in wanted and n.skipped and n.loss_scale <= self.options.min_scale:
            return "scale-collapse", f"the loss scale fell to {n.loss_scale:g} and the gradients still overflow"
        recent = [h.loss for h in self.history[-self.options.spike_window - 1:-1] if math.isfinite(h.loss)]
        if "loss-spike" in wanted and len(recent) >= self.options.spike_window // 2 and math.isfinite(n.loss):
            median = statistics.median(recent)
            if median > 0 and n.loss > self.options.spike_factor * median:
                return "loss-spike", f"the loss {n.loss:.4g} is {n.loss / median:.1f}x the recent median {median:.4g}"
        return None, ""

    # --- the capsule -------------------------------------------------------------------------------------
    def write_capsule(self, optimizer: torch.optim.Optimizer, scaler: Any, numbers: StepNumbers) -> Path:
        """The state this step started from, its batches and a training file that rebuilds them (atomic writes)."""
        folder = Path(self.options.capsule_dir) / f"step_{numbers.step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the user's optimizer
        cls = type(inner)
        enabled = scaler is not None and scaler.is_enabled()
        state = {
            "format": 1, "framework": self.framework, "step": numbers.step,
            "model": map_tensors(dict(self.model.state_dict()), _cpu_copy),
            "optimizer": map_tensors(inner.state_dict(), _cpu_copy), "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
            "optimizer_defaults": constructor_settings(inner),
            "scaler": scaler.state_dict() if enabled else None, "batches": self._batches, "rng": rng_state(),
            "alarm": {"kind": self.alarm.kind if self.alarm else None, "message": self.alarm.message if self.alarm else ""},
            "history": [asdict(h) for h in self.history[-50:]], "import_paths": import_roots(self.model),
        }
        atomic_torch_save(folder / "capsule.pt", state)
        atomic_torch_save(folder / "model.pt", _detached_module(self.model))
        dtype = self.dtype or ("float16" if enabled else "bfloat16")
        config = capsule_config(numbers, scaler, len(self._batches), dtype)
        atomic_write_text(folder / "config.json", json.dumps(config, indent=2))
        atomic_write_text(folder / "train_capsule.py", capsule_training_file(numbers, config, self.framework))
        return folder


def constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (plain values only: the capsule loads weights_only)."""
    import inspect

    try:
        accepted = set(inspect.signature(type(optimizer).__init__).parameters)
    except (TypeError, ValueError):
        accepted = set(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items()
            if k in accepted and isinstance(v, (bool, int, float, str, tuple, type(None)))}


def import_roots(model: torch.nn.Module) -> list[str]:
    """The folders from which the model's own classes import (``pkg.mod`` in ``/x/pkg/mod.py`` -> ``/x``).

    The capsule's training file puts them on ``sys.path`` so that ``model.pt`` unpickles
    wherever the diagnosis runs; installed libraries import as they are.
    """
    import sys

    roots: list[str] = []
    for module in {type(m).__module__ for m in model.modules()}:
        if module == "__main__":
            continue  # a class defined in the script that was run cannot be imported again: see the README
        file = getattr(sys.modules.get(module), "__file__", None)
        if not file or "site-packages" in file or "dist-packages" in file:
            continue
        root = Path(file).resolve().parent
        for _ in range(module.count(".") + (1 if Path(file).name == "__init__.py" else 0)):
            root = root.parent
        if str(root) not in roots:
            roots.append(str(root))
    return roots


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _detached_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module without a reference to its trainer (Lightning keeps one), ready to pickle."""
    trainer = getattr(model, "_trainer", None)
    if trainer is None:
        return model
    import copy

    clone = copy.copy(model)
    clone.__dict__["_trainer"] = None
    return clone


def capsule_config(numbers: StepNumbers, scaler: Any, batches: int, dtype: str) -> dict[str, Any]:
    """The doctor's config for the capsule: the scaler as it was at the alarm, enough steps to watch it fail."""
    enabled = scaler is not None and scaler.is_enabled()
    config: dict[str, Any] = {"steps": max(4, batches), "device": "cpu", "dtype": dtype}
    if enabled:
        config["scaler"] = {"enabled": True, "init_scale": float(numbers.loss_scale),
                            "growth_factor": float(scaler.get_growth_factor()), "backoff_factor": float(scaler.get_backoff_factor()),
                            "growth_interval": int(scaler.get_growth_interval())}
    return config


LIGHTNING_LOSS = '''

def loss(model, batch):
    """Lightning: the module's own training_step gives the loss."""
    out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out
'''


def capsule_training_file(numbers: StepNumbers, config: dict[str, Any], framework: str) -> str:
    """A training file that rebuilds the capsule: the model as trained, the optimizer state, the step's batches."""
    head = textwrap.dedent(f'''\
        """Replay capsule written by fp16doctor's watch at optimizer step {numbers.step} ({framework}).

        Diagnose it: fp16doctor diagnose --capsule <this folder>
        model.pt holds the module as it was trained (its classes must be importable where you run this);
        capsule.pt (torch.load(..., weights_only=True)) the weights the step started from, the optimizer
        and scaler state, the step's batches and RNG states.
        """

        import importlib
        import sys
        from pathlib import Path

        import torch

        HERE = Path(__file__).resolve().parent
        STATE = torch.load(HERE / "capsule.pt", weights_only=True)
        CONFIG = {config!r}
        sys.path[:0] = [p for p in STATE["import_paths"] if p not in sys.path]   # where the model's classes live


        def model():
            net = torch.load(HERE / "model.pt", weights_only=False)
            net.load_state_dict(STATE["model"])
            return net


        def data():
            return list(STATE["batches"])


        def optimizer(params):
            module, name = STATE["optimizer_class"].rsplit(".", 1)
            opt = getattr(importlib.import_module(module), name)(params, **STATE["optimizer_defaults"])
            try:
                opt.load_state_dict(STATE["optimizer"])   # the moments the failing step started from
            except (ValueError, KeyError):
                pass
            return opt
        ''')
    return head + (LIGHTNING_LOSS if framework == "lightning" else "")


def watch_step(watch: Watch, stop: Callable[[], None]) -> Callable[[Alarm | None], None]:
    """What a callback does with an alarm: print the pointer, then stop the training if configured."""

    def handle(alarm: Alarm | None) -> None:
        if alarm is None:
            return
        print(alarm.pointer(), flush=True)
        if watch.options.stop_on_alarm:
            stop()

    return handle
