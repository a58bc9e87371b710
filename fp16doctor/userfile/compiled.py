"""What a watched script compiles, and how: ``torch.compile`` observed while the watch runs.

A capsule of a compiled model records the options it was compiled with (backend, mode, dynamic, fullgraph, the
inductor options), because the compiled program's numerics are not the eager ones: inductor computes fp16/bf16
element-wise chains in fp32 registers and rounds only what it stores. ``torch.compile`` itself is wrapped, not
``OptimizedModule``, so that ``torch.compile(model)``, ``@torch.compile(mode=...)`` and ``Module.compile()`` are all
seen, and the compiled program is the one torch builds: the wrapper only passes the call on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config import COMPILE_BACKENDS, CompileConfig
from ..errors import ConfigError
from .modules import compile_wrapper_inner, compiled_call


@dataclass(frozen=True)
class CompileOptions:
    """The arguments a script gave ``torch.compile``, as a capsule's manifest records them."""

    backend: str = "inductor"
    """The backend's name (a custom backend: its function's qualified name)."""
    mode: str | None = None
    """``default``, ``reduce-overhead``, ``max-autotune`` ...; None: not given (inductor's default)."""
    dynamic: bool | None = None
    """Dynamic shapes: True, False, or None (dynamo decides after a recompile)."""
    fullgraph: bool = False
    """Whether a graph break is an error."""
    options: dict[str, Any] = field(default_factory=dict)
    """The inductor options given (values that are not JSON numbers, strings or booleans are written as text)."""
    compiler: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    """The backend itself where the call gave a function (a custom backend): what a graph trace wraps. Not in
    :meth:`to_json` (a capsule records its name)."""
    modules: tuple[str, ...] = ()
    """The submodules compiled one by one with these options (``block.compile()`` per block, or a block replaced
    by ``torch.compile(block)``), the model around them eager; empty: the model itself is compiled."""

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "mode": self.mode,
            "dynamic": self.dynamic,
            "fullgraph": self.fullgraph,
            "options": self.options,
            "modules": list(self.modules),
        }

    @classmethod
    def from_call(cls, kwargs: dict[str, Any]) -> CompileOptions:
        backend = kwargs.get("backend") or "inductor"
        return cls(
            backend=backend if isinstance(backend, str) else _callable_name(backend),
            mode=kwargs.get("mode"),
            dynamic=kwargs.get("dynamic"),
            fullgraph=bool(kwargs.get("fullgraph", False)),
            options={str(k): _plain(v) for k, v in (kwargs.get("options") or {}).items()},
            compiler=None if isinstance(backend, str) else backend,
        )


def _callable_name(fn: Any) -> str:
    """``module.function``; a script's own function (``__main__``) by its name alone, as its author knows it."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    module = getattr(fn, "__module__", "?")
    return name if module == "__main__" else f"{module}.{name}"


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


class EagerAround:
    """A module compiled in place (``Module.compile()``), its compiled call with the watch's observation of the call
    around it, eager. The module's own hooks, and the global ones, run inside the compiled ``_call_impl``, where
    dynamo traces them: only around it can the watch see the call's inputs and outputs without entering the graph.
    """

    def __init__(self, module: torch.nn.Module, program: Callable[..., Any], observer: CallObserver) -> None:
        self._module = weakref.ref(module)  # the module holds this: no cycle keeping it alive
        self.program = program
        self.observer = observer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            return self.program(*args, **kwargs)
        self.observer.call_starts(module, args)
        try:
            output = self.program(*args, **kwargs)
        except BaseException:
            self.observer.call_raised(module)
            raise
        self.observer.call_ends(module, args, kwargs, output)
        return output


class CallObserver(Protocol):
    """What observes a call around a compiled program (a no-op once the watch has ended)."""

    def call_starts(self, module: torch.nn.Module, args: Any) -> None: ...

    def call_raised(self, module: torch.nn.Module) -> None: ...

    def call_ends(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None: ...


def _in_place_owner(model: Any) -> torch.nn.Module | None:
    """The module ``Module.compile()`` compiles: ``torch.compile`` is given its bound ``_call_impl``."""
    owner = getattr(model, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(model, "__func__", None) is torch.nn.Module._call_impl:
        return owner
    return None


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether the watch observes ``module``'s calls around its in-place compiled program."""
    return isinstance(getattr(module, "_compiled_call_impl", None), EagerAround)


class CompileRecorder:
    """The options of every ``torch.compile`` call the script made while watched, by what each call returned."""

    def __init__(self, observer: CallObserver | None = None) -> None:
        """``observer``: told of every call of a module compiled in place (the watch); None: such a module is left
        as torch compiled it."""
        self._options: weakref.WeakKeyDictionary[Any, CompileOptions] = weakref.WeakKeyDictionary()
        self._observer = observer
        self.functions_compiled = False
        """A function (not a module) was compiled: a training step, whose model calls run inside its graph."""

    def observed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``torch.compile``, recording its options; a decorator form (no model yet) is recorded when applied."""

        @functools.wraps(original)
        def compile_observed(model: Any = None, **kwargs: Any) -> Any:
            result = original(model, **kwargs)
            if model is None:
                return result
            owner = _in_place_owner(model)
            if owner is not None and self._observer is not None:
                result = EagerAround(owner, result, self._observer)
            elif not isinstance(model, torch.nn.Module) and not kwargs.get("disable"):
                self.functions_compiled = True
            self._remember(result, CompileOptions.from_call(kwargs))
            return result

        return compile_observed

    @contextlib.contextmanager
    def recording(self) -> Iterator[CompileRecorder]:
        """``torch.compile`` observed inside the block (a training file's ``model()``)."""
        original = vars(torch)["compile"]
        torch.compile = self.observed(original)
        try:
            yield self
        finally:
            torch.compile = original

    @property
    def compiled_any(self) -> bool:
        """Something was compiled while watched: a model, a submodule, a function."""
        return len(self._options) > 0 or self.functions_compiled

    def _remember(self, compiled: Any, options: CompileOptions) -> None:
        try:
            self._options[compiled] = options
        except TypeError:  # a result that takes no weak reference: nothing to look up later
            pass

    def parts_of(self, model: torch.nn.Module) -> CompileOptions | None:
        """Where ``model``'s submodules were compiled one by one: the first one's options, naming them all
        (``modules``: the outermost compiled ones); None where none was. Blocks compiled with other options than
        the first are compiled again with the first's."""
        parts = _compiled_blocks(model)
        if not parts:
            return None
        first = self.options_of(parts[0][1])
        assert first is not None
        return dataclasses.replace(first, modules=tuple(name for name, _ in parts))

    def options_of(self, module: torch.nn.Module) -> CompileOptions | None:
        """How the compiled program a call of ``module`` runs was compiled; None: it is not compiled. A program
        compiled before the watch began has the backend ``unknown``."""
        program = compiled_call(module)
        if program is None:
            return None
        return self._options.get(program) or CompileOptions(backend="unknown")


def make_eager(model: torch.nn.Module) -> None:
    """Every submodule of ``model`` that runs a compiled program, at any depth, made eager again (a block nested in
    a compiled block, blocks compiled inside a model that is compiled too)."""
    while True:
        found = next(((n, m) for n, m in model.named_modules() if n and compiled_call(m) is not None), None)
        if found is None:
            return
        _eager_again(model, *found)


def _eager_again(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    inner = compile_wrapper_inner(module)
    if inner is None:
        module._compiled_call_impl = None
        return
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, inner)


def compile_parts(model: torch.nn.Module, names: tuple[str, ...], backend: Any, **options: Any) -> None:
    """Each of ``model``'s submodules ``names`` compiled in place with these options, the model around them eager
    (its parameters keep their names). Dynamo's caches are reset first: the parts of the probe's model before were
    of the same classes, and every new instance compiled would count towards its recompile limit."""
    torch._dynamo.reset()
    for name in names:
        model.get_submodule(name).compile(backend=backend, **options)


def _compiled_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost submodules whose calls run a compiled program (the model itself not compiled)."""
    parts: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if name and not any(name.startswith(f"{part}.") for part, _ in parts) and compiled_call(module) is not None:
            parts.append((name, module))
    return parts


def training_compiles(settings: CompileConfig, recorded: CompileOptions | None) -> bool:
    """Whether the training runs compiled: as ``compile.enabled`` says, or (null) as ``model()`` returns it
    (``recorded``: how it compiled, None where it returned an eager module)."""
    return settings.enabled if settings.enabled is not None else recorded is not None


def compiled_program(
    model: torch.nn.Module,
    program: torch.nn.Module | None,
    settings: CompileConfig,
    recorded: CompileOptions | None,
    backend: Callable[..., Any] | None = None,
    parts_of: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """What a compiled probe calls: ``model()``'s own compiled module where the settings change nothing (the
    user's program, a custom backend included), else ``model`` compiled with them over what ``model()`` compiled
    with: its backend (a custom one too, where ``model()`` gave the function: a module compiled in place), its
    ``dynamic`` and ``fullgraph`` (a graph break ``fullgraph`` refuses is the training's own error, in every
    variant tried, except where the settings run regions eagerly: those breaks are the doctor's); inductor where the recorded backend cannot be called (a capsule's custom one).
    ``backend``: ``model`` compiled anew with this backend function (a graph trace's), whatever the settings say.
    Where ``model()`` compiled submodules one by one (``recorded.modules``), those of ``parts_of`` (the module
    ``model()`` built, where ``model`` wraps it for the ranks) are compiled in place, and ``model`` is the program."""
    dynamic = recorded.dynamic if recorded is not None else None
    # the doctor's own graph breaks (the regions it runs eagerly) are no fault fullgraph should refuse
    fullgraph = recorded.fullgraph and not settings.eager_modules if recorded is not None else False
    parts = recorded.modules if recorded is not None else ()
    if backend is not None:
        if parts:
            compile_parts(parts_of or model, parts, backend, dynamic=dynamic, fullgraph=fullgraph)
            return model
        traced = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
        assert isinstance(traced, torch.nn.Module)
        return traced
    if program is not None and settings.as_model_compiles:
        return program
    chosen = settings.backend or _recorded_backend(recorded)
    mode = settings.mode if settings.mode is not None else (recorded.mode if recorded is not None else None)
    options: dict[str, Any] | None = (
        {"emulate_precision_casts": True} if settings.emulate_precision_casts and chosen == "inductor" else None
    )
    if options is not None:
        mode = None  # torch.compile takes a mode or options, not both: the emulation is what is tried
    if parts:  # compiled block by block, as model() compiled it: the model around them stays eager
        given = {**(recorded.options if recorded is not None else {}), **(options or {})}
        compile_parts(
            parts_of or model, parts, chosen, mode=mode, dynamic=dynamic, fullgraph=fullgraph, options=given or None
        )
        return model
    compiled = torch.compile(model, backend=chosen, mode=mode, dynamic=dynamic, fullgraph=fullgraph, options=options)
    assert isinstance(compiled, torch.nn.Module)  # torch.compile of a module is its OptimizedModule
    return compiled


def _recorded_backend(recorded: CompileOptions | None) -> str | Callable[..., Any]:
    """The backend ``model()`` compiled with: by name, its function (a custom one), or inductor where neither is
    known (a capsule keeps a custom backend's name only)."""
    if recorded is None:
        return "inductor"
    if recorded.compiler is not None:  # a function, whatever its name (a script's own may be called "eager")
        return recorded.compiler
    return recorded.backend if recorded.backend in COMPILE_BACKENDS else "inductor"


def run_eagerly(model: torch.nn.Module, names: list[str]) -> None:
    """The submodules ``names`` of ``model`` run eagerly inside any program compiled from it: their forward under
    ``torch.compiler.disable`` (dynamo breaks the graph at their call and runs them as eager does), the rest
    compiled as before. A name ``model`` has not is a config error that lists the names it has."""
    for name in names:
        try:
            region = model.get_submodule(name)
        except AttributeError:
            children = ", ".join(n for n, _ in model.named_children()) or "none"
            raise ConfigError(
                f"config key 'compile.eager_modules' names {name!r}, which the model has not.",
                hint=f"Name submodules as model.named_modules() does (its children: {children}).",
            ) from None
        region.forward = torch.compiler.disable(region.forward)


def aten_operator(name: str) -> Any:
    """``aten.rsqrt`` (or ``aten.rsqrt.default``) as its operator; None where this torch has no such operator."""
    parts = name.split(".")
    if len(parts) not in (2, 3) or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    if packet is None or len(parts) == 2:
        return packet
    return getattr(packet, parts[2], None)


@contextlib.contextmanager
def inductor_fallbacks(names: list[str]) -> Iterator[None]:
    """While the block runs, inductor leaves the operators ``names`` to their ATen kernels instead of lowering them
    (as ``torch._inductor.lowering.make_fallback`` does), then its own lowerings come back. Inductor's compiled-graph
    caches are off meanwhile (:func:`graph_caches_off`)."""
    if not names:
        yield
        return
    from torch._inductor.lowering import fallback_handler, lowerings

    unknown = [name for name in names if aten_operator(name) is None]
    if unknown:
        raise ConfigError(
            f"config key 'compile.fallback_ops' names no ATen operator of this torch: {', '.join(unknown)}.",
            hint="Name them as torch.ops spells them: aten.rsqrt, aten.native_layer_norm.",
        )
    targets = [aten_operator(name) for name in names]
    overloads = [getattr(t, o) for t in targets if hasattr(t, "overloads") for o in t.overloads()]
    overloads += [t for t in targets if not hasattr(t, "overloads")]
    saved = {op: lowerings[op] for op in overloads if op in lowerings}
    with graph_caches_off():
        try:
            for op in saved:
                lowerings[op] = fallback_handler(op, add_to_fallback_set=False)
            yield
        finally:
            lowerings.update(saved)


@contextlib.contextmanager
def graph_caches_off() -> Iterator[None]:
    """Inductor's and AOT autograd's caches of compiled graphs off while the block runs: their keys hold the graph
    and the settings, not the lowerings in place nor the compiler bisector's state, so a program compiled before
    would come back. The kernels' own cache stays: a kernel is keyed by its source."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with (
        inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
        functorch_config.patch(enable_autograd_cache=False),
    ):
        yield
