"""Replay capsules: the folder a watch writes on an alarm, and the check that one is complete.

A capsule holds what the failing optimizer step started from (model, optimizer and scaler state, RNG),
what the model received in that step (every accumulation micro-batch) and, where the watch saw it, the
gradient of the loss with respect to the model's outputs. ``train_capsule.py`` turns it into a training
file: with the output gradients its ``loss()`` is the surrogate ``sum(output * recorded_grad)``, whose
backward is exactly the script's, so the step replays without the script's loss code. ``model.pt`` is
pickled with cloudpickle: classes defined in the script that was run (``__main__``) are stored by value
and rebuild in any process; classes importable from installed packages stay references.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import textwrap
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..config import COMPILE_BACKENDS
from ..errors import TrainingFileError
from ..files import atomic_write_text
from ..userfile.batches import iter_tensors, map_tensors
from ..userfile.compiled import CompileOptions
from .stepstate import StateReport

CAPSULE_FORMAT = 2
"""Bumped whenever the files of a capsule change meaning; a capsule of another format is refused."""
SHARDS = "sharded_state"
"""A capsule's folder of the ranks' own shards of the state (``torch.distributed.checkpoint``), where the whole
state was past the watch's gather limit."""
CAPSULE_FILES = ("capsule.pt", "model.pt", "config.json", "train_capsule.py")
BACKEND_FILE = "backend.pt"
"""A custom ``torch.compile`` backend the run compiled with, pickled with cloudpickle (where it pickles): the replay
compiles with it, not with inductor in its place (which computes another program)."""
OPTIMIZER_FILE = "optimizer.pkl"
"""The optimizer's class, pickled with cloudpickle: one the script defined itself is stored by value."""
MANIFEST = "manifest.json"
REPLAY_INDEX = "replay_index"
"""The batch field (a 0-dim integer tensor) that names a micro-batch's recorded output gradients."""
REPLAY_ROWS = "replay_rows"
"""The batch field ``arange(rows)``: which of the recorded rows are still there. A data intervention that drops
rows of the batch (the rows holding a NaN) drops them here too, and the replay keeps the same rows of the
recorded output gradients, so the gradients stay row for row with the model's outputs."""


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def capsule_folder(base: Path, step: int, rank: int | None, every_rank: bool = False) -> Path:
    """A new folder for this alarm: ``step_N`` (``rankR_step_N`` under torchrun; ``ranks_step_N`` for one the ranks
    write together), never an earlier capsule's."""
    name = f"step_{step:08d}" if rank is None else f"rank{rank}_step_{step:08d}"
    name = f"ranks_step_{step:08d}" if every_rank else name
    folder, n = base / name, 1
    while folder.exists():
        n += 1
        folder = base / f"{name}-{n}"
    folder.mkdir(parents=True)
    return folder


def replay_inputs(
    batches: list[Any], output_grads: list[tuple[list[torch.Tensor | None], bool]], scale: float
) -> tuple[list[Any], list[list[torch.Tensor | None]] | None]:
    """Host copies of the step's batches and, when every micro-batch has them, its unscaled output gradients.

    With output gradients each batch gains a ``replay_index`` naming its gradients, which stay out of the
    batch itself (the data scan looks at what the model received, not at gradients), and ``replay_rows``
    numbering its rows (see :data:`REPLAY_ROWS`)."""
    copies = [map_tensors(b, cpu_copy) for b in batches]
    if (
        not copies
        or len(output_grads) != len(copies)
        or not all(any(g is not None for g in gs) for gs, _ in output_grads)
    ):
        return copies, None
    grads = [
        [None if g is None else (g.detach().float() / (scale if scaled else 1.0)).cpu() for g in gs]
        for gs, scaled in output_grads
    ]
    return [{**b, REPLAY_INDEX: torch.tensor(i), **_row_numbers(b)} for i, b in enumerate(copies)], grads


def _row_numbers(batch: Any) -> dict[str, torch.Tensor]:
    """``replay_rows``: ``arange`` over the first dimension of the batch's first tensor (none for a 0-dim batch)."""
    first = next((t for _, t in iter_tensors(batch)), None)
    return {REPLAY_ROWS: torch.arange(first.shape[0])} if first is not None and first.dim() else {}


def loss_gradient_finding(loss: float | None, output_grads: list[list[torch.Tensor | None]] | None) -> str | None:
    """What the recorded output gradients say about the loss computation, which the replay cannot run.

    A finite loss whose gradient w.r.t. the model's outputs is non-finite: the non-finite values are made
    in the loss computation (its backward), outside the model."""
    if output_grads is None or loss is None or not math.isfinite(loss):
        return None
    if all(g is None or bool(torch.isfinite(g).all()) for grads in output_grads for g in grads):
        return None
    return (
        "the loss is finite but its gradient w.r.t. the model's outputs is not: the non-finite values "
        "arise in the loss computation (its backward), outside the model"
    )


@dataclass(frozen=True)
class LossRecord:
    """What the watch saw of the step's loss, kept in the manifest: the evidence about the loss computation a
    replay from output gradients does not run."""

    value: float | None
    """The step's loss (summed over micro-batches); None where the watch saw none."""
    dtypes: list[str] = field(default_factory=list)
    """The dtypes the loss tensors came out in."""
    output_dtypes: list[str] = field(default_factory=list)
    """The dtypes of the model's outputs the loss was computed from (those of their recorded gradients)."""

    def to_json(self) -> dict[str, Any]:
        """The manifest's fields; the value as text: "inf" and "nan" are not JSON numbers."""
        return {
            "loss": None if self.value is None else repr(float(self.value)),
            "loss_dtypes": self.dtypes,
            "output_dtypes": self.output_dtypes,
        }


def recorded_loss_evidence(manifest: dict[str, Any]) -> str | None:
    """What the capsule's watch recorded about the loss computation, which the replay does not run: its
    ``loss_finding`` (a finite loss with a non-finite gradient w.r.t. the outputs), else a non-finite loss
    computed in half precision or from half-precision outputs. Which of the model or the loss made that one,
    the diagnosis decides by replaying the model (finite under AMP: the loss); from the gradients alone it
    cannot be told apart from a NaN row of data. A non-finite loss with no half precision in or out of it is no
    evidence about precision (a 0/0 over an all-padding batch): nothing is recorded. Only for a replay driven
    by the recorded output gradients, which leaves the loss code out."""
    if manifest.get("loss_finding"):
        return str(manifest["loss_finding"])
    text = manifest.get("loss")
    if manifest.get("replay") != "output-grads" or text is None or math.isfinite(loss := float(text)):
        return None  # a trainer's capsule replays its loss too: there the replay itself shows what the loss did
    dtypes, outputs = manifest.get("loss_dtypes") or [], manifest.get("output_dtypes") or []
    if not {"float16", "bfloat16"} & {*dtypes, *outputs}:
        return None
    return (
        f"the watch recorded a loss of {loss} at optimizer step {manifest.get('step')} (computed in "
        f"{'/'.join(dtypes) or 'an unknown dtype'} from {'/'.join(outputs) or 'unknown'} outputs): where the model "
        "replays finite on the same weights and batch, the loss computation, outside the model, made it; the "
        "loss itself in fp32 is not measured (the capsule holds no loss code)"
    )


@dataclass(frozen=True)
class CapsuleContents:
    """What a capsule stores of the step, on the host: the model to pickle, the state it starts from, the batches."""

    module: torch.nn.Module
    """The module ``model.pt`` pickles (the user's classes, nothing of the watch's or a wrapper's)."""
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    """As ``Optimizer.state_dict`` keys it (by position), what the capsule's optimizer loads."""
    optimizer_by_position: bool
    """``optimizer_state`` keys each parameter by its place in the model's ``parameters()``: the replay rebuilds the
    run's parameter groups from it. False: in the optimizer's own order (it holds a parameter the model does not),
    loaded into one group of the model's parameters."""
    batches: list[Any]
    output_grads: list[list[torch.Tensor | None]] | None
    import_paths: list[str]
    sharding: dict[str, Any] | None = None
    """The ``sharding`` config its replay emulates the ranks with (a sharded run's capsule); None: one process."""
    shards: StateInShards | None = None
    """Where the ranks saved the state in shards (its whole was past the gather limit): ``model_state`` is then
    empty and ``optimizer_state`` holds the parameter groups only."""
    not_emulated: list[str] = field(default_factory=list)
    """What the run did that the replay of a sharded run does not emulate (a module's own policy, FSDP1's
    ``buffer_dtype``): said in the diagnosis's note."""


@dataclass(frozen=True)
class StateInShards:
    """A sharded run's state as its ranks saved it, each its own shards, and how the replay reads it whole."""

    folder: Path
    """The ranks' shards (``torch.distributed.checkpoint``), moved into the capsule as :data:`SHARDS`."""
    state_keys: dict[str, str]
    """Each key of the capsule's plain module's state, and its key in the shards."""
    parameter_keys: list[str]
    """The model's parameters' keys in the shards, in its order (how the optimizer's moments are indexed)."""

    def to_capsule(self) -> dict[str, Any]:
        """What ``capsule.pt`` keeps of it (the folder is the capsule's own :data:`SHARDS`)."""
        return {"shard_keys": self.state_keys, "parameter_keys": self.parameter_keys}


@dataclass(frozen=True)
class ReplayStart:
    """What the watch recorded about the state the capsule's step starts from, kept in the manifest."""

    step_state: StateReport | None = None
    """The state the model's forward wrote that the capsule put back as the step started, and what it could not
    (:mod:`.stepstate`); None where the watch saw no forward of the step (nothing was kept)."""
    history_finite: bool | None = None
    """Every step the watch checked before this one had a finite loss (None: not recorded)."""
    skipped_before: int = 0
    """The optimizer steps skipped in a row just before this one: the replay's scaler continues that streak."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The watch's last steps up to this one (``step``, ``loss``, ``skipped``, ``lr``, ``grad_norm``): where the
    trouble began before the step the capsule holds, the diagnosis reads it here."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step_state": self.step_state.to_json() if self.step_state is not None else None,
            "history_finite": self.history_finite,
            "skipped_before": self.skipped_before,
            "history": self.history,
        }


def write_manifest(
    folder: Path,
    step: int,
    replay: str,
    loss_finding: str | None = None,
    loss: LossRecord | None = None,
    start: ReplayStart | None = None,
    compiled: CompileOptions | None = None,
    sharding: dict[str, Any] | None = None,
    not_emulated: list[str] | None = None,
    backend_stored: bool = False,
    alarm: dict[str, Any] | None = None,
) -> None:
    """What a reader checks first: the format, the files, which replay the capsule supports, what the watch saw
    of the step's loss and of the state it started from, how the model was compiled, the ranks it emulates (a
    sharded run's). Written last."""
    manifest = {
        "format": CAPSULE_FORMAT,
        "fp16doctor": __version__,
        "step": step,
        "replay": replay,
        "files": [
            *CAPSULE_FILES,
            *([BACKEND_FILE] if backend_stored else []),
            *([OPTIMIZER_FILE] if (folder / OPTIMIZER_FILE).is_file() else []),
        ],
        "loss_finding": loss_finding,
        **(loss or LossRecord(None)).to_json(),
        **(start or ReplayStart()).to_json(),
        "compiled": compiled.to_json() if compiled is not None else None,
        "sharding": sharding,
        "not_emulated": not_emulated or [],
        "alarm": alarm or {},
    }
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2))


def check_capsule(folder: Path) -> dict[str, Any]:
    """The capsule's manifest, or :class:`TrainingFileError` naming what is missing or which format it is."""
    if not folder.is_dir():
        raise TrainingFileError(
            f"capsule folder '{folder}' does not exist.", hint="Pass the folder the watch printed after 'Capsule:'."
        )
    hint = "Pass the folder the watch printed after 'Capsule:'; a capsule is complete once manifest.json is written."
    if not (folder / MANIFEST).is_file():
        if not (folder / "train_capsule.py").is_file():
            raise TrainingFileError(
                f"'{folder}' is not a replay capsule (no {MANIFEST}, no train_capsule.py in it).", hint=hint
            )
        raise TrainingFileError(
            f"capsule '{folder}' is incomplete or from an older fp16doctor: {MANIFEST} is missing.", hint=hint
        )
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise TrainingFileError(f"capsule '{folder}': {MANIFEST} cannot be read ({exc}).", hint=hint) from exc
    if manifest.get("format") != CAPSULE_FORMAT:
        raise TrainingFileError(
            f"capsule '{folder}' has format {manifest.get('format')} (fp16doctor {manifest.get('fp16doctor', '?')}); "
            f"this fp16doctor ({__version__}) reads format {CAPSULE_FORMAT}.",
            hint="Diagnose it with the fp16doctor version that wrote it, or let the watch write a new capsule.",
        )
    missing = [name for name in CAPSULE_FILES if not (folder / name).is_file()]
    if missing:
        raise TrainingFileError(f"capsule '{folder}' is incomplete: {', '.join(missing)} missing.", hint=hint)
    return manifest


def replay_note(manifest: dict[str, Any]) -> str:
    """What a capsule diagnosis replays, and what it cannot verify."""
    unlike = manifest.get("not_emulated") or []
    differs = f"; not emulated, as the run had it: {'; '.join(unlike)}" if unlike else ""
    stored = BACKEND_FILE in (manifest.get("files") or [])
    return _replayed(manifest) + differs + _compiled_note(manifest.get("compiled"), stored)


def _compiled_note(compiled: dict[str, Any] | None, backend_stored: bool = False) -> str:
    if not compiled:
        return ""
    how = ", ".join(f"{k} {compiled[k]}" for k in ("backend", "mode", "dynamic") if compiled.get(k) is not None)
    replayed = replay_backend(str(compiled.get("backend")))
    backend = compiled.get("backend")
    instead = (
        ""
        if replayed == backend or backend_stored
        else f" (its backend, compiled before the watch began, was not seen: replayed with {replayed})"
        if backend == "unknown"
        else f" (its backend did not pickle, so it is not stored: replayed with {replayed}, which computes another"
        " program; a fault only that backend makes is not reproduced)"
    )
    blocks = compiled.get("modules") or []
    what = f"its blocks {', '.join(blocks)} ran compiled one by one" if blocks else "ran compiled"
    return (
        f"; the watched model {what} (torch.compile: {how}), and the step is replayed both ways, compiled"
        f"{instead} and eager: the compiled stage compares them"
    )


def replay_backend(backend: str) -> str:
    """The backend a capsule replays a compiled model with: the run's, where torch names it; inductor for a custom
    backend (a function of the script, not stored) or one the watch did not see."""
    return backend if backend in COMPILE_BACKENDS else "inductor"


def _compiled_return(compiled: CompileOptions | None) -> str:
    """What the capsule's ``model()`` returns: the module, compiled as the run compiled it."""
    if compiled is None:
        return "net"
    options = {k: v for k, v in compiled.options.items() if isinstance(v, (bool, int, float, str))}
    settings = (
        f"backend=backend({replay_backend(compiled.backend)!r}), mode={compiled.mode!r}, "
        f"dynamic={compiled.dynamic!r}, fullgraph={compiled.fullgraph!r}, options={options or None!r}"
    )
    if compiled.modules:
        return f"compiled_blocks(net, {list(compiled.modules)!r}, {settings})"
    return f"torch.compile(net, {settings})"


def _replayed(manifest: dict[str, Any]) -> str:
    step = manifest.get("step")
    if manifest.get("loss_finding"):
        return (
            f"optimizer step {step}: {manifest['loss_finding']}; the replay drives the model's backward with "
            "that gradient's finite entries (its inf/NaN entries as 0)" + REPEATED
        )
    if manifest.get("replay") == "output-grads":
        return (
            f"single-step replay of optimizer step {step}: the model's forward and backward and the optimizer step "
            "replay exactly, driven by the recorded gradient of the loss w.r.t. the model's outputs; the loss "
            "computation itself is not replayed (a non-finite gradient arriving from it is a finding about the loss, "
            "outside the model: its inf/NaN entries count as 0, and an output whose gradient has no finite entry "
            "is driven by its mean's), nor are the steps before or after" + REPEATED
        )
    return (
        f"single-step replay of optimizer step {step} with the {manifest.get('replay')} loss; "
        "the steps before and after it are not replayed" + REPEATED
    )


REPEATED = "; the probes take that batch again for a few steps from the recorded state, so that the scaler can back off"
"""Why a single-step capsule's stages report several steps on one batch (:func:`capsule_config`)."""


def pickled_optimizer_class(cls: type) -> bytes:
    """The optimizer's class pickled by cloudpickle (by value where the script defined it), with ``step`` as the
    class defines it: torch wraps a subclass's ``step`` in a closure whose globals hold the process's global
    optimizer hooks (the watch's own among them), which would be pickled by value with it; the rebuilt class is
    wrapped again, over its own process's hooks, by its first optimizer."""
    import io

    import cloudpickle

    class StepUnwrapping(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if callable(obj) and getattr(obj, "hooked", False) and hasattr(obj, "__wrapped__"):
                return copy.copy, (obj.__wrapped__,)  # copy.copy(function) is the function itself
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    StepUnwrapping(buffer).dump(cls)
    return buffer.getvalue()


def positioned_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` on the host, each parameter keyed by its place in ``model.parameters()`` (the
    order the replay's ``optimizer(params)`` receives them in), so that its groups rebuild; None where the optimizer
    holds a parameter the model does not."""
    place = {id(p): i for i, p in enumerate(model.parameters())}
    current = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in place for p in current):
        return None
    state = optimizer.state_dict()
    saved = [i for group in state["param_groups"] for i in group["params"]]
    key = {i: place[id(p)] for i, p in zip(saved, current)}
    return {
        "state": {key[i]: map_tensors(v, cpu_copy) for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [key[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (plain values only: the capsule loads weights_only)."""
    import inspect

    try:
        accepted = set(inspect.signature(type(optimizer).__init__).parameters)
    except (TypeError, ValueError):
        accepted = set(optimizer.defaults)
    return {
        k: v
        for k, v in optimizer.defaults.items()
        if k in accepted and isinstance(v, (bool, int, float, str, tuple, type(None)))
    }


def import_roots(model: torch.nn.Module) -> list[str]:
    """The folders from which the model's own classes import (``pkg.mod`` in ``/x/pkg/mod.py`` -> ``/x``).

    The capsule's training file puts them on ``sys.path`` so that ``model.pt`` unpickles
    wherever the diagnosis runs; installed libraries import as they are, and classes of
    ``__main__`` are stored by value.
    """
    roots: list[str] = []
    for module in {type(m).__module__ for m in model.modules()}:
        if module == "__main__":
            continue  # pickled by value (cloudpickle): nothing to import
        file = getattr(sys.modules.get(module), "__file__", None)
        if not file or "site-packages" in file or "dist-packages" in file:
            continue
        root = Path(file).resolve().parent
        for _ in range(module.count(".") + (1 if Path(file).name == "__init__.py" else 0)):
            root = root.parent
        if str(root) not in roots:
            roots.append(str(root))
    return roots


def detached_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module ready to pickle: without a reference to its trainer (Lightning keeps one), without
    accelerate's forward wrapper (the class's own forward) and without the watch's own hooks (they would
    drag the watch, its batches and its trainer into ``model.pt``)."""
    import copy

    clone = copy.copy(model)
    drop_foreign_hooks(model, clone)
    if getattr(model, "_trainer", None) is not None:
        clone.__dict__["_trainer"] = None
    if "_original_forward" in model.__dict__:  # accelerate's mixed-precision forward wrapper refuses to pickle
        clone.__dict__.pop("forward", None)
        clone.__dict__.pop("_original_forward", None)
    return clone


HOOK_MARKS = {
    "_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
    "_forward_hooks_with_kwargs": "_forward_hooks",
    "_forward_hooks_always_called": "_forward_hooks",
}
"""Tables keyed by a hook's id that say how to call it: kept only for the hooks kept (a mark left for a dropped
hook is read by whichever hook the rebuilt module's process registers under that id next)."""


def drop_foreign_hooks(module: torch.nn.Module, clone: torch.nn.Module) -> None:
    """``clone``'s hook tables without FSDP's, DDP's and the watch's hooks, and their with-kwargs and always-called
    marks kept only for the hooks kept."""
    for name, table in module.__dict__.items():
        if name.endswith("_hooks") and isinstance(table, dict):
            clone.__dict__[name] = OrderedDict((k, h) for k, h in table.items() if not _foreign(h))
    for mark, table in HOOK_MARKS.items():
        if isinstance(module.__dict__.get(mark), dict):
            kept = clone.__dict__.get(table, {})
            clone.__dict__[mark] = OrderedDict((k, v) for k, v in module.__dict__[mark].items() if k in kept)


def _foreign(hook: Any) -> bool:
    """A hook fp16doctor or torch.distributed registered: neither belongs in the user's module."""
    function = getattr(hook, "__func__", hook)
    function = getattr(function, "func", function)  # functools.partial
    module = str(getattr(function, "__module__", ""))
    return module.startswith(("fp16doctor.", "torch.distributed."))


def capsule_config(numbers: Any, scaler: Any, batches: int, dtype: str) -> dict[str, Any]:
    """The doctor's config for the capsule: the scaler as it was at the alarm, enough steps to watch it fail."""
    enabled = scaler is not None and scaler.is_enabled()
    config: dict[str, Any] = {"steps": max(4, batches), "device": "cpu", "dtype": dtype}
    if enabled:
        config["scaler"] = {
            "enabled": True,
            "init_scale": float(numbers.loss_scale),
            "growth_factor": float(scaler.get_growth_factor()),
            "backoff_factor": float(scaler.get_backoff_factor()),
            "growth_interval": int(scaler.get_growth_interval()),
        }
    return config


LIGHTNING_LOSS = '''

def loss(model, batch):
    """Lightning: the module's own training_step gives the loss."""
    out = model.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out
'''

REPLAY_LOSS = '''
def _tensors(value):
    """The output's tensors in a fixed order (the order the watch recorded their gradients in)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict) or hasattr(value, "items"):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same_rows(out, grad, rows):
    """The recorded gradient of the rows still in the batch (an intervention may have dropped some)."""
    if rows is not None and grad.dim() and out.dim() and grad.shape[0] != out.shape[0] and rows.numel() == out.shape[0]:
        return grad.index_select(0, rows.to(grad.device))
    return grad


def _finite_part(grad):
    """The recorded gradient with its inf/NaN entries counted as 0. They say nothing about the model in FP32: they
    were made in the loss computation, outside the model (the manifest's loss_finding), or they are the gradient
    of outputs the AMP step made non-finite (extreme inputs, an overflowing layer), which the replay's own AMP
    forward makes again. A tensor with no finite entry at all stands in the gradient of its mean (1 / numel):
    the FP32 replay still trains on something, instead of turning NaN and blaming FP32."""
    finite = torch.isfinite(grad)
    if bool(finite.all()):
        return grad
    if not bool(finite.any()):
        return torch.full_like(grad, 1.0 / max(grad.numel(), 1))
    return torch.where(finite, grad, torch.zeros_like(grad))


def loss(model, batch):
    """The surrogate sum(output * recorded d loss / d output): its backward is the script's backward, no loss code."""
    grads = STATE["output_grads"][int(batch["replay_index"])]
    rows = batch.get("replay_rows")
    outputs = _tensors(model(*batch.get("args", ()), **batch.get("kwargs", {})))
    terms = [(out.float() * _finite_part(_same_rows(out, g, rows)).to(out.device)).sum()
             for out, g in zip(outputs, grads) if g is not None]
    return torch.stack(terms).sum()
'''


def capsule_training_file(
    numbers: Any, config: dict[str, Any], framework: str, replay: str, compiled: CompileOptions | None = None
) -> str:
    """A training file that rebuilds the capsule: the model as trained (compiled as it was: the diagnosis then
    replays it both ways), the optimizer state, the step's batches."""
    head = textwrap.dedent(f'''\
        """Replay capsule written by fp16doctor's watch at optimizer step {numbers.step} ({framework}).

        Diagnose it: fp16doctor diagnose --capsule <this folder>
        model.pt holds the module as it was trained (pickled with cloudpickle: classes of the script that was run
        are stored by value); capsule.pt (torch.load(..., weights_only=True)) the weights the step started from,
        the optimizer and scaler state, the step's batches, output gradients and RNG states.
        """

        import copy
        import importlib
        import sys
        from pathlib import Path

        import torch

        HERE = Path(__file__).resolve().parent
        STATE = torch.load(HERE / "capsule.pt", weights_only=True)
        SHARDED = STATE.get("parameter_keys") is not None  # saved by the ranks in shards: read whole here
        if SHARDED:
            from fp16doctor.live.sharded_capsule import load_whole, whole_from_shards

            STATE.update(whole_from_shards(HERE, STATE["shard_keys"], STATE["parameter_keys"]))
        CONFIG = {config!r}
        sys.path[:0] = [p for p in STATE["import_paths"] if p not in sys.path]   # where the model's classes live


        def backend(otherwise):
            """The run's own custom backend where the watch stored it (cloudpickle), else the one named (also where
            it does not load here: imported from a package this machine lacks)."""
            stored = HERE / "{BACKEND_FILE}"
            if not stored.is_file():
                return otherwise
            try:
                return torch.load(stored, weights_only=False)
            except Exception as exc:  # noqa: BLE001 - any unpickling error: the replay goes on, and says so
                print(f"note: the run's compile backend does not load here ({{exc}}): replayed with {{otherwise}}", file=sys.stderr)
                return otherwise


        def compiled_blocks(net, names, **settings):
            """The blocks the run compiled one by one, compiled in place again with its settings (one it replaced by
            its torch.compile wrapper put back first), the model around them eager."""
            from fp16doctor.userfile.compiled import compile_parts, make_eager

            make_eager(net)
            compile_parts(net, tuple(names), **settings)
            return net


        def model():
            net = torch.load(HERE / "model.pt", weights_only=False)
            if SHARDED:  # its parameters were saved on the meta device: each model() takes copies of the whole ones
                load_whole(net, STATE["model"])
            else:
                net.load_state_dict(STATE["model"])
            return {_compiled_return(compiled)}


        def data():
            return list(STATE["batches"])


        def optimizer_class():
            """The run's optimizer class: stored by value where the watch could (a class the script defined)."""
            stored = HERE / "{OPTIMIZER_FILE}"
            if stored.is_file():
                import pickle

                try:
                    return pickle.loads(stored.read_bytes())
                except Exception as exc:  # noqa: BLE001 - imported by its name instead
                    print(f"note: the run's optimizer class does not load here ({{exc}}): imported by its name", file=sys.stderr)
            module, name = STATE["optimizer_class"].rsplit(".", 1)
            return getattr(importlib.import_module(module), name)


        def optimizer(params):
            # the moments the failing step started from, copied: load_state_dict keeps the very tensors it is
            # given, and each probe's steps would update them in place for the next probe
            saved = copy.deepcopy(STATE["optimizer"])
            params, cls = list(params), optimizer_class()
            opt = None
            if STATE.get("optimizer_by_position") and saved["param_groups"]:
                # the run's own parameter groups (no weight decay on norms, an lr per part), each parameter by its
                # place in the model, with the hyperparameters each group had at the step
                groups = [{{**{{k: v for k, v in g.items() if k != "params"}}, "params": [params[i] for i in g["params"]]}}
                          for g in saved["param_groups"]]
                try:
                    opt = cls(groups, **STATE["optimizer_defaults"])
                except Exception:  # noqa: BLE001 - a class that groups its parameters itself (Muon's kind)
                    opt = None
            if opt is None:
                opt = cls(params, **STATE["optimizer_defaults"])
            try:
                opt.load_state_dict(saved)
            except (ValueError, KeyError) as exc:
                print(f"note: the run's optimizer state does not load into the replay's optimizer ({{exc}}): it starts "
                      "with the defaults and no moments", file=sys.stderr)
            return opt
        ''')
    if replay == "output-grads":
        return head + REPLAY_LOSS
    return head + (LIGHTNING_LOSS if framework == "lightning" else "")
