"""The compiled program's first non-finite value, and its first value eager would not make, node by node: where a
custom backend's graph makes them.

A custom ``torch.compile`` backend receives dynamo's FX graph and returns what runs in its place. Where that is an
FX ``GraphModule`` (or its ``forward``), as graph passes return it, the doctor can run the graph it returned one node
at a time (``torch.fx.Interpreter``) and look at every value it makes: the first node whose output holds an inf or a
NaN while every value it read was finite is where the compiled program's fault is born, with the user's source line
and module that node came from. A backend that returns anything else (a compiled kernel, inductor's program) is
opaque: the trace says so and the localisation stops at the region run eagerly.

A backend that computes something else without any inf or NaN (a pass that swaps an operator for one in another
precision: the training drifts) is found by comparison: on its graph's first call, dynamo's graph as the backend
received it runs eagerly on the same values first, and each node of the backend's graph is compared with the
node of the same name there. The first node whose output differs while every value it read agreed (or the first
node the backend added, upstream of one that differs) is where the compiled program stops computing what eager
computes. A graph the backend built itself (a new ``GraphModule``: its nodes share no names with dynamo's) is
compared by its outputs only.

The same non-finite trace runs AOT autograd's forward graph (the ``aot_eager`` backend), at the ATen level, where the fault is made
there. Only forward graphs are traced: dynamo's graph is the forward, and autograd differentiates its traced nodes
eagerly; a backward graph's first inf is, in fp16, most often a GradScaler's calibration overflowing on purpose.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

TORCH_HOME = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class TracedNode:
    """A node of the backend's graph the trace names: the first that made a non-finite value out of finite ones, or
    the first whose output differs from eager's on the same values."""

    step: int
    """The probe step it ran in (0-based)."""
    node: str
    """The node's name in the backend's graph (``layer_norm``, ``add_1``)."""
    operator: str
    """What the node calls: a function's qualified name, a method's name, or a submodule's path."""
    source: str | None
    """The user's line it was traced from (``model.py:42``), from the node's stack trace; None where it has none."""
    module: str | None
    """The module whose forward it was traced in (``blocks.0.norm``); None: the model's own forward."""
    graph: str = "the backend's graph"
    """The graph it is a node of: the custom backend's, or AOT autograd's forward or backward."""
    relative_difference: float | None = None
    """For a node that differs from eager: the largest difference of its output (or, for a node the backend added,
    of the first compared node it feeds) from eager's, relative to eager's largest magnitude; None for a
    non-finite node."""
    added: bool = False
    """The backend added this node: dynamo's graph has none of its name (the difference shows in what it feeds)."""
    outputs_only: bool = False
    """The backend returned a graph of its own (a new ``GraphModule``, its nodes named its own way): only its
    outputs could be compared with eager's, and ``node`` is its output."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "node": self.node,
            "operator": self.operator,
            "source": self.source,
            "module": self.module,
            "graph": self.graph,
            "relative_difference": self.relative_difference,
            "added": self.added,
            "outputs_only": self.outputs_only,
        }

    def sentence(self) -> str:
        if self.outputs_only:
            off = (
                f", {self.relative_difference:.2g} off eager's (relative)"
                if self.relative_difference is not None
                else ""
            )
            return (
                f"the outputs of a graph the backend built itself (a new GraphModule, whose nodes cannot be matched "
                f"with dynamo's: compared by its outputs only) at step {self.step}{off}"
            )
        where = f" in {self.module}" if self.module else ""
        line = f", traced from {self.source}" if self.source else ""
        added = ", added by the backend" if self.added else ""
        text = f"node {self.node} of {self.graph} ({self.operator}{where}{line}{added}) at step {self.step}"
        if self.relative_difference is not None:
            text += f", {self.relative_difference:.2g} off eager's (relative)"
        return text


@dataclass
class GraphTrace:
    """What the traced backend saw across the probe: the first non-finite node, and whether every graph it
    returned could be traced."""

    first: TracedNode | None = None
    first_difference: TracedNode | None = None
    """The first node whose output differs from dynamo's graph run eagerly on the same values (custom backends)."""
    opaque: list[str] = field(default_factory=list)
    """The types of what the backend returned that is not an FX graph (nothing could be looked into)."""
    step: int = 0
    """The probe step running now (the stage moves it on)."""
    compare_with_eager: bool = False
    """Compare each graph's first call with dynamo's graph run eagerly (a drift's trace: it holds a copy of every
    value of that forward once)."""

    def backend(self, compiler: Callable[..., Any]) -> Callable[..., Any]:
        """``compiler`` (the training's own backend) with each graph it returns run node by node; with
        :attr:`compare_with_eager`, a graph the backend rewrote in place is also compared with dynamo's as it
        received it (a new ``GraphModule`` names its nodes its own way: nothing to match them by)."""

        def traced_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            eager = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)) if self.compare_with_eager else None
            compiled = compiler(gm, example_inputs)
            graph = _graph_of(compiled)
            if graph is None:
                self.opaque.append(type(compiled).__name__)
                return compiled
            compared = False

            def run(*args: Any) -> Any:
                nonlocal compared
                reference = None
                if eager is not None and not compared and self.first_difference is None:  # the same weights
                    compared = True
                    try:
                        reference = EagerRun.of(eager, args, outputs_only=graph is not gm)
                    except Exception:  # noqa: BLE001 - dynamo's graph does not run eagerly here: nothing to compare
                        reference = None
                return _FirstNonfinite(graph, self, "the backend's graph", reference).run(*args)

            return run

        return traced_backend

    def aot_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The ``aot_eager`` backend with AOT autograd's forward graph run node by node (its backward as
        ``aot_eager`` runs it: a GradScaler's first steps overflow gradients on purpose, which would be named)."""
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs, fw_compiler=self._aot_forward)

    def _aot_forward(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """AOT autograd's forward graph, run node by node: boxed, as AOT autograd calls its compilers' programs."""

        def run(args: list[Any]) -> Any:
            return _FirstNonfinite(graph, self, "AOT autograd's forward graph").run(*args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run


def _graph_of(compiled: Any) -> torch.fx.GraphModule | None:
    """The FX graph a backend returned: the ``GraphModule`` itself or its bound ``forward``."""
    if isinstance(compiled, torch.fx.GraphModule):
        return compiled
    owner = getattr(compiled, "__self__", None)
    return owner if isinstance(owner, torch.fx.GraphModule) else None


class _FirstNonfinite(torch.fx.Interpreter):
    """Runs the graph as its ``forward`` would, and names the node its non-finite output comes from: where the
    graph returns an inf or NaN, the first node that made one out of finite values (a non-finite input is some
    earlier node's, or the batch's: not born here) and from which a chain of non-finite values reaches the output.
    An inf that does not reach it (an additive attention mask at ``finfo.min``, which softmax turns into 0) is no
    cause. A value an in-place node wrote (``h.mul_(1e9)``) is read, by the nodes after it, as that node's."""

    def __init__(
        self, graph: torch.fx.GraphModule, trace: GraphTrace, name: str, reference: EagerRun | None = None
    ) -> None:
        super().__init__(graph)
        self.trace = trace
        self.name = name
        self.reference = reference
        """Dynamo's graph run eagerly on the same arguments (None: not compared)."""
        self.agrees: dict[torch.fx.Node, bool | None] = {}
        """Per node: its value equals eager's (True), differs (False), or has no counterpart (None: added)."""
        self.finite: dict[torch.fx.Node, bool] = {}
        """Each node's value was finite when it was made (an in-place op may change it later)."""
        self.born: list[torch.fx.Node] = []
        """The nodes that made an inf or NaN out of finite values, in the order they ran."""
        self.written: dict[torch.fx.Node, torch.fx.Node] = {}
        """A node's value, and the in-place node that last wrote into it."""

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if self.reference is not None and self.trace.first_difference is None:
            self._compare(n, result)
        if self.trace.first is not None:
            return result
        self.finite[n] = _all_finite(result)
        if n.op == "output" and not self.finite[n]:
            self.trace.first = self._cause(n)
        elif n.op in ("call_function", "call_method", "call_module"):
            if self._born_here(n):
                self.born.append(n)
            for read in n.all_input_nodes:
                if self.env.get(read) is result:  # written in place: later readers read this node's value
                    self.written[read] = n
        return result

    def _compare(self, n: torch.fx.Node, result: Any) -> None:
        """Whether ``n``'s value is eager's; the first node that differs is named: one the backend changed (another
        operator under the same name), else one whose reads all agreed, else the first added node that fed it.
        A comparison that fails stops comparing (the non-finite trace goes on)."""
        assert self.reference is not None
        try:
            self._compare_node(n, result)
        except Exception:  # noqa: BLE001 - a value the comparison cannot read: no difference is named
            self.reference = None

    def _compare_node(self, n: torch.fx.Node, result: Any) -> None:
        assert self.reference is not None
        if n.op in ("placeholder", "get_attr"):
            self.agrees[n] = True
            return
        expected = self.reference.values.get(n.name, _ABSENT)
        if expected is _ABSENT:
            self.agrees[n] = None
            return
        difference = _relative_difference(result, expected)
        self.agrees[n] = difference == 0.0
        if difference == 0.0:
            return
        if self.reference.outputs_only:
            self.trace.first_difference = dataclasses.replace(self._named(n, difference), outputs_only=True)
            return
        reads = [self.agrees.get(read, True) for read in n.all_input_nodes]
        changed = n.op != "output" and self.reference.calls.get(n.name) != (n.op, n.target)
        if changed or all(reads):
            self.trace.first_difference = self._named(n, difference)
        elif not any(read is False for read in reads):  # fed by nodes the backend added, every other read agreed
            added = self._first_added(n)
            if added is not None:
                self.trace.first_difference = dataclasses.replace(self._named(added, difference), added=True)

    def _first_added(self, n: torch.fx.Node) -> torch.fx.Node | None:
        """The earliest node the backend added upstream of ``n`` (through added nodes only)."""
        found: set[torch.fx.Node] = set()
        pending = [n]
        while pending:
            for read in pending.pop().all_input_nodes:
                if self.agrees.get(read, True) is None and read not in found:
                    found.add(read)
                    pending.append(read)
        return next((node for node in self.agrees if node in found), None)  # ``agrees`` is in the order they ran

    def _source(self, read: torch.fx.Node) -> torch.fx.Node:
        """The node whose value reading ``read`` now reads: the last in-place node that wrote into it, or itself."""
        return self.written.get(read, read)

    def _born_here(self, n: torch.fx.Node) -> bool:
        """Every value ``n`` read was finite, and no constant it was given is infinite (``masked_fill(scores, mask,
        -inf)`` writes the inf an attention mask means to write)."""
        if self.finite[n] or not all(self.finite.get(self._source(read), True) for read in n.all_input_nodes):
            return False
        constants = tree_leaves((n.args, n.kwargs))  # a node read is a leaf too: only floats are looked at
        return not any(isinstance(c, float) and not math.isfinite(c) for c in constants)

    def _cause(self, output: torch.fx.Node) -> TracedNode | None:
        reaching, pending = set(), [output]
        while pending:
            node = pending.pop()
            for read in map(self._source, node.all_input_nodes):
                if not self.finite.get(read, True) and read not in reaching:
                    reaching.add(read)
                    pending.append(read)
        cause = next((n for n in self.born if n in reaching), self.born[0] if self.born else None)
        return None if cause is None else self._named(cause)

    def _named(self, n: torch.fx.Node, difference: float | None = None) -> TracedNode:
        """The node as the user knows it: an emulated product's stored fp16 output is named by its product, and
        the cast of a value that is no node's product (an input, a parameter) as autocast's cast."""
        shown, operator = n, _operator(n)
        if _is_stored_as(n) and n.all_input_nodes:
            made_by = n.all_input_nodes[0]
            if made_by.op in ("call_function", "call_method", "call_module"):
                shown, operator = made_by, f"{_operator(made_by)}, its output stored in {n.args[1]}"
            else:
                operator = f"autocast's cast of {made_by.name} to {n.args[1]}"
        return TracedNode(
            self.trace.step,
            shown.name,
            operator,
            _user_line(shown) or _user_line(n),
            _module_of(shown) or _module_of(n),
            self.name,
            difference,
        )


_ABSENT = object()
OUTPUT = "output"
"""The name FX gives every graph's output node: how a graph of the backend's own is matched with dynamo's."""


@dataclass
class EagerRun:
    """Dynamo's graph, as the backend received it, run eagerly: each node's value and what it calls, by name."""

    values: dict[str, Any]
    calls: dict[str, tuple[str, Any]]
    """Per node name: its (op, target), to tell a node the backend changed from one it left as it was."""
    outputs_only: bool = False
    """Only the graph's outputs are kept (``values`` holds the output node's): the graph it is compared with is one
    the backend built itself, whose nodes share no names with dynamo's."""

    @classmethod
    def of(cls, graph: torch.fx.GraphModule, args: tuple[Any, ...], outputs_only: bool = False) -> EagerRun:
        """``graph`` run on copies of ``args``, without autograd, and with the random generators of the devices the
        arguments are on given back as they were: the backend's graph then draws the same dropout masks, and a
        buffer the graph updates in place is updated once. ``outputs_only``: only the outputs are kept."""
        values: dict[str, Any] = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                result = super().run_node(n)
                values[n.name] = _copied(result)
                return result

        devices = sorted({a.device.index or 0 for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_cuda})
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            Recorder(graph).run(*(_copied(a) for a in args))
        if outputs_only:
            output = next(n for n in graph.graph.nodes if n.op == "output")
            return cls({OUTPUT: values[output.name]}, {}, outputs_only=True)
        return cls(values, {n.name: (n.op, n.target) for n in graph.graph.nodes})


def _copied(value: Any) -> Any:
    """``value`` with its tensors copied (detached): what a later in-place write cannot change."""
    return torch.utils._pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def _relative_difference(value: Any, expected: Any) -> float:
    """0 where ``value`` equals ``expected`` (NaN where both are NaN, the same inf where both are inf); else the
    largest difference of their floating tensors relative to the expected's largest finite magnitude, compared in
    fp32 or wider whatever each is stored in (inf where the non-finite entries differ, 1 where another value
    differs)."""
    got, want = tree_leaves(value), tree_leaves(expected)
    if len(got) != len(want):
        return 1.0
    worst = 0.0
    with torch.no_grad():
        for a, b in zip(got, want):
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                worst = max(worst, 0.0 if a is b or a == b else 1.0)
            elif a.shape != b.shape:
                worst = max(worst, 1.0)
            elif a.is_floating_point() and b.is_floating_point():
                worst = max(worst, _float_difference(a, b))
            elif a.dtype != b.dtype or not torch.equal(a, b):
                worst = max(worst, 1.0)
    return worst


def _float_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.detach().to(wide), b.detach().to(wide)
    if not (bool((a.isnan() == b.isnan()).all()) and bool(torch.where(a.isinf() | b.isinf(), a == b, True).all())):
        return math.inf
    finite = a.isfinite()
    if not bool(finite.any()):
        return 0.0
    spread = float((a - b)[finite].abs().max())
    scale = float(b[finite].abs().max())
    return 0.0 if spread == 0.0 else spread / scale if scale > 0 else math.inf


def _is_stored_as(n: torch.fx.Node) -> bool:
    """``fp16doctor::stored_as``: the cast with which the CUDA policy's emulated product stores its output."""
    return getattr(n.target, "namespace", None) == "fp16doctor"


def _all_finite(value: Any) -> bool:
    """Every floating tensor in ``value`` is finite; one whose values cannot be read so (an fp8 or a sparse
    tensor, without ``isfinite``) counts as finite: the trace names nothing rather than fail."""
    with torch.no_grad():
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                try:
                    if not bool(t.isfinite().all()):
                        return False
                except (NotImplementedError, RuntimeError):
                    continue
        return True


def _operator(n: torch.fx.Node) -> str:
    target = n.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # aten.mul.Tensor
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    shown = module and module != "__main__" and not module.startswith(("torch", "builtins", "_operator"))
    return f"{module}.{name}" if shown else name


def _user_line(n: torch.fx.Node) -> str | None:
    """The innermost frame of the node's stack trace outside torch (where the user's code made the call)."""
    frames = []
    for line in (n.meta.get("stack_trace") or "").splitlines():
        parts = line.strip().split('"')
        if line.strip().startswith("File ") and len(parts) > 2 and "line " in parts[2]:
            frames.append((parts[1], parts[2].split("line ")[1].split(",")[0]))
    users = [frame for frame in frames if not frame[0].startswith(TORCH_HOME)] or frames
    if not users:
        return None
    path, line = users[-1]
    return f"{os.path.basename(path)}:{line}"


def _module_of(n: torch.fx.Node) -> str | None:
    """The module path the node was traced in, from dynamo's ``nn_module_stack`` (innermost last)."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return _dynamo_path(str(path)) or None


def _dynamo_path(path: str) -> str:
    """``L['self'].blocks[0].norm`` (dynamo's spelling) as ``blocks.0.norm``."""
    for prefix in ("L['self'].", "L['self']", "self."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    return path.replace("[", ".").replace("]", "").replace("'", "")
