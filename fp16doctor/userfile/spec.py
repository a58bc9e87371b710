"""Loading the user's training file and checking it against the contract.

The training file is plain Python that never imports fp16doctor. It defines
``model()`` and ``data()`` and, optionally, ``loss``, ``optimizer``
(or ``optimizers``), ``scheduler``, ``train_step`` and ``CONFIG``.

It is loaded the way ``python -c "import your_file"`` run from its folder would
load it: the file's folder goes on ``sys.path`` (siblings import), the module
is registered in ``sys.modules`` under the file's name (classes defined in it
pickle, so DataLoader worker processes, also spawned ones, and ``torch.save``
of whole objects work), and whatever the file imports stays imported. Nothing
is ever removed from ``sys.modules``: libraries import lazily (torch's own
``torch._dynamo``, Hugging Face ``transformers``) and a second import of them
breaks class identity or registers their operators twice.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import inspect
import itertools
import keyword
import math
import sys
import traceback
import types
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import DoctorError, TrainingFileError, first_line
from .checkpoint import TrainedStart
from .compiled import CompileOptions, CompileRecorder, make_eager
from .modules import compile_wrapper_inner

MARKER = "__fp16doctor_training_file__"
"""Attribute set on a loaded training module: its resolved path (a reload under the same name is ours)."""

REQUIRED = ("model", "data")
COMPILED_NOTE = (
    "model() returns a torch.compile'd module (or one compiled in place): the instrumented probes run it eager, so that "
    "their instruments see every submodule and aten operator, and the AMP probe runs compiled too, as the "
    "training does (stage 'compiled'): the diagnosis is of the compiled training"
)
PARTS_NOTE = "model() compiles "


def compiled_parts_note(parts: tuple[str, ...]) -> str:
    """The note of a model compiled block by block."""
    shown = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
    return (
        f"{PARTS_NOTE}{shown} one by one: the instrumented probes run them eager, so that their instruments see "
        "every submodule and aten operator, and the AMP probe runs them compiled too, as the training does (stage "
        "'compiled'): the diagnosis is of the compiled training"
    )


COMPILE_OFF_NOTE = (
    "model() returns a torch.compile'd module (or compiles its blocks), but the config's compile.enabled is false: "
    "every probe runs the module eager, and the diagnosis is of the eager training"
)


def notes_under(notes: list[str], compile_enabled: bool | None) -> list[str]:
    """The loaded file's notes as they hold under the config: with ``compile.enabled`` false, the compiled note
    says that every probe runs eager instead."""
    return [
        COMPILE_OFF_NOTE if compile_enabled is False and (n == COMPILED_NOTE or n.startswith(PARTS_NOTE)) else n
        for n in notes
    ]


OPTIONAL_CALLABLES = ("loss", "optimizer", "optimizers", "scheduler", "train_step", "parallelize")
NEAR_MISSES = {
    "loss": (
        "loss_fn",
        "lossfn",
        "loss_func",
        "loss_function",
        "loss_fct",
        "compute_loss",
        "get_loss",
        "calc_loss",
        "calculate_loss",
        "criterion",
    ),
    "train_step": (
        "training_step",
        "train_one_step",
        "trainstep",
        "train_step_fn",
        "train_batch",
        "train_on_batch",
        "step_fn",
        "step",
    ),
}
"""Names people give the contract's optional functions that the loader does not read. A file that lacks the
contract's name but defines one of these (or, for the loss, any function with "loss" in its name) ran with
the doctor's default in its place: the diagnosis warns (the ``loss-name-mismatch`` rule)."""


@dataclass
class TrainingSpec:
    """What the training file provides; optional parts are ``None``."""

    path: Path
    module: types.ModuleType
    model: Callable[[], torch.nn.Module]
    data: Callable[..., Iterable[Any]]
    loss: Callable[..., torch.Tensor] | None
    optimizer: Callable[..., torch.optim.Optimizer] | None
    scheduler: Callable[..., Any] | None
    train_step: Callable[..., Any] | None
    config: dict[str, Any]
    optimizers: Callable[..., Any] | None = None
    """``optimizers(model)``: a tuple, list or dict of optimizers (several need a ``train_step``), instead of ``optimizer``."""
    parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None = None
    """``parallelize(model)``: the model wrapped as the training's ranks wrap it (DDP, FSDP), for ``--nproc``; None:
    DistributedDataParallel."""
    notes: list[str] = field(default_factory=list)
    """Things the user should know about how the doctor ran their file (printed once, in yellow)."""
    compiled: CompileOptions | None = None
    """How ``model()`` compiles the module it returns (``torch.compile``, seen as ``model()`` ran); None: eager."""
    start: TrainedStart | None = None
    """The trained state every probe starts from (``--from-checkpoint``); None: from ``model()``'s initialisation."""
    near_misses: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per contract name the file does not define (``loss``, ``train_step``): the callables the file defines
    at its top level whose names look like it (:data:`NEAR_MISSES`), each with its signature. The doctor
    ignored them and used its default; the diagnosis reads this through its evidence and warns."""

    file_state: dict[str, Any] | None = None
    """The file's module-level numbers, strings and flags as the first probe found them (:meth:`reset_file_state`);
    None before it."""
    replays_capsule: bool = False
    """The file is a watch capsule's ``train_capsule.py``: the doctor wrote it, so none of its lines is the user's
    code (where an op is called from is named by the model's own lines)."""

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def reset_file_state(self) -> None:
        """Put back the file's module-level values a probe changed (a micro-batch counter, a phase flag kept in a
        global), so that every probe trains from the file as the first probe found it (after ``data()`` and
        ``model()`` first ran: what they set there, a vocabulary size, stays); the first time, a note names them:
        the file's own training would have carried them on. A dict or list is put back in place: another name
        for it, or a default argument bound to it, sees the reset too."""
        if self.file_state is None:
            self.file_state = module_values(self.module, assigned_names(self.path))
            return
        current = vars(self.module)
        changed = [k for k, v in self.file_state.items() if k in current and not _same_value(current[k], v)]
        for name in changed:
            _put_back(self.module, name, self.file_state[name])
        if changed:
            self.note(
                f"the training file's module-level {', '.join(changed[:5])} changed while a probe trained: each "
                "probe starts from the value the file set, as a new run of the file would"
            )

    @contextlib.contextmanager
    def own_file_state(self, kept: dict[str, Any]) -> Iterator[None]:
        """Run the block with the file's module-level values as ``kept`` holds them (empty: as the file set them),
        and keep in it what the block left: two probes stepped in turn each carry their own counters and flags,
        as two runs of the file would."""
        if self.file_state is None:
            yield
            return
        for name, value in (kept or self.file_state).items():
            _put_back(self.module, name, value)
        try:
            yield
        finally:
            kept.update(module_values(self.module, set(self.file_state)))

    @property
    def defines_optimizer(self) -> bool:
        """The file makes its optimizers (``optimizer`` or ``optimizers``); else the doctor trains with its default
        AdamW."""
        return self.optimizer is not None or self.optimizers is not None

    @property
    def name(self) -> str:
        return self.path.stem

    def user_location(self, exc: BaseException) -> str | None:
        """``file:line`` of the deepest traceback frame inside the training file."""
        return user_frame(exc, self.path)

    def parallelized(self, model: torch.nn.Module) -> torch.nn.Module:
        """``parallelize(model)``; its error, or a result that is no module, is the training file's, at its line."""
        assert self.parallelize is not None
        try:
            wrapped = self.parallelize(model)
        except DoctorError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: its error, at its line
            raise TrainingFileError(
                f"parallelize() raised {type(exc).__name__}: {first_line(exc)}",
                location=self.user_location(exc),
                hint="parallelize(model) receives the plain model on this rank's device and returns it wrapped.",
            ) from exc
        if not isinstance(wrapped, torch.nn.Module):
            raise TrainingFileError(f"parallelize() returned {type(wrapped).__name__}, not a torch.nn.Module.")
        return wrapped


def user_frame(exc: BaseException, path: Path) -> str | None:
    """The deepest frame of ``exc``'s traceback that lies in ``path``, as ``file:line``."""
    target = str(Path(path).resolve())
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            if str(Path(frame.filename).resolve()) == target:
                found = f"{path}:{frame.lineno}"
        except OSError:
            continue
    if found is None and isinstance(exc, SyntaxError) and exc.filename:
        found = f"{exc.filename}:{exc.lineno}"
    return found


def _contract_function(value: Any) -> bool:
    """A callable the contract can call: not a module instance (a script's ``model = torch.compile(net)``)."""
    return callable(value) and not isinstance(value, torch.nn.Module)


def load_training_file(path: str | Path) -> TrainingSpec:
    """Import the training file as plain Python would, and check the contract's names."""
    path = Path(path)
    if not path.is_file():
        raise TrainingFileError(
            f"training file '{path}' does not exist.",
            hint="Pass the path of a Python file that defines model() and data().",
        )
    module = _import_as_module(path)
    missing = [name for name in REQUIRED if not _contract_function(getattr(module, name, None))]
    if missing:
        hint = "A training file needs `def model() -> torch.nn.Module` and `def data() -> iterable of batches`; see docs/training-file.md."
        if len(missing) == len(REQUIRED) or "model" in missing:  # a training script's own loop (model = Net())
            hint += f" To watch the script as it is, run: fp16doctor watch {path} ARGS"
        raise TrainingFileError(
            f"training file '{path}' does not define {' and '.join(n + '()' for n in missing)}.", hint=hint
        )
    optional: dict[str, Any] = {}
    for name in OPTIONAL_CALLABLES:
        value = getattr(module, name, None)
        if value is not None and not callable(value):
            raise TrainingFileError(f"'{name}' in '{path}' must be a function, got {type(value).__name__}.")
        optional[name] = value
    if optional["optimizer"] is not None and optional["optimizers"] is not None:
        raise TrainingFileError(
            f"training file '{path}' defines both optimizer(params) and optimizers(model).",
            hint="Define one: optimizer(params) for a single optimizer, optimizers(model) for a tuple, list or dict of them.",
        )
    config = getattr(module, "CONFIG", None) or {}
    if not isinstance(config, dict):
        raise TrainingFileError(f"CONFIG in '{path}' must be a dict, got {type(config).__name__}.")
    return TrainingSpec(
        path=path,
        module=module,
        model=module.model,
        data=module.data,
        config=config,
        near_misses=near_misses(path, module, [n for n in NEAR_MISSES if optional[n] is None]),
        **optional,
    )


FILE_STATE_TYPES = (bool, int, float, str)
"""The module-level values a probe may change and the next must find as the first did (a counter, a flag, a
phase), also inside a small dict or list (``_micro = {"i": 0}``); not None, which a cache starts from."""
FILE_STATE_ITEMS = 64
"""A dict or list past this many items is data, not a counter: left alone."""


def module_values(module: types.ModuleType, names: set[str]) -> dict[str, Any]:
    """The file's own module-level numbers, strings and flags (and small dicts and lists of them) of ``names``, as
    they are now: copies."""
    return {k: copy.deepcopy(v) for k, v in vars(module).items() if k in names and _plain_state(v, 0)}


def top_level_statements(path: Path) -> list[ast.stmt]:
    """The file's top-level statements, read from its source (none where it does not parse)."""
    try:
        return ast.parse(path.read_text(encoding="utf-8", errors="replace")).body
    except (OSError, SyntaxError, ValueError):
        return []


def assigned_names(path: Path) -> set[str]:
    """The names the file's top level assigns (``x = ...``, ``x += ...``, ``x: int = ...``): not what it imports."""
    names: set[str] = set()
    for node in top_level_statements(path):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return {n for n in names if not n.startswith("__")}


def _plain_state(value: Any, depth: int) -> bool:
    if isinstance(value, FILE_STATE_TYPES):
        return True
    if depth > 1 or not isinstance(value, (dict, list)) or len(value) > FILE_STATE_ITEMS:
        return False
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    return all(isinstance(k, (str, int)) and _plain_state(v, depth + 1) for k, v in items)


def _same_value(current: Any, saved: Any) -> bool:
    """Equal, a NaN equal to a NaN (a ``best = float("nan")`` that nothing changed has not changed)."""
    if isinstance(current, float) and isinstance(saved, float) and math.isnan(current) and math.isnan(saved):
        return True
    try:
        return bool(current == saved)
    except Exception:  # noqa: BLE001 - a value whose comparison raises: changed
        return False


def _put_back(module: types.ModuleType, name: str, saved: Any) -> None:
    """``saved`` under ``name`` again: a dict or list the name still holds is refilled in place."""
    current = getattr(module, name, None)
    if isinstance(current, dict) and isinstance(saved, dict):
        current.clear()
        current.update(copy.deepcopy(saved))
    elif isinstance(current, list) and isinstance(saved, list):
        current[:] = copy.deepcopy(saved)
    else:
        setattr(module, name, copy.deepcopy(saved))


def near_misses(path: Path, module: types.ModuleType, absent: list[str]) -> dict[str, dict[str, str]]:
    """For each contract name in ``absent``: the callables defined at the file's top level (a ``def``, or an
    assignment such as ``criterion = nn.MSELoss()``; not what it imports) whose names look like it, with
    their signatures. Names the file itself binds are read from its source, so an imported ``mse_loss`` or
    a torch function never counts."""
    if not absent:
        return {}
    defined: list[str] = []
    for node in top_level_statements(path):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.extend(t.id for t in targets if isinstance(t, ast.Name))
    found: dict[str, dict[str, str]] = {}
    for name in absent:
        matches = {
            n: _signature(getattr(module, n))
            for n in dict.fromkeys(defined)
            if n != name and _looks_like(n, name) and callable(getattr(module, n, None))
        }
        if matches:
            found[name] = matches
    return found


def _looks_like(candidate: str, name: str) -> bool:
    lowered = candidate.lower()
    return lowered in NEAR_MISSES[name] or (name == "loss" and "loss" in lowered)


def _signature(value: Any) -> str:
    try:
        return str(inspect.signature(value))
    except (TypeError, ValueError):
        return ""


def module_name_for(path: Path) -> str:
    """The name the file is imported under: its own name, unless that would shadow another module.

    Under its own name (as ``import your_file`` would), classes defined in the
    file can be pickled into worker processes, which import it again from the
    folder on ``sys.path``. A name taken by another module (``torch.py``,
    ``json.py``, a package beside the file) gets a private name instead.
    """
    stem = path.stem
    private = f"_fp16doctor_training_{abs(hash(str(path.resolve()))):x}"
    if (
        not stem.isidentifier()
        or keyword.iskeyword(stem)
        or stem in sys.builtin_module_names
        or stem in sys.stdlib_module_names
    ):
        return private
    loaded = sys.modules.get(stem)
    if loaded is not None:
        return stem if getattr(loaded, MARKER, None) is not None else private
    try:
        found = importlib.util.find_spec(stem)
    except (ImportError, ValueError):
        return private
    same_file = found is not None and found.origin is not None and Path(found.origin).resolve() == path.resolve()
    return stem if found is None or same_file else private


def _import_as_module(path: Path) -> types.ModuleType:
    """Execute the file as a module registered in ``sys.modules``, its folder first on ``sys.path``."""
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # siblings of the file import as they would under `python file.py`
    module_name = module_name_for(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise TrainingFileError(f"'{path}' cannot be loaded as a Python file.", hint="Give a .py file.")
    module = importlib.util.module_from_spec(spec)
    setattr(module, MARKER, str(path.resolve()))
    sys.modules[module_name] = module  # dataclasses and pickling look the module up while it executes
    argv = sys.argv
    # The file's top level sees the command line `python your_file.py` would give it: an argparse parser
    # at module level gets its defaults, not fp16doctor's own arguments.
    sys.argv = [str(path)]
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(module_name, None)
        raise TrainingFileError(
            f"importing the training file called sys.exit({exc.code!r}).",
            location=user_frame(exc, path),
            hint="The file's top level runs on import, with no command-line arguments: keep argument parsing "
            'with required arguments, and the training loop, under `if __name__ == "__main__":`.',
        ) from exc
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)  # only the broken file itself: never what it imported
        raise TrainingFileError(
            f"syntax error in training file: {exc.msg}.",
            location=f"{exc.filename}:{exc.lineno}",
            hint="Fix the line shown and run again.",
        ) from exc
    except Exception as exc:  # noqa: BLE001 - anything the user's top level raises
        sys.modules.pop(module_name, None)
        raise TrainingFileError(
            f"importing the training file raised {type(exc).__name__}: {exc}",
            location=user_frame(exc, path),
            hint=missing_file_hint(
                exc, "The file's top level must run without error (python your_file.py should work)."
            ),
        ) from exc
    finally:
        sys.argv = argv
    return module


def uncompiled(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The module a ``torch.compile`` wrapper holds, and the wrapper (None: there was none). A module compiled in
    place (``Module.compile()``) is made eager again; its compiled program is not kept (a compiled probe compiles
    it anew, with the options recorded).

    The doctor's instrumented probes measure the eager module: its instruments hook every submodule and its
    tracer follows every aten operator, which a compiled graph hides. A compiled probe runs the wrapper beside
    them, because inductor's numerics are not eager's (it keeps element-wise chains in fp32 registers).
    """
    inner = compile_wrapper_inner(model)
    if inner is not None:
        return inner, model
    if getattr(model, "_compiled_call_impl", None) is not None:
        model._compiled_call_impl = None
    return model, None


def missing_file_hint(exc: BaseException, hint: str) -> str:
    """``hint``, and for a file the user's code could not find, where relative paths start from."""
    if isinstance(exc, FileNotFoundError):
        return (
            f"Relative paths start from the current directory ({Path.cwd()}), as under `python your_file.py` run "
            "from here: run fp16doctor from the folder you train from, or build paths from "
            "`Path(__file__).parent`. " + hint
        )
    return hint


def build_model(spec: TrainingSpec) -> torch.nn.Module:
    """Call ``model()`` and check it returned a Module: the eager module (a compiled one's inside)."""
    return build_model_and_program(spec)[0]


def build_model_and_program(spec: TrainingSpec) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Call ``model()`` and check it returned a Module: the eager module, and the ``torch.compile`` wrapper it came
    in (None: eager, or compiled in place). How it was compiled is kept on the spec."""
    recorder = CompileRecorder()
    try:
        with recorder.recording():
            model = spec.model()
    except Exception as exc:  # noqa: BLE001
        raise TrainingFileError(
            f"model() raised {type(exc).__name__}: {exc}",
            location=spec.user_location(exc),
            hint=missing_file_hint(exc, "model() must build and return the torch.nn.Module to train."),
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise TrainingFileError(
            f"model() returned {type(model).__name__}, not a torch.nn.Module.",
            hint="Return the module itself (e.g. `return nn.Sequential(...)`).",
            location=f"{spec.path}:{inspect.unwrap(spec.model).__code__.co_firstlineno}",
        )
    options = recorder.options_of(model)
    model, program = uncompiled(model)
    if options is None:  # compiled block by block, the model around them eager: a compiled probe compiles them again
        options = recorder.parts_of(model)
    make_eager(model)  # every block compiled, at any depth, eager again: the instrumented probes see them
    if options is not None:
        spec.compiled = options
        spec.note(COMPILED_NOTE if not options.modules else compiled_parts_note(options.modules))
    return model, program


def _data_from(spec: TrainingSpec, step: int) -> Iterator[Any]:
    """The file's batches from optimizer step ``step`` on: ``data(start_step=step)`` where ``data`` takes it, else
    ``data()`` advanced past ``step`` batches, a new pass over it for each epoch it runs out."""
    if step and "start_step" in inspect.signature(spec.data).parameters:
        return iter(spec.data(start_step=step))
    source = spec.data()
    if step and isinstance(source, Sized) and len(source) > 0:
        step %= len(source)
    batches, passed = iter(source), 0
    while passed < step:
        if next(batches, _END) is _END:
            if passed == 0:
                return iter(())
            step, passed, batches = step % passed, 0, iter(spec.data())  # one epoch: passed batches
            continue
        passed += 1
    return itertools.chain(batches, spec.data()) if step else batches  # past the epoch's end: the next epoch


_END = object()


def draw_batches(spec: TrainingSpec, count: int) -> list[Any]:
    """Draw ``count`` batches once (cycling a shorter iterable) so every probe replays the same data."""
    from .batches import check_batch, detach_copy

    try:
        source = _data_from(spec, spec.start.step if spec.start is not None else 0)
        first = list(itertools.islice(source, count))
    except Exception as exc:  # noqa: BLE001
        raise TrainingFileError(
            f"data() raised {type(exc).__name__}: {exc}",
            location=spec.user_location(exc),
            hint=missing_file_hint(
                exc, "data() must return an iterable of batches (a list, a generator or a DataLoader)."
            ),
        ) from exc
    if not first:
        raise TrainingFileError(
            "data() yielded no batches.",
            hint="Return at least one batch: a tensor, a tuple/list of tensors or a dict of tensors.",
            location=f"{spec.path}:{inspect.unwrap(spec.data).__code__.co_firstlineno}",
        )
    for index, batch in enumerate(first):
        check_batch(batch, index)
    batches = [detach_copy(b) for b in first]
    while len(batches) < count:  # a short dataset is cycled, as epochs would
        batches.append(batches[len(batches) % len(first)])
    return batches
