"""A trained state the probes start from: a checkpoint a failed run left (``diagnose --from-checkpoint``).

Some faults need a trained state: a loss scale grown to 2^20 after thousands of clean steps, weights grown large,
an optimizer's second moments near zero. Probes that start from initialisation never see them. A checkpoint holds
that state; every probe then starts from its model, optimizer, scaler and scheduler state, and the data continues
from its step.

Layouts read:

* a ``torch.save`` dict with the usual keys (``model``/``state_dict``/``model_state_dict``, ``optimizer`` or
  ``optimizers`` (one state, a list, or a dict by name), ``scaler``, ``lr_scheduler``/``scheduler``,
  ``step``/``global_step``), or a bare state dict of the model;
* a Hugging Face ``Trainer`` checkpoint folder (``checkpoint-N/``: ``model.safetensors`` or ``pytorch_model.bin``,
  ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``trainer_state.json``);
* a Lightning ``.ckpt`` (``state_dict``, every one of ``optimizer_states`` and ``lr_schedulers``, the
  ``MixedPrecision`` scaler state, ``global_step``).

Loading is safe: ``torch.load(..., weights_only=True)``. A checkpoint that pickles more than tensors and plain
containers is refused with the global it needs, unless the user trusts it (``--trust-checkpoint``).
"""

from __future__ import annotations

import json
import numbers
import pickle
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, SupportsInt, cast

import torch

from ..errors import CheckpointError

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "net", "module")
OPTIMIZER_KEYS = ("optimizers", "optimizer_states", "optimizer", "optimizer_state_dict", "optim")
"""Every optimizer's states first (a checkpoint that keeps both, as ``fp16doctor train``'s does, keeps the first
optimizer's alone under ``optimizer``)."""
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp", "MixedPrecision", "native_amp_scaling_state")
SCHEDULER_KEYS = ("schedulers", "lr_schedulers", "lr_scheduler", "scheduler", "scheduler_state_dict")
STEP_KEYS = ("global_step", "step", "iteration", "iter")
RNG_KEYS = ("rng_state", "rng_states", "rng")
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
HF_RNG = ("rng_state.pth", "rng_state_0.pth")
"""Hugging Face's Trainer saves each process's generators beside the weights (rank 0's first)."""


@dataclass
class TrainedStart:
    """The trained state every probe starts from, and the step the data continues from."""

    source: Path
    layout: str
    """``torch.save dict``, ``state dict``, ``Hugging Face checkpoint`` or ``Lightning checkpoint``."""
    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]] | dict[str, dict[str, Any]]
    """Every optimizer state the checkpoint holds: in the order the training made its optimizers (Lightning's
    ``optimizer_states``, a list, or one), or by name (a dict of states, named as ``optimizers(model)`` names
    them); empty: none."""
    scaler: dict[str, Any] | None
    schedulers: list[dict[str, Any]]
    """Every scheduler state, in the order the training made its schedulers."""
    step: int
    """The optimizer step the data continues from: the checkpoint's own (``--from-step`` where given)."""
    rng: dict[str, Any] | None = None
    """The training's random generators when it was saved, as Hugging Face's ``rng_state.pth`` keeps them (``cpu``:
    torch's CPU generator; ``python``, ``numpy`` where kept); None where the checkpoint holds none."""
    saved_step: int | None = None
    """The step the checkpoint says it was taken at (None: it says none)."""

    def model_state_for(self, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's weights under the keys the file's model has (``expected``: its state dict): the
        checkpoint's, less one wrapper's prefix (``module.`` of DDP, ``_orig_mod.`` of torch.compile, ``model.`` of
        a LightningModule). Keys the model lacks under that prefix, several prefixes that would fit, and shapes
        that differ are a checkpoint of another model."""
        wanted = set(expected)
        prefixes = _prefixes(set(self.model), wanted)
        if len(prefixes) != 1:
            raise self._misfit(wanted, prefixes)
        prefix = prefixes[0]
        under = {k[len(prefix) :] for k in self.model if k.startswith(prefix)}
        if under - wanted:
            raise self._misfit(wanted, prefixes, unexpected=sorted(prefix + k for k in under - wanted))
        state = {k: self.model[prefix + k] for k in wanted}
        differ = [
            f"{k}: {list(state[k].shape)} in the checkpoint, {list(expected[k].shape)} in the model"
            for k in sorted(wanted)
            if isinstance(state[k], torch.Tensor) and state[k].shape != expected[k].shape
        ]
        if differ:
            raise CheckpointError(
                f"the checkpoint '{self.source}' does not fit this model's shapes ({_few(differ)}).",
                hint="The checkpoint must be one of the model that model() builds (same shapes).",
            )
        return state

    def _misfit(self, wanted: set[str], prefixes: list[str], unexpected: list[str] | None = None) -> CheckpointError:
        if len(prefixes) > 1:
            return CheckpointError(
                f"the checkpoint '{self.source}' holds this model's weights under several prefixes "
                f"({', '.join(repr(p) for p in prefixes)}): which one trained is not known.",
                hint="Save the one model's state_dict() under 'model'.",
            )
        missing = sorted(wanted - set(self.model)) if unexpected is None else []
        unexpected = unexpected if unexpected is not None else sorted(set(self.model) - wanted)
        return CheckpointError(
            f"the checkpoint '{self.source}' does not hold this model's weights: missing {_few(missing)}; "
            f"unexpected {_few(unexpected)}.",
            hint="The checkpoint must be one of the model that model() builds (same architecture).",
        )

    def optimizer_states_for(self, names: list[str]) -> list[dict[str, Any]] | None:
        """The state of each of the file's optimizers (``names``, in the order it makes them): by name where the
        checkpoint names them as the file does, else in order; None where it holds none. A checkpoint whose states do not pair
        with the file's optimizers is a checkpoint of another training: fresh moments would hide what the trained
        ones cause."""
        if not self.optimizers:
            return None
        states = self.optimizers
        if isinstance(states, dict) and not set(states) & set(names):
            states = list(states.values())  # names of the training's own, none of the file's: in the order saved
        if isinstance(states, dict):
            missing = [n for n in names if n not in states]
            if not missing:
                return [states[n] for n in names]
            held = f"optimizer states named {', '.join(states)}"
        elif len(states) == len(names):
            return list(states)
        else:
            held = f"{len(states)} optimizer state(s)"
        raise CheckpointError(
            f"the checkpoint '{self.source}' holds {held}; the file makes {len(names)} optimizer(s): "
            f"{', '.join(names)}.",
            hint="--from-checkpoint takes a checkpoint of the training this file defines: one optimizer state per "
            "optimizer, in the order optimizers(model) returns them (or under the same names).",
        )

    def describe(self) -> str:
        """``torch.save dict ckpt.pt, saved at step 12 (model, optimizer, scaler)``: what the checkpoint holds."""
        counted = [("optimizer", len(self.optimizers)), ("scheduler", len(self.schedulers))]
        parts = ["model"] + [name if n == 1 else f"{n} {name}s" for name, n in counted if n]
        parts += ["scaler"] if self.scaler is not None else []
        parts += ["random generators"] if self.rng is not None else []
        saved = f", saved at step {self.saved_step}" if self.saved_step is not None else ""
        return f"{self.layout} {self.source}{saved} ({', '.join(parts)})"


def _prefixes(found: set[str], wanted: set[str]) -> list[str]:
    """Every prefix under which the checkpoint holds each key the model has (``""`` where they match as they are):
    a wrapper's (``module.``), or a LightningModule's attribute (``model.``); several where it holds more models."""
    if wanted <= found:
        return [""]
    counts = Counter(k[: -len(w)] for k in found for w in wanted if k.endswith("." + w) or k == w)
    return sorted(prefix for prefix, _ in counts.most_common(5) if all(prefix + w in found for w in wanted))


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def load_checkpoint(path: Path, from_step: int | None = None, trust: bool = False) -> TrainedStart:
    """Read a checkpoint (file or Hugging Face folder) into the state the probes start from."""
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist.", hint="Check the checkpoint's path.")
    start = _hf_folder(path, trust) if path.is_dir() else _from_file(path, trust)
    if from_step is not None:
        start.step = from_step
    return start


def _load(path: Path, trust: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as exc:
        needed = [] if trust else _unsafe_globals(path, exc)
        if not needed:  # no global it would take: not a file torch.save wrote
            raise CheckpointError(
                f"'{path}' is not a checkpoint torch.load reads ({type(exc).__name__}).",
                hint="A checkpoint is a file torch.save wrote (a .pt, .pth, .bin or Lightning .ckpt), or a "
                "Hugging Face checkpoint-N folder.",
            ) from exc
        raise CheckpointError(
            f"the checkpoint '{path}' holds more than tensors and plain containers ({', '.join(needed)}), which "
            "weights_only loading refuses.",
            hint="If you trust the file (it runs code when unpickled), pass --trust-checkpoint.",
        ) from exc
    except (RuntimeError, OSError, EOFError) as exc:
        raise CheckpointError(f"cannot read the checkpoint '{path}': {exc}", hint="Is it a torch.save file?") from exc


GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")
"""How weights_only loading names a global it refuses, where torch cannot read them off the file (a checkpoint in
the legacy, non-zip format; a torch without ``get_unsafe_globals_in_checkpoint``)."""


def _unsafe_globals(path: Path, refusal: Exception) -> list[str]:
    """The globals a checkpoint needs beyond what weights_only loading takes (``argparse.Namespace``): as torch
    reads them off the file without loading it, else as its refusal names them; none for a file that is no
    torch.save checkpoint."""
    read_off = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    try:
        found = list(read_off(path)) if read_off is not None else []
    except (ValueError, RuntimeError, OSError, pickle.UnpicklingError):
        found = []
    return found or sorted(set(GLOBAL_IN_MESSAGE.findall(str(refusal))))


def _from_file(path: Path, trust: bool) -> TrainedStart:
    saved = _load(path, trust)
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"the checkpoint '{path}' holds a {type(saved).__name__}, not a dict.",
            hint="Save a dict: torch.save({'model': model.state_dict(), 'optimizer': ..., 'step': ...}, path).",
        )
    if saved and all(isinstance(v, torch.Tensor) for v in saved.values()):
        return TrainedStart(path, "state dict", saved, [], None, [], 0)
    model = _first(saved, MODEL_KEYS)
    if not isinstance(model, dict):
        raise CheckpointError(
            f"the checkpoint '{path}' has no model weights under any of {', '.join(MODEL_KEYS)} (its keys: "
            f"{_few(sorted(map(str, saved)))}).",
            hint="Save the model's state_dict() under 'model'.",
        )
    lightning = "optimizer_states" in saved or "pytorch-lightning_version" in saved
    saved_step = _step_of(_first(saved, STEP_KEYS))
    return TrainedStart(
        path,
        "Lightning checkpoint" if lightning else "torch.save dict",
        model,
        _optimizer_states(_first(saved, OPTIMIZER_KEYS)),
        _one(_first(saved, SCALER_KEYS)),
        _states(_first(saved, SCHEDULER_KEYS)),
        saved_step or 0,
        _rng_of(_first(saved, RNG_KEYS)),
        saved_step,
    )


def _step_of(value: Any) -> int | None:
    """A step as a checkpoint keeps it (a Python or NumPy number, a one-element tensor); None: it keeps none."""
    if torch.is_tensor(value):
        return int(value.item()) if value.numel() == 1 else None
    return int(cast(SupportsInt, value)) if isinstance(value, numbers.Real) else None


def _first(saved: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((saved[k] for k in keys if saved.get(k) is not None), None)


def _one(state: Any) -> dict[str, Any] | None:
    """A state dict (a scaler's), or the first of a list of them."""
    if isinstance(state, list):
        state = state[0] if state else None
    return state if isinstance(state, dict) else None


def _states(value: Any) -> list[dict[str, Any]]:
    """State dicts in the order they were saved: a list of them (Lightning keeps one per optimizer and
    scheduler), or one."""
    states = value if isinstance(value, (list, tuple)) else [value]
    return [s for s in states if isinstance(s, dict)]


def _optimizer_states(value: Any) -> list[dict[str, Any]] | dict[str, dict[str, Any]]:
    """:func:`_states`, or where ``value`` maps names to optimizer states (``{"generator": ..., ...}``) those."""
    if isinstance(value, dict) and value and all(_is_optimizer_state(v) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    return _states(value)


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and "param_groups" in value and "state" in value


def _hf_folder(path: Path, trust: bool) -> TrainedStart:
    weights = next((path / name for name in HF_WEIGHTS if (path / name).is_file()), None)
    if weights is None:
        raise CheckpointError(
            f"the folder '{path}' holds no {' or '.join(HF_WEIGHTS)}.",
            hint="Give a Hugging Face checkpoint-N folder, or a torch.save / Lightning .ckpt file.",
        )
    model = _safetensors(weights) if weights.suffix == ".safetensors" else _load(weights, trust)
    parts = {
        name: _load(path / f"{name}.pt", trust) if (path / f"{name}.pt").is_file() else None
        for name in ("optimizer", "scaler", "scheduler")
    }
    state = path / "trainer_state.json"
    saved_step = _step_of(json.loads(state.read_text()).get("global_step")) if state.is_file() else None
    step = saved_step or 0
    rng = next((path / name for name in HF_RNG if (path / name).is_file()), None)
    return TrainedStart(
        path,
        "Hugging Face checkpoint",
        model,
        _optimizer_states(parts["optimizer"]),
        _one(parts["scaler"]),
        _states(parts["scheduler"]),
        step,
        _rng_of(_load_rng(rng, trust)) if rng is not None else None,
        saved_step,
    )


def _load_rng(path: Path, trust: bool) -> Any:
    """A generators file: NumPy's state is an array, which weights_only loading takes only once allowed by name
    (NumPy 2's module path, and NumPy 1's that older files pickle). A file that still cannot be read is no
    generators, not a checkpoint that cannot be used: the probes then draw from the seed."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # NumPy 2 renamed it
    reconstruct = core.multiarray._reconstruct
    allowed: list[Any] = [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
    ]
    try:
        with torch.serialization.safe_globals(allowed):
            return _load(path, trust)
    except CheckpointError:
        return None


def _rng_of(saved: Any) -> dict[str, Any] | None:
    """The generators a checkpoint kept, where it kept torch's CPU generator (under ``cpu`` or ``torch``)."""
    if not isinstance(saved, dict):
        return None
    cpu = saved.get("cpu", saved.get("torch"))
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        return None
    return {"cpu": cpu, **{k: saved[k] for k in ("python", "numpy") if k in saved}}


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise CheckpointError(
            f"reading '{path}' needs the safetensors package.", hint="pip install safetensors"
        ) from exc
    state: dict[str, torch.Tensor] = load_file(str(path))
    return state
