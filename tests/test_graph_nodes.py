"""A custom backend's graph run node by node: the first node that makes an inf or NaN out of finite values is named,
with the user's line and module; a value that was already non-finite is not blamed on the nodes it passes through;
a backend whose program is no FX graph is said to be opaque."""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from fp16doctor.measure.graph_nodes import GraphTrace


def graph_pass(gm, example_inputs):
    """A backend as graph passes are written: the graph handed back, run as its forward."""
    return gm.forward


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return (h.half() * 1e9).float().sum()  # past fp16's 65504: inf here, from finite values


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Scaled()

    def forward(self, x):
        return self.inner(x + 1)


def traced(module, backend=graph_pass, compare=False):
    torch._dynamo.reset()
    trace = GraphTrace(compare_with_eager=compare)
    return torch.compile(module, backend=trace.backend(backend)), trace


def test_the_first_node_making_an_inf_from_finite_values_is_named_with_its_module_and_line():
    program, trace = traced(Model())
    assert not torch.isfinite(program(torch.ones(2, 4)))
    first = trace.first
    line = inspect.getsourcelines(Scaled.forward)[1] + 2
    assert first is not None and (first.node, first.operator, first.module) == ("mul", "mul", "inner")
    assert first.source == f"test_graph_nodes.py:{line}" and not trace.opaque
    assert "node mul of the backend's graph (mul in inner, traced from test_graph_nodes.py" in first.sentence()


def test_a_batch_already_non_finite_is_not_blamed_on_the_nodes_it_passes_through():
    program, trace = traced(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    assert not torch.isfinite(program(torch.full((2, 4), float("nan")))).all()
    assert trace.first is None


def test_a_backend_whose_program_is_not_a_graph_is_opaque():
    def kernel_backend(gm, example_inputs):
        return lambda *args: gm(*args)

    program, trace = traced(Model(), kernel_backend)
    assert not torch.isfinite(program(torch.ones(2, 4)))
    assert trace.first is None and trace.opaque == ["function"]


class MaskedScores(nn.Module):
    def forward(self, x):
        scores = x @ x.transpose(-1, -2)
        causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
        return scores.masked_fill(causal, float("-inf")).softmax(-1).sum()  # the inf a mask means to write


def test_aot_autograds_forward_graph_is_traced_at_the_aten_level_and_an_inf_the_code_writes_is_not_blamed():
    trace = GraphTrace()
    torch._dynamo.reset()
    assert not torch.isfinite(torch.compile(Model(), backend=trace.aot_backend)(torch.ones(2, 4)))
    first = trace.first
    assert first is not None and first.graph == "AOT autograd's forward graph" and first.module == "inner"
    assert first.operator == "aten.mul.Tensor" and first.source.startswith("test_graph_nodes.py:")

    trace = GraphTrace()
    torch._dynamo.reset()
    x = torch.randn(4, 4, requires_grad=True)
    loss = torch.compile(MaskedScores(), backend=trace.aot_backend)(x)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and trace.first is None


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x).half()
        h.mul_(1e9)  # the inf is written into h, which the next line reads
        return h.float().sum()


class AbsorbedMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.proj(x).half()
        scores = scores + torch.finfo(torch.float16).min * (x > 0).half()  # -inf where masked: softmax makes it 0
        weights = scores.float().softmax(-1)
        return (weights.half() * 1e9).float().sum()  # the overflow that reaches the output


def test_an_overflow_written_in_place_is_named_at_the_node_that_wrote_it():
    program, trace = traced(InPlace())
    assert not torch.isfinite(program(torch.ones(2, 4)))
    assert trace.first is not None and (trace.first.node, trace.first.operator) == ("mul_", "mul_")


def test_an_inf_that_does_not_reach_the_output_is_not_the_cause():
    program, trace = traced(AbsorbedMask())
    assert not torch.isfinite(program(torch.tensor([[1.0, -1.0, 1.0, -1.0]])))
    line = inspect.getsourcelines(AbsorbedMask.forward)[1] + 4
    assert trace.first is not None and trace.first.source == f"test_graph_nodes.py:{line}", trace.first


def test_an_emulated_products_overflow_is_named_by_its_product_stored_in_fp16():
    """Under CUDA's policy on the CPU, a product's fp16 output is an operator of the doctor's own (it stores the
    product as a GPU does): the trace names the product, not that cast."""
    from fp16doctor.precision.autocast_policy import cuda_policy_on_cpu

    trace = GraphTrace()
    torch._dynamo.reset()
    layer = nn.Linear(4, 4)
    nn.init.constant_(layer.weight, 100.0)
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        out = torch.compile(layer, backend=trace.aot_backend)(torch.full((2, 4), 1000.0))  # 4e5: past 65504
    assert not torch.isfinite(out).all()
    first = trace.first
    assert first is not None and first.operator.startswith("aten.") and "stored_as" not in first.operator
    assert first.operator.endswith(", its output stored in torch.float16"), first


def test_a_tensor_without_isfinite_counts_as_finite_rather_than_failing_the_trace():
    from fp16doctor.measure.graph_nodes import _all_finite

    assert _all_finite([torch.zeros(2, dtype=torch.float8_e4m3fn), torch.ones(2)])
    assert not _all_finite({"x": torch.tensor([1.0, float("nan")])})


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(self.norm(x) * 2)).sum()


def half_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """A one-pass norm in fp16: finite here, but not what eager computes."""
    h = input.half()
    mean = h.mean(-1, keepdim=True)
    var = ((h * h).mean(-1, keepdim=True) - mean * mean).clamp_min(0)
    return (((h - mean) * torch.rsqrt(var + eps)).float() * weight + bias).to(input.dtype)


def swapping_pass(gm, example_inputs):
    """Rewrites the graph it was given in place (as passes do): layer_norm's node calls another function."""
    for node in gm.graph.nodes:
        if node.target is torch.nn.functional.layer_norm:
            node.target = half_layer_norm
    gm.recompile()
    return gm.forward


def decomposing_pass(gm, example_inputs):
    """Replaces layer_norm's node by new nodes of its own (other names): the first of them is named, as added."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is torch.nn.functional.layer_norm:
            with graph.inserting_before(node):
                half = graph.call_method("half", (node.args[0],))
                mean = graph.call_method("mean", (half, -1), {"keepdim": True})
                centred = graph.call_function(torch.sub, (half, mean))
                squares = graph.call_method("mean", (graph.call_function(torch.mul, (centred, centred)), -1))
                normed = graph.call_function(torch.div, (centred, graph.call_method("unsqueeze", (squares, -1))))
                out = graph.call_method("float", (normed,))
            node.replace_all_uses_with(out)
            graph.erase_node(node)
    gm.recompile()
    return gm.forward


# dynamo's own checks of the grads are not made here: the forward is what is compared
SHIFTED = 7.5 + 0.3 * torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_a_pass_that_swaps_an_operator_is_named_where_its_value_first_differs_from_eager():
    model = Normed()
    expected = model(SHIFTED)
    program, trace = traced(model, swapping_pass, compare=True)
    got = program(SHIFTED)
    assert torch.isfinite(got) and got != expected and trace.first is None
    differs = trace.first_difference
    assert differs is not None and (differs.node, differs.module, differs.added) == ("layer_norm", "norm", False)
    assert differs.operator.endswith("half_layer_norm") and differs.relative_difference > 1e-2
    assert "off eager's (relative)" in differs.sentence()


def test_a_node_the_backend_added_is_named_when_what_it_feeds_differs():
    program, trace = traced(Normed(), decomposing_pass, compare=True)
    assert torch.isfinite(program(SHIFTED))
    differs = trace.first_difference
    assert differs is not None and differs.added and differs.node == "half"
    assert "added by the backend" in differs.sentence()


def test_a_backend_that_computes_what_eager_computes_names_no_difference_and_keeps_the_generators():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    torch.manual_seed(1)
    expected = model(SHIFTED)
    program, trace = traced(model, compare=True)
    torch.manual_seed(1)
    assert torch.equal(program(SHIFTED), expected)  # the eager run first drew no dropout mask the program did not
    assert trace.first_difference is None and trace.first is None


class SummedInHalf(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 64)

    def forward(self, x):
        return self.proj(x).sum()


def half_sum_pass(gm, example_inputs):
    """Replaces the final sum by a sum in half precision (new nodes), feeding the output directly."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_method" and node.target == "sum":
            with graph.inserting_before(node):
                half = graph.call_method("half", (node.args[0],))
                total = graph.call_method("float", (graph.call_method("sum", (half,)),))
            node.replace_all_uses_with(total)
            graph.erase_node(node)
    gm.recompile()
    return gm.forward


def test_a_difference_only_the_nodes_feeding_the_output_make_is_found_at_the_output():
    program, trace = traced(SummedInHalf(), half_sum_pass, compare=True)
    assert torch.isfinite(program(100 * SHIFTED))
    differs = trace.first_difference
    assert differs is not None and differs.added and differs.node == "half"


def contiguous_then_swap(gm, example_inputs):
    """Inserts a harmless node before layer_norm and swaps layer_norm's operator: the swapped node is named."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is torch.nn.functional.layer_norm:
            with graph.inserting_before(node):
                same = graph.call_method("contiguous", (node.args[0],))
            node.replace_input_with(node.args[0], same)
    return swapping_pass(gm, example_inputs)


def test_the_node_the_pass_changed_is_named_rather_than_a_harmless_node_it_added():
    program, trace = traced(Normed(), contiguous_then_swap, compare=True)
    program(SHIFTED)
    differs = trace.first_difference
    assert differs is not None and (differs.node, differs.added) == ("layer_norm", False)


def regraphing_backend(gm, example_inputs):
    """Returns a new GraphModule of the same computation (its own node names): nothing to match by name."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)).forward


def regraphing_swapping_backend(gm, example_inputs):
    """A new GraphModule in which layer_norm calls another function: its outputs differ from eager's."""
    return swapping_pass(torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)), example_inputs)


def test_a_new_graph_module_is_compared_by_its_outputs_only_and_the_nonfinite_trace_compares_nothing():
    program, trace = traced(Normed(), regraphing_backend, compare=True)
    program(SHIFTED)
    assert trace.first_difference is None  # the same computation: its outputs agree
    torch.manual_seed(0)
    program, trace = traced(Normed(), regraphing_swapping_backend, compare=True)
    program(SHIFTED)
    differs = trace.first_difference
    assert differs is not None and differs.outputs_only and differs.node == "output" and not differs.added
    assert differs.relative_difference > 1e-3 and "compared by its outputs only" in differs.sentence()
    program, trace = traced(Normed(), swapping_pass)  # a non-finite trace: no eager copy is made
    program(SHIFTED)
    assert trace.first_difference is None and trace.first is None


def test_values_are_compared_whatever_they_are_stored_in_and_a_different_inf_differs():
    from fp16doctor.measure.graph_nodes import _relative_difference

    inf = float("inf")
    assert _relative_difference(torch.tensor([inf, 1.0]), torch.tensor([-inf, 1.0])) == inf
    assert _relative_difference(torch.tensor([float("nan")]), torch.tensor([-inf])) == inf  # no finite entry
    assert _relative_difference(torch.tensor([inf, float("nan")]), torch.tensor([inf, float("nan")])) == 0.0
    half = torch.tensor([1.0, 2.0]).half()
    assert _relative_difference(half, torch.tensor([1.0, 2.0])) == 0.0  # fp16 storage of the same values
    assert 0 < _relative_difference(torch.tensor([1.0, 2.001]).half(), torch.tensor([1.0, 2.001])) < 1e-3
