"""``serve-check --onnx``: the model as an fp16 ONNX export serves it, run on onnxruntime against FP32.

The FP32 model is exported with torch's exporter, then converted to fp16 with onnxruntime's own converter
(``onnxruntime.transformers.float16``): once whole, and once with the keep-set's nodes on its block list. Each
conversion runs on onnxruntime, on the batches the export's input shapes fit, and is compared with FP32's outputs as
the other ways of serving are.

Three things the conversion does that ``model.half()`` does not, each measured and reported:

* **It clamps.** An initializer past 65504 is stored as 65504, not inf: the model serves finite, and wrong.
* **It rounds at the block list's edges.** With the model's inputs and outputs kept fp32, the converter still casts
  a graph input to fp16 before the blocked nodes cast it back up, and a blocked node's fp32 output to fp16 before the
  graph's fp32 output: a value past 65504, or a difference of two large inputs, is lost on the way. Those round
  trips (fp32 to fp16 and straight back) are folded away, so the blocked nodes see and give fp32 values, as the keep
  set was verified in torch.
* **The provider may upcast.** An execution provider with no fp16 kernel for an operator runs it in fp32 (the CPU
  provider does so for matrix products and more), so a graph that overflows on a GPU's fp16 kernels can run finite
  there. The operators the provider ran in fp32 are counted from the graph it actually executed.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import io
import logging
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..tensors import FP16_MAX
from ..userfile.batches import iter_tensors, map_tensors, to_device
from .serving import FP16_TINY, Conversion, LossFn, ModeResult, OnnxServing, compare_outputs

ONNX_EXTRAS = ("onnx", "onnxruntime", "onnxscript")
"""What the ONNX path imports: the format, the runtime (and its fp16 converter), and torch's exporter's backend."""
NAME_SCOPES = "pkg.torch.onnx.name_scopes"
"""The metadata key under which torch's exporter records each node's module path (``['', 'head', 'head.linear']``)."""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""Terminal colour codes, which torch's exporter puts in its messages."""
PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
"""A GPU's fp16 kernels where onnxruntime has them, else the CPU's."""

Call = tuple[tuple[Any, ...], dict[str, Any]]


def missing_extras() -> list[str]:
    """The ONNX path's packages that are not installed."""
    return [name for name in ONNX_EXTRAS if importlib.util.find_spec(name) is None]


# --- the model's calls -----------------------------------------------------------------------------------
def model_calls(model: torch.nn.Module, batches: list[Any], loss_fn: LossFn) -> list[Call]:
    """The arguments the training file's loss hands the model on each batch (its first call per batch): what an
    exported model takes."""
    calls: list[Call] = []
    seen_batch: list[bool] = []

    def record(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not seen_batch[-1]:
            calls.append((_detached(args), _detached(kwargs)))
            seen_batch[-1] = True

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                seen_batch.append(False)
                with contextlib.suppress(Exception):  # the loss after the forward is not what is served
                    loss_fn(model, to_device(batch, torch.device("cpu")))
    finally:
        handle.remove()
    return calls


TRAINING_ONLY_ARGUMENTS = ("labels",)
"""What a Hugging Face model takes only to compute its training loss (``PreTrainedModel.forward``'s convention): a
served graph neither takes it nor returns the loss."""


def served_call(model: torch.nn.Module, call: Call) -> Call:
    """The call as a served model gets it: a Hugging Face model's training-only arguments left out."""
    args, kwargs = call
    if not any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__):
        return call
    return args, {k: v for k, v in kwargs.items() if k not in TRAINING_ONLY_ARGUMENTS}


def _detached(value: Any) -> Any:
    return map_tensors(value, lambda t: t.detach().clone())


def _shapes(call: Call) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in iter_tensors(call)]


# --- export, block list, conversion ----------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter prints its progress to stdout and logs missing torchvision ops; the converter logs each
    initializer. None of it is the doctor's output (``--json`` keeps stdout for the JSON)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxruntime", "onnxscript", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_fp32(model: torch.nn.Module, call: Call) -> Any:
    """The FP32 model as torch's exporter writes it (an ``onnx.ModelProto``)."""
    args, kwargs = call
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, verbose=False)
    if program is None:  # only without dynamo=True, which writes to a file instead
        raise RuntimeError("torch.onnx.export returned no program")
    return program.model_proto


def block_list(proto: Any, kept: list[str], casting: set[str]) -> list[str]:
    """The nodes to leave in fp32, as the keep-set was verified in torch (``kept_in_fp32``): those the modules
    ``kept`` (and their children) made, read from the exporter's module paths, and those an fp32 value reaches by
    type promotion. A value stays fp32 until it enters a module that casts its inputs (``casting``: the modules
    holding parameters of their own, not kept), whose pre-hook casts it to fp16: so a kept projection's output
    stays fp32 in its parent block's own residual sum ``x + proj(h)``, and is fp16 again in the next linear layer.
    The model's inputs arrive fp32, as an export keeping its inputs' types hands them over."""
    blocked: list[str] = []
    made_in: dict[str, str | None] = {value.name: None for value in proto.graph.input}  # fp32 values, by maker
    for node in proto.graph.node:  # the exporter writes each node after those it reads from
        module = _module_of(node)
        made_by_kept = _within(module, kept)
        promoted = any(
            name in made_in and not _cast_on_the_way(made_in[name], module, casting) for name in _reads(node)
        )
        if made_by_kept or promoted:
            blocked.append(node.name)
            made_in.update(dict.fromkeys(node.output, module))
    return blocked


def _within(module: str, paths: list[str]) -> bool:
    return any(module == path or module.startswith(path + ".") for path in paths)


def _cast_on_the_way(maker: str | None, reader: str, casting: set[str]) -> bool:
    """A value made in module ``maker`` (None: a model input) is cast to fp16 before module ``reader``'s operation
    takes it: it enters a casting module on the way down from where the two modules meet."""
    entered = _enclosing(reader)
    if maker is not None:  # the modules both are inside were entered before the value was made
        entered = [m for m in entered if not (m == "" or maker == m or maker.startswith(m + "."))]
    return any(m in casting for m in entered)


def _enclosing(module: str) -> list[str]:
    """The root (``""``) and every module on the path down to ``module``, itself included."""
    parts = module.split(".") if module else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def casting_modules(model: torch.nn.Module, kept: list[str]) -> set[str]:
    """The modules that cast their inputs to fp16 when the model is served with ``kept`` in fp32: those holding
    parameters of their own, outside the keep-set."""
    return {
        name
        for name, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
        and not any(name == k or name.startswith(k + ".") for k in kept)
    }


def _module_of(node: Any) -> str:
    """The path of the module whose forward made the node: the exporter's scopes are the module paths, then the
    operation's own name."""
    scopes: list[str] = next((ast.literal_eval(p.value) for p in node.metadata_props if p.key == NAME_SCOPES), [])
    return scopes[-2] if len(scopes) >= 2 else ""


def convert_fp16(proto: Any, blocked: list[str]) -> tuple[Any, int]:
    """The model converted to fp16 by onnxruntime's converter, ``blocked`` left in fp32 and the inputs and outputs
    kept fp32, with the round trips at the block list's edges folded; and how many were folded. fp16's real range
    (65504 down to its smallest subnormal) is the converter's clamp, not its narrower default."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    with _quiet():
        half = convert_float_to_float16(
            copy.deepcopy(proto),
            keep_io_types=True,
            node_block_list=blocked,
            min_positive_val=FP16_TINY,
            max_finite_val=FP16_MAX,
        )
    folded = fold_round_trips(half)
    sort_topologically(half.graph)
    return half, folded


def sort_topologically(graph: Any) -> None:
    """Order the nodes so each comes after those it reads from (inside its subgraphs too), as ONNX requires: the
    converter appends its casts at the end, and type inference (and other tools) read a graph in order."""
    producer = {output: index for index, node in enumerate(graph.node) for output in node.output if output}
    placed: set[int] = set()
    entered: set[int] = set()
    order: list[int] = []

    def place(index: int) -> None:
        stack = [index]
        while stack:
            current = stack[-1]
            entered.add(current)
            waiting = [
                producer[name]
                for name in _reads(graph.node[current])
                if name in producer and producer[name] not in placed and producer[name] not in entered
            ]
            if waiting:
                stack.append(waiting[0])
                continue
            stack.pop()
            if current not in placed:
                placed.add(current)
                order.append(current)

    for index in range(len(graph.node)):
        place(index)
    nodes = [copy.deepcopy(graph.node[index]) for index in order]
    del graph.node[:]
    graph.node.extend(nodes)


def _reads(node: Any) -> list[str]:
    """The values a node reads: its inputs, and those the graphs in its attributes (an ``If``'s branches, a
    ``Loop``'s body) read from outside."""
    names = list(node.input)
    for attribute in node.attribute:
        for subgraph in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
            for inner in subgraph.node:
                names += _reads(inner)
    return names


def _rename_reads(node: Any, originals: dict[str, str]) -> None:
    """Point a node's inputs, and those of the graphs in its attributes, at the values folded casts stood for."""
    for index, name in enumerate(node.input):
        node.input[index] = originals.get(name, name)
    for attribute in node.attribute:
        for subgraph in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
            for inner in subgraph.node:
                _rename_reads(inner, originals)


def fold_round_trips(proto: Any) -> int:
    """Rewire every cast to fp32 whose input is the converter's cast to fp16 of an fp32 value to read that value
    itself (through chains of such pairs); a graph output such a cast makes becomes an ``Identity``. Casts the
    exporter wrote (the model's own ``x.half().float()``, meant to round) are left. Returns how many were folded."""
    from onnx import TensorProto

    graph = proto.graph
    producer = {output: node for node in graph.node for output in node.output}
    fp32 = _fp32_values(graph)
    originals: dict[str, str] = {}
    for node in graph.node:
        up = producer.get(node.input[0]) if node.op_type == "Cast" and node.input else None
        if _cast_to(node) != TensorProto.FLOAT or up is None or _cast_to(up) != TensorProto.FLOAT16:
            continue
        if _exported(node) or _exported(up):
            continue
        source = up.input[0]
        if source in fp32 or source in originals or _cast_to(producer.get(source)) == TensorProto.FLOAT:
            originals[node.output[0]] = originals.get(source, source)
    outputs = {value.name for value in graph.output}
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in originals and node.output[0] in outputs:
            node.op_type, node.input[0] = "Identity", originals[node.output[0]]
            del node.attribute[:]
        else:
            _rename_reads(node, originals)
    _drop_unused(graph)
    return len(originals)


def _exported(node: Any) -> bool:
    """The exporter wrote this node (it records the module path on its own nodes; the converter's casts have none)."""
    return any(p.key == NAME_SCOPES for p in node.metadata_props)


def _cast_to(node: Any) -> int | None:
    if node is None or node.op_type != "Cast":
        return None
    return next((attribute.i for attribute in node.attribute if attribute.name == "to"), None)


def _fp32_values(graph: Any) -> set[str]:
    from onnx import TensorProto

    values = {v.name for v in [*graph.input, *graph.value_info] if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    return values | {i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT}


def _drop_unused(graph: Any) -> None:
    """Remove the converter's casts whose outputs nothing reads any more (those folded away), until none is left:
    read by a node of the graph, inside one of its subgraphs, or as a graph output."""
    while True:
        read = {name for node in graph.node for name in _reads(node)} | {value.name for value in graph.output}
        unused = [
            node
            for node in graph.node
            if node.op_type == "Cast" and not _exported(node) and not any(output in read for output in node.output)
        ]
        if not unused:
            return
        for node in unused:
            graph.node.remove(node)


def clamped_initializers(fp32: Any, half: Any) -> pd.DataFrame:
    """The initializers past 65504 that the conversion stored in fp16 (clamped to +-65504), each with its value of
    largest magnitude and where it is used (the module, and the operator, of its first reader): the exporter's names
    for constants (``val_100``) say nothing."""
    from onnx import TensorProto, numpy_helper

    converted = {i.name for i in half.graph.initializer if i.data_type == TensorProto.FLOAT16}
    readers: dict[str, Any] = {}
    for node in fp32.graph.node:
        for name in node.input:
            readers.setdefault(name, node)
    rows = []
    for initializer in fp32.graph.initializer:
        if initializer.name in converted and initializer.data_type == TensorProto.FLOAT:
            values = numpy_helper.to_array(initializer).reshape(-1)
            values = values[np.isfinite(values)]  # the converter keeps an inf as inf (a mask's -inf)
            if values.size and float(abs(values).max()) > FP16_MAX:
                reader = readers.get(initializer.name)
                used_by = f"{_module_of(reader) or '(model)'} ({reader.op_type})" if reader is not None else ""
                rows.append(
                    {"initializer": initializer.name, "value": float(values[abs(values).argmax()]), "used_by": used_by}
                )
    return pd.DataFrame(rows, columns=["initializer", "value", "used_by"])


# --- running on onnxruntime ------------------------------------------------------------------------------
def provider() -> str:
    import onnxruntime

    available = onnxruntime.get_available_providers()
    return next((p for p in PREFERRED_PROVIDERS if p in available), available[0])


def run_onnx(proto: Any, calls: list[Call], references: list[Any], provider_name: str) -> pd.DataFrame:
    """The converted model on each call, its outputs put back in the shape of FP32's, compared with them."""
    import onnxruntime

    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=[provider_name])
    return _compared(session.run, [value.name for value in session.get_inputs()], calls, references)


def _compared(run: Callable[..., Any], names: list[str], calls: list[Call], references: list[Any]) -> pd.DataFrame:
    """``run`` (an onnxruntime session's, or the reference evaluator's) on each call, fed by input name, its flat
    outputs put back in the shape of FP32's and compared with them."""
    outputs = []
    for call, reference in zip(calls, references):
        feeds = [t.numpy() for _, t in iter_tensors(call)]
        if len(feeds) != len(names):
            raise ValueError(f"the export takes {len(names)} inputs where the model's call hands it {len(feeds)}")
        produced = [torch.from_numpy(array) for array in run(None, dict(zip(names, feeds)))]
        outputs.append(_shaped_like(reference, produced))
    return compare_outputs(outputs, references)


def _shaped_like(reference: Any, produced: list[torch.Tensor]) -> Any:
    """onnxruntime's flat outputs put back in the structure of what the model returns (its tensors in order)."""
    leaves = iter(produced)
    return map_tensors(reference, lambda _: next(leaves))


ACCUMULATING = (
    "MatMul",
    "Gemm",
    "Conv",
    "ConvTranspose",
    "Einsum",
    "ReduceMean",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceLogSumExp",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "GroupNormalization",
    "InstanceNormalization",
    "BatchNormalization",
)
"""Operators whose fp16 kernels accumulate in fp32 (tensor-core products, reductions, normalisation statistics, as
ONNX's ``LayerNormalization`` specifies with ``stash_type=1``) and round only their output: evaluated so, where
NumPy would accumulate in fp16 and overflow where no engine does."""


def run_as_written(proto: Any, calls: list[Call], references: list[Any]) -> pd.DataFrame:
    """The converted model on each call with every operator in the graph's own dtypes (``onnx``'s reference
    evaluator: NumPy's fp16 arithmetic where the graph says fp16, the :data:`ACCUMULATING` operators accumulating in
    fp32 as fp16 kernels do), compared with FP32's outputs."""
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(proto, new_ops=accumulating_ops())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NumPy's overflow warnings: the overflow is what is measured
        return _compared(evaluator.run, [value.name for value in proto.graph.input], calls, references)


def accumulating_ops() -> list[type]:
    """The :data:`ACCUMULATING` operators this ``onnx`` implements as classes, each widened (an operator defined as
    a function, as ``GroupNormalization`` is, is expanded into operators that are)."""
    widened = []
    for op_type in ACCUMULATING:
        with contextlib.suppress(Exception):
            widened.append(_accumulating_in_fp32(op_type))
    return widened


def _accumulating_in_fp32(op_type: str) -> type:
    """The reference evaluator's ``op_type`` computing on fp16 inputs in fp32 and rounding its outputs to fp16."""
    from onnx.reference.ops import load_op

    base = load_op("", op_type)

    def run(self: Any, *inputs: Any, **attributes: Any) -> Any:
        half = any(getattr(value, "dtype", None) == np.float16 for value in inputs)
        wide = [value.astype(np.float32) if getattr(value, "dtype", None) == np.float16 else value for value in inputs]
        produced = base._run(self, *wide, **attributes)
        return tuple(
            value.astype(np.float16) if half and getattr(value, "dtype", None) == np.float32 else value
            for value in produced
        )

    return type(op_type, (base,), {"_run": run, "op_domain": ""})


def provider_fp32_ops(proto: Any, provider_name: str) -> tuple[pd.DataFrame, int]:
    """The conversion's fp16 operators that the provider runs in fp32, by operator, and how many fp16 operators the
    conversion has. Read from the graph onnxruntime executes: where the provider has no fp16 kernel, onnxruntime
    casts the operator's inputs up (and drops a cast to fp16 that its cast up would undo), so the operator's inputs
    there are fp32."""
    import onnx
    import onnxruntime

    with tempfile.TemporaryDirectory(prefix="fp16doctor-onnx-") as folder:
        options = onnxruntime.SessionOptions()
        # no fusions: the executed graph keeps the converted graph's operators and names, and their precision is
        # chosen the same at every optimisation level
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.optimized_model_filepath = str(Path(folder) / "executed.onnx")
        onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=[provider_name])
        executed = onnx.load(options.optimized_model_filepath)
    intended = _runs_in(proto)
    half = {name for name, dtype in intended.items() if dtype == onnx.TensorProto.FLOAT16}
    ran = _runs_in(executed)
    counts = Counter(
        node.op_type
        for node in executed.graph.node
        if node.name in half and ran.get(node.name) == onnx.TensorProto.FLOAT
    )
    rows = [{"op": op, "count": count} for op, count in counts.most_common()]
    return pd.DataFrame(rows, columns=["op", "count"]), len(half)


def _runs_in(proto: Any) -> dict[str, int]:
    """Each named operator's (not a cast's) precision: the type of its first floating input, as ONNX's type
    inference derives it from the graph's inputs, initializers and casts."""
    import onnx

    floating = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    bare = copy.deepcopy(proto)
    del bare.graph.value_info[:]  # the converter's annotations can contradict what the folded casts now make
    graph = onnx.shape_inference.infer_shapes(bare).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update({i.name: i.data_type for i in graph.initializer})
    precision = {}
    for node in graph.node:
        if node.name and node.op_type != "Cast":
            dtype = next((types[i] for i in node.input if types.get(i) in floating), None)
            if dtype is not None:
                precision[node.name] = dtype
    return precision


# --- the check -------------------------------------------------------------------------------------------
def onnx_serving(
    build: Callable[[], torch.nn.Module],
    batches: list[Any],
    loss_fn: LossFn,
    kept: list[str],
    write_to: Path | None = None,
) -> OnnxServing:
    """Export, convert (whole, and with ``kept`` blocked), run on onnxruntime and as written, and compare with FP32's
    outputs on ``batches``; write the served conversion to ``write_to`` where given."""
    from ..files import atomic_write_bytes

    model = build()
    calls = [served_call(model, call) for call in model_calls(model, batches, loss_fn)]
    name = provider()
    if not calls:
        return OnnxServing(name, None, None, [], 0, 0, error="the model was not called on any batch")
    fits = [i for i, call in enumerate(calls) if _shapes(call) == _shapes(calls[0])]
    fitting = [calls[i] for i in fits]
    with torch.no_grad():
        references = [_detached(model(*args, **kwargs)) for args, kwargs in fitting]
    try:
        fp32 = export_fp32(model, calls[0])
        whole, _ = convert_fp16(fp32, [])
        blocked = block_list(fp32, kept, casting_modules(model, kept))
        with_keep, folded = convert_fp16(fp32, blocked) if kept else (None, 0)
    except Exception as exc:  # noqa: BLE001 - the exporter's or the converter's refusal is what was measured
        return OnnxServing(name, None, None, [], 0, len(fits), error=_said(exc))
    served = with_keep if with_keep is not None else whole
    if write_to is not None:
        atomic_write_bytes(write_to, served.SerializeToString())
    return OnnxServing(
        provider=name,
        converted=_conversion(fp32, whole, "onnx-fp16", fitting, references, name),
        kept=_conversion(fp32, with_keep, "onnx-fp16-kept", fitting, references, name) if with_keep else None,
        blocked_nodes=blocked,
        round_trips_folded=folded,
        batches=len(fits),
        written=str(write_to) if write_to is not None else None,
    )


def _conversion(fp32: Any, half: Any, mode: str, calls: list[Call], references: list[Any], name: str) -> Conversion:
    clamped = clamped_initializers(fp32, half)
    as_written = _measured(mode, lambda: run_as_written(half, calls, references))
    result = _measured(mode, lambda: run_onnx(half, calls, references, name))
    try:
        upcast, half_ops = provider_fp32_ops(half, name)
    except Exception:  # noqa: BLE001 - the count is a note on the run, not the run: left empty where it fails
        upcast, half_ops = pd.DataFrame(columns=["op", "count"]), 0
    return Conversion(result, as_written, upcast, half_ops, clamped)


def _measured(mode: str, run: Callable[[], pd.DataFrame]) -> ModeResult:
    try:
        return ModeResult(mode, run())
    except Exception as exc:  # noqa: BLE001 - onnxruntime refusing the graph, or an operator the evaluator lacks
        return ModeResult(mode, compare_outputs([], []), error=_said(exc))


def _said(exc: BaseException) -> str:
    """The exception's type and first line, without terminal colours: onnxruntime's messages run to pages, and
    torch's exporter wraps the exception that says why (a data-dependent branch) in one that says where it stopped."""
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) and "export" in type(exc).__name__.lower() else exc
    text = ANSI.sub("", str(cause)).strip()
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {line[:300]}"
