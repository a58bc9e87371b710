"""``serve-check --onnx``: the fp16 ONNX conversion (torch's exporter, onnxruntime's converter with the keep-set as its
block list, onnxruntime) against FP32. Skipped where the optional extras are not installed; the message a user
without them gets is tested either way."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json

import pytest
import torch
from conftest import ROOT, SAMPLES, run_cli
from typer.testing import CliRunner

import fp16doctor
from fp16doctor.cli import app
from fp16doctor.measure.serving import fresh_copies
from fp16doctor.measure.serving_onnx import (
    NAME_SCOPES,
    ONNX_EXTRAS,
    accumulating_ops,
    block_list,
    casting_modules,
    clamped_initializers,
    convert_fp16,
    export_fp32,
    fold_round_trips,
    missing_extras,
    model_calls,
    run_as_written,
    sort_topologically,
)
from fp16doctor.userfile.spec import load_training_file

SERVING = ROOT / "tests" / "serving"
needs_extras = pytest.mark.skipif(
    bool(missing_extras()),
    reason=f"the ONNX path's extras are not installed ({', '.join(missing_extras())}): pip install 'fp16doctor[onnx]'",
)


def scopes_of(node) -> list[str]:
    """The module paths torch's exporter recorded on a node."""
    return next((ast.literal_eval(p.value) for p in node.metadata_props if p.key == NAME_SCOPES), [])


@functools.cache
def checked(name: str):
    return fp16doctor.serve_check(SERVING / name, onnx=True)


@needs_extras
def test_a_buffer_past_65504_is_clamped_by_the_whole_conversion_and_the_keep_set_repairs_it():
    result = checked("price_head.py")
    onnx = result.onnx
    assert onnx is not None and onnx.error is None and onnx.batches == result.batches
    whole = onnx.converted
    # the converter stores the 1e5 price unit as 65504: finite prices, about 35% low, where model.half() gives inf
    assert list(whole.clamped["initializer"]) == ["head.unit"] and whole.result.finite
    assert list(whole.clamped["used_by"]) == ["head (Mul)"]
    assert 0.3 < whole.result.rel_dev < 0.4
    assert not whole.as_written.finite  # 65504 * 2 is inf in fp16 arithmetic: the CPU provider ran Mul in fp32
    assert onnx.kept is not None and onnx.kept.result.within(result.tolerance)
    assert onnx.kept.clamped.empty  # the kept head's initializers stay fp32
    assert onnx.blocked_nodes and onnx.round_trips_folded > 0  # the head's fp32 prices reach the fp32 output
    report = result.to_json()["onnx"]
    assert (
        report["kept"]["result"]["mode"] == "onnx-fp16-kept"
        and report["converted"]["clamped_initializers"][0]["value"] == 1e5
    )
    json.dumps(report, allow_nan=False)


@needs_extras
def test_the_keep_set_as_block_list_serves_the_input_norm_and_the_cpu_provider_upcasts_are_counted():
    result = checked("kelvin_input_norm.py")
    onnx = result.onnx
    assert onnx is not None and onnx.kept is not None
    assert onnx.kept.result.within(result.tolerance)
    assert onnx.round_trips_folded > 0  # unfolded, the kelvin inputs reach the kept norm rounded to fp16 steps of 0.25
    if onnx.provider == "CPUExecutionProvider":
        # onnxruntime's CPU provider has no fp16 kernel for most of these operators and runs them in fp32, which is
        # why the whole conversion is finite here where model.half() is not: the record says so, counted
        assert onnx.converted is not None and onnx.converted.result.finite and not result.modes["fp16"].finite
        assert 0 < onnx.converted.upcast_ops <= onnx.converted.half_ops
        assert "Mul" in set(onnx.converted.upcast["op"])
    # as written, in fp16 arithmetic, the whole conversion overflows where model.half() does, and the keep-set serves
    assert not onnx.converted.as_written.finite and onnx.kept.as_written.within(result.tolerance)


@needs_extras
def test_a_parents_residual_sum_of_a_kept_modules_output_stays_fp32_as_the_keep_set_was_verified():
    result = checked("residual_past_fp16.py")
    assert result.keep is not None and result.keep.verified and result.keep.modules == ["block.proj", "block.norm"]
    onnx = result.onnx
    assert onnx is not None and onnx.kept is not None and onnx.kept.within(result.tolerance)
    assert not onnx.converted.as_written.finite

    spec = load_training_file(SERVING / "residual_past_fp16.py")
    build = fresh_copies(spec.model())
    batches = spec.data()[:1]
    calls = model_calls(build(), batches, spec.loss)
    references = [build()(*calls[0][0]).detach()]
    fp32 = export_fp32(build(), calls[0])
    kept = result.keep.modules
    promoted = block_list(fp32, kept, casting_modules(build(), kept))
    only_kept = [node.name for node in fp32.graph.node if any(k in scopes_of(node) for k in kept)]
    assert set(only_kept) < set(promoted)  # the block's own residual sum, which the kept projection's output reaches
    as_written = {
        len(blocked): run_as_written(convert_fp16(fp32, blocked)[0], calls, references)
        for blocked in (promoted, only_kept)
    }
    assert int(as_written[len(only_kept)]["nonfinite"].sum()) > 0  # the converter casts the 2e5 sum to fp16
    assert int(as_written[len(promoted)]["nonfinite"].sum()) == 0


@needs_extras
def test_a_model_the_converter_cannot_convert_is_reported_not_crashed():
    result = checked("logits_past_fp16.py")  # an EmbeddingBag: exported as a loop the converter breaks
    onnx = result.onnx
    assert onnx is not None and not onnx.within(result.tolerance) and not result.safe
    failed = onnx.error or (onnx.converted.result.error if onnx.converted is not None else None)
    assert failed


@needs_extras
def test_onnx_out_writes_a_valid_model_once_and_a_healthy_model_is_safe(tmp_path):
    import onnx

    target = tmp_path / "served.onnx"
    proc = run_cli("serve-check", SAMPLES / "mlp.py", "--json", "--onnx-out", target)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["verdict"] == "safe" and report["onnx"]["written"] == str(target)
    assert report["onnx"]["kept"] is None and report["onnx"]["converted"]["result"]["finite"]
    model = onnx.load(target)
    onnx.checker.check_model(model)
    assert {i.data_type for i in model.graph.initializer} >= {onnx.TensorProto.FLOAT16}
    before = target.read_bytes()
    again = CliRunner().invoke(app, ["serve-check", str(SAMPLES / "mlp.py"), "--onnx-out", str(target)])
    assert again.exit_code == 2 and "already exists" in again.output and target.read_bytes() == before


@needs_extras
def test_a_hugging_face_model_is_served_without_its_labels(tmp_path):
    import onnx

    target = tmp_path / "bert.onnx"
    result = fp16doctor.serve_check(ROOT / "tests" / "training_files" / "hf_bert.py", onnx_out=target, batches=2)
    assert result.onnx is not None and result.onnx.converted is not None and result.onnx.error is None
    graph = onnx.load(target).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask"] and len(graph.output) == 1  # the logits
    assert result.onnx.converted.result.finite and list(result.onnx.converted.result.outputs["output"]) == [
        "output.logits"
    ]


@needs_extras
def test_a_model_that_cannot_be_exported_is_unsafe_with_the_exporters_reason(training_file):
    path = training_file(
        """
        import torch
        class Gated(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 2)
            def forward(self, x):
                if x.mean().item() > 0:  # a data-dependent branch: no graph holds both sides
                    return self.linear(x)
                return -self.linear(x)
        def model():
            return Gated()
        def data():
            return [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(2)]
        """
    )
    result = fp16doctor.serve_check(path, onnx=True, batches=2)
    assert result.onnx is not None and result.onnx.error is not None and not result.safe
    assert "data-dependent" in result.onnx.error and "\x1b" not in result.onnx.error


def test_onnx_out_that_cannot_be_a_file_is_bad_input_before_anything_runs(tmp_path):
    (tmp_path / "a_file").write_text("")
    for target, said in ((tmp_path, "is a folder"), (tmp_path / "a_file" / "served.onnx", "cannot be written")):
        shown = CliRunner().invoke(app, ["serve-check", str(SAMPLES / "mlp.py"), "--onnx-out", str(target)])
        assert shown.exit_code == 2 and "Served against FP32" not in shown.output, shown.output
        assert said in " ".join(shown.output.split())


def test_without_the_extras_the_onnx_check_is_one_clear_message(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ONNX_EXTRAS else real(name, *a))
    shown = CliRunner().invoke(app, ["serve-check", str(SAMPLES / "mlp.py"), "--onnx"])
    assert shown.exit_code == 2
    said = " ".join(shown.output.split())
    assert "needs onnx, onnxruntime, onnxscript" in said and "pip install 'fp16doctor[onnx]'" in said


@needs_extras
def test_round_trips_to_fp16_and_back_are_folded_and_the_graph_sorted():
    from onnx import TensorProto, helper

    down = helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="down")
    up = helper.make_node("Cast", ["x16"], ["x32"], to=TensorProto.FLOAT, name="up")
    square = helper.make_node("Mul", ["x32", "x32"], ["y"], name="square")
    graph = helper.make_graph(
        [square, up, down],  # out of order, as the converter appends its casts
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph)
    assert fold_round_trips(model) == 1
    sort_topologically(model.graph)
    assert [n.name for n in model.graph.node] == ["square"] and list(model.graph.node[0].input) == ["x", "x"]


@needs_extras
def test_a_chain_of_round_trips_folds_to_its_source_and_a_subgraphs_reads_keep_their_producers():
    from onnx import TensorProto, helper

    def cast(source, target, to, name):
        return helper.make_node("Cast", [source], [target], to=to, name=name)

    chain = [
        cast("x", "a16", TensorProto.FLOAT16, "c1"),
        cast("a16", "a32", TensorProto.FLOAT, "c2"),
        cast("a32", "b16", TensorProto.FLOAT16, "c3"),
        cast("b16", "b32", TensorProto.FLOAT, "c4"),
        helper.make_node("Relu", ["b32"], ["r"], name="relu"),
    ]
    value = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT, shape=[2])
    branch = helper.make_graph([helper.make_node("Identity", ["r"], ["o"])], "branch", [], [value("o")])
    gate = helper.make_node("If", ["flag"], ["y"], then_branch=branch, else_branch=branch, name="if")
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    model = helper.make_model(helper.make_graph([*chain, gate], "g", [value("x"), flag], [value("y")]))
    assert fold_round_trips(model) == 2
    sort_topologically(model.graph)
    names = [n.name for n in model.graph.node]
    assert names == ["relu", "if"] and list(model.graph.node[0].input) == ["x"]  # Relu only read inside the If


@needs_extras
def test_the_models_own_rounding_is_kept_and_an_infinite_constant_is_not_clamped():
    from onnx import StringStringEntryProto, TensorProto, helper

    own = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16, name="node_half"),
        helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT, name="node_float"),
    ]
    for node in own:  # the exporter's own nodes carry their module path
        node.metadata_props.append(StringStringEntryProto(key=NAME_SCOPES, value="['', 'quantise']"))
    value = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT, shape=[2])
    model = helper.make_model(helper.make_graph(own, "g", [value("x")], [value("y")]))
    assert fold_round_trips(model) == 0 and len(model.graph.node) == 2

    mask = helper.make_tensor("mask", TensorProto.FLOAT, [2], [float("-inf"), 0.0])
    unit = helper.make_tensor("unit", TensorProto.FLOAT, [1], [1e5])
    uses = [helper.make_node("Add", ["x", "mask"], ["m"], name="add"), helper.make_node("Mul", ["m", "unit"], ["y"])]
    fp32 = helper.make_model(helper.make_graph(uses, "g", [value("x")], [value("y")], [mask, unit]))
    half, _ = convert_fp16(fp32, [])
    assert list(clamped_initializers(fp32, half)["initializer"]) == ["unit"]


@needs_extras
def test_as_written_normalisation_statistics_are_taken_in_fp32_as_onnx_specifies():
    import numpy as np
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    value = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT16, shape=[1, 8])
    norm = helper.make_node("LayerNormalization", ["x", "scale"], ["y"], axis=-1)  # stash_type 1: fp32 statistics
    scale = helper.make_tensor("scale", TensorProto.FLOAT16, [8], np.ones(8).tolist())
    model = helper.make_model(helper.make_graph([norm], "g", [value("x")], [value("y")], [scale]))
    x = (np.arange(8).reshape(1, 8) * 1000.0).astype(np.float16)  # its squares pass 65504
    y = ReferenceEvaluator(model, new_ops=accumulating_ops()).run(None, {"x": x})[0]
    expected = torch.nn.functional.layer_norm(torch.from_numpy(x).float(), (8,)).numpy()
    assert np.allclose(y.astype(np.float32), expected, atol=1e-2)


@needs_extras
def test_sorting_puts_each_node_after_what_it_reads():
    from onnx import TensorProto, helper

    a = helper.make_node("Relu", ["x"], ["a"], name="a")
    b = helper.make_node("Neg", ["a"], ["b"], name="b")
    c = helper.make_node("Add", ["a", "b"], ["c"], name="c")
    value = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT, shape=[1])
    graph = helper.make_graph([c, b, a], "g", [value("x")], [value("c")])
    sort_topologically(graph)
    assert [n.name for n in graph.node] == ["a", "b", "c"]
