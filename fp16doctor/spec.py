"""Loading the user's training file and checking it against the contract.

The training file is plain Python that never imports fp16doctor. It defines
``model()`` and ``data()`` and, optionally, ``loss``, ``optimizer``,
``scheduler``, ``train_step`` and ``CONFIG``. Loading it must not leave traces
in the interpreter (``sys.path``, ``sys.modules``), because the doctor may load
several files in one process (tests do) and must not shadow the user's
packages with one another.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

# Import what training files commonly import before loading one: modules the
# user's import adds are removed from sys.modules again, and torch submodules
# must not be imported twice (class identity would break).
import torch.nn.functional  # noqa: F401
import torch.optim.lr_scheduler  # noqa: F401
import torch.utils.data  # noqa: F401

from .errors import TrainingFileError

REQUIRED = ("model", "data")
OPTIONAL_CALLABLES = ("loss", "optimizer", "scheduler", "train_step")


@dataclass
class TrainingSpec:
    """What the training file provides; optional parts are ``None``."""

    path: Path
    module: types.ModuleType
    model: Callable[[], torch.nn.Module]
    data: Callable[[], Iterable[Any]]
    loss: Callable[..., torch.Tensor] | None
    optimizer: Callable[..., torch.optim.Optimizer] | None
    scheduler: Callable[..., Any] | None
    train_step: Callable[..., Any] | None
    config: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.stem

    def user_location(self, exc: BaseException) -> str | None:
        """``file:line`` of the deepest traceback frame inside the training file."""
        return user_frame(exc, self.path)


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


class UserModules:
    """The modules the training file's code imported: out of ``sys.modules`` between calls, back in during them.

    Loading a training file must leave ``sys.modules`` and ``sys.path`` as they
    were; but libraries that import lazily (Hugging Face's) would re-import a
    fresh copy of themselves if their package vanished while the user's code
    runs. So every call into the file (and every batch drawn from ``data()``)
    runs with the file's imports in place and its folder on ``sys.path``.
    """

    def __init__(self, directory: Path):
        self.directory = str(directory.resolve())
        self.modules: dict[str, types.ModuleType] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved_path, before = list(sys.path), set(sys.modules)
        sys.modules.update({k: v for k, v in self.modules.items() if k not in sys.modules})
        sys.path.insert(0, self.directory)  # siblings of the file import as they would under `python file.py`
        try:
            yield
        finally:
            sys.path[:] = saved_path
            for name in set(sys.modules) - before:
                self.modules[name] = sys.modules.pop(name)

    def wrap(self, fn: Callable[..., Any] | None) -> Callable[..., Any] | None:
        if fn is None:
            return None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.active():
                return fn(*args, **kwargs)

        return call

    def wrap_data(self, fn: Callable[[], Iterable[Any]]) -> Callable[[], Iterable[Any]]:
        """``data()`` whose iteration (a generator's body, a DataLoader) also runs with the file's imports."""

        @functools.wraps(fn)
        def data() -> Iterable[Any]:
            with self.active():
                source = fn()
            return self._iterate(source)

        return data

    def _iterate(self, source: Iterable[Any]) -> Iterator[Any]:
        with self.active():
            iterator = iter(source)
        while True:
            with self.active():
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item


def load_training_file(path: str | Path) -> TrainingSpec:
    """Import the training file in isolation and check the contract's names."""
    path = Path(path)
    if not path.is_file():
        raise TrainingFileError(
            f"training file '{path}' does not exist.",
            hint="Pass the path of a Python file that defines model() and data().",
        )
    scope = UserModules(path.parent)
    module = _import_isolated(path, scope)
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise TrainingFileError(
            f"training file '{path}' does not define {' and '.join(n + '()' for n in missing)}.",
            hint="A training file needs `def model() -> torch.nn.Module` and `def data() -> iterable of batches`; see the README.",
        )
    optional = {}
    for name in OPTIONAL_CALLABLES:
        value = getattr(module, name, None)
        if value is not None and not callable(value):
            raise TrainingFileError(f"'{name}' in '{path}' must be a function, got {type(value).__name__}.")
        optional[name] = value
    config = getattr(module, "CONFIG", None) or {}
    if not isinstance(config, dict):
        raise TrainingFileError(f"CONFIG in '{path}' must be a dict, got {type(config).__name__}.")
    return TrainingSpec(path=path, module=module, model=scope.wrap(module.model), data=scope.wrap_data(module.data),
                        config=config, **{name: scope.wrap(fn) for name, fn in optional.items()})


def _import_isolated(path: Path, scope: UserModules) -> types.ModuleType:
    """Execute the file as a fresh module inside ``scope``: sys.path and sys.modules are restored afterwards."""
    module_name = f"_fp16doctor_user_{path.stem}_{abs(hash(str(path.resolve()))):x}"
    with scope.active():
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise TrainingFileError(f"'{path}' cannot be loaded as a Python file.", hint="Give a .py file.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look the module up while it executes
        try:
            spec.loader.exec_module(module)
        except SyntaxError as exc:
            raise TrainingFileError(
                f"syntax error in training file: {exc.msg}.",
                location=f"{exc.filename}:{exc.lineno}",
                hint="Fix the line shown and run again.",
            ) from exc
        except Exception as exc:  # noqa: BLE001 - anything the user's top level raises
            raise TrainingFileError(
                f"importing the training file raised {type(exc).__name__}: {exc}",
                location=user_frame(exc, path),
                hint="The file's top level must run without error (python your_file.py should work).",
            ) from exc
    return module


def build_model(spec: TrainingSpec) -> torch.nn.Module:
    """Call ``model()`` and check it returned a Module."""
    try:
        model = spec.model()
    except Exception as exc:  # noqa: BLE001
        raise TrainingFileError(
            f"model() raised {type(exc).__name__}: {exc}", location=spec.user_location(exc),
            hint="model() must build and return the torch.nn.Module to train.",
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise TrainingFileError(
            f"model() returned {type(model).__name__}, not a torch.nn.Module.",
            hint="Return the module itself (e.g. `return nn.Sequential(...)`).",
            location=f"{spec.path}:{inspect.unwrap(spec.model).__code__.co_firstlineno}",
        )
    return model


def draw_batches(spec: TrainingSpec, count: int) -> list[Any]:
    """Draw ``count`` batches once (cycling a shorter iterable) so every probe replays the same data."""
    from .batches import check_batch, detach_copy

    try:
        source = spec.data()
        first = list(itertools.islice(iter(source), count))
    except Exception as exc:  # noqa: BLE001
        raise TrainingFileError(
            f"data() raised {type(exc).__name__}: {exc}", location=spec.user_location(exc),
            hint="data() must return an iterable of batches (a list, a generator or a DataLoader).",
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
