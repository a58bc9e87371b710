"""A custom backend's graph run node by node: the first node that makes an inf or NaN out of finite values is named,
with the user's line and module; a value that was already non-finite is not blamed on the nodes it passes through;
a backend whose program is no FX graph is said to be opaque."""

from __future__ import annotations

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


def traced(module, backend=graph_pass):
    torch._dynamo.reset()
    trace = GraphTrace()
    return torch.compile(module, backend=trace.backend(backend)), trace


def test_the_first_node_making_an_inf_from_finite_values_is_named_with_its_module_and_line():
    program, trace = traced(Model())
    assert not torch.isfinite(program(torch.ones(2, 4)))
    first = trace.first
    line = inspect.getsourcelines(Scaled.forward)[1] + 2
    assert first is not None and (first.node, first.operator, first.module) == ("mul", "mul", "inner")
    assert first.source == f"test_graph_nodes.py:{line}" and not trace.opaque
    assert "node mul (mul in inner, traced from test_graph_nodes.py" in first.sentence()


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
