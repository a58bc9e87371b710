"""``speed``: the training step timed in FP32 and AMP, one AMP step's operators counted, and what would make AMP
faster, each named with its layer or line: a vocabulary that is not a multiple of 8, a host synchronisation in the
loss, a swarm of element-wise operators, an unfused optimizer; and the same model with all four fixed, where none
is named."""

from __future__ import annotations

import json

import torch
from conftest import ROOT, SAMPLES, run_cli

import fp16doctor

SLOW = ROOT / "tests" / "speed" / "slow_amp.py"


def _line_of(path, text):
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_each_kind_of_slowness_is_named_with_its_layer_or_line():
    report = fp16doctor.speed(SLOW)
    advice = [a.what for a in report.advice]
    assert advice[0] == "pad the dimension(s) 1001 to 1024 of module 'head'"  # the largest share of the FLOPs
    guard = _line_of(SLOW, "if torch.isnan(value)")
    assert f"move the host synchronisation at slow_amp.py:{guard} out of the step" in advice
    assert "fuse module 'act' (torch.compile it, or a fused kernel)" in advice
    assert "AdamW(..., fused=True)" in advice
    assert report.counts.half_share > 0.9  # the products run in half precision (emulated on this CPU)
    assert list(report.counts.syncs.values()) == [1]  # one a step: the probe's own reads are not the file's
    modules = {g["module"] for g in report.counts.misaligned}
    assert modules == {"head"}, modules


def test_the_same_model_with_every_fix_applied_gets_none_of_that_advice(training_file):
    source = SLOW.read_text()
    fixed = (
        source.replace("VOCAB = 1001", "VOCAB = 1024")
        .replace("        self.act = TanhGelu()", "        self.act = nn.GELU(approximate='tanh')")
        .replace("    if torch.isnan(value):  # a NaN guard: reads the loss back to the host every step\n", "")
        .replace('        raise RuntimeError("loss is NaN")\n', "")
        .replace("torch.optim.AdamW(params, lr=1e-3)", "torch.optim.AdamW(params, lr=1e-3, fused=True)")
    )
    report = fp16doctor.speed(training_file(fixed, "fast_amp.py"))
    assert report.advice == [] and report.counts.misaligned == [] and not report.counts.syncs
    assert report.to_json()["optimizer"]["optimizers"][0]["fused"] is True


def test_speed_from_the_command_line_prints_one_json_object_and_exits_0():
    proc = run_cli("speed", SAMPLES / "mlp.py", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["device"] == "cpu" and report["timing"]["amp"]["step_ms"] > 0
    assert report["timing"]["amp"]["peak_memory_bytes"] is None  # measured only on CUDA
    assert report["half_flop_share"] == 1.0 and report["host_syncs"] == []


def test_speed_html_draws_the_breakdown_the_json_counts_and_never_overwrites_a_file(tmp_path):
    page = tmp_path / "speed.html"
    proc = run_cli("speed", SLOW, "--json", "--html", page)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report, html = json.loads(proc.stdout), page.read_text()
    total = report["half_flop_share"]  # every product runs in half precision here: the bars split it
    misaligned = _data(html, "half-misaligned-share")
    assert abs(_data(html, "half-aligned-share") + misaligned - total) < 1e-3
    flops = sum(g["flops"] for g in report["misaligned_gemms"])
    assert misaligned > 0.5 and abs(misaligned - flops / sum(report["flops"].values())) < 1e-3
    assert int(_data(html, "advice")) == len(report["advice"]) == html.count("<li><b>")
    assert "<svg" in html and "<script" not in html and "http" not in html.split("<svg")[0]
    page.write_text("mine")
    refused = run_cli("speed", SLOW, "--html", page)
    assert refused.returncode == 2 and page.read_text() == "mine" and "--force" in refused.stderr


def _data(html, name):
    import re

    return float(re.search(rf'data-{name}="([^"]+)"', html).group(1))


def test_each_change_the_doctor_can_apply_is_measured_and_the_others_say_why():
    report = fp16doctor.speed(SLOW, measure_advice=True)
    by_kind = {a.change.KIND if a.change else None: a for a in report.advice}
    assert set(by_kind) == {"pad-linear", "compile-module", "fuse-optimizer", None}
    for kind in ("pad-linear", "compile-module", "fuse-optimizer"):
        measured = by_kind[kind].measured
        assert measured is not None, (kind, by_kind[kind].not_measured)
        assert measured.before_ms > 0 and measured.after_ms > 0 and measured.device == "cpu"
        assert measured.spread[0] <= measured.speedup <= measured.spread[1]
    assert "does not rewrite" in by_kind[None].not_measured  # the host synchronisation is a line of the file
    item = next(a for a in report.to_json()["advice"] if a["change"] and a["change"]["kind"] == "pad-linear")
    assert item["change"]["target"] == "head" and item["measured"]["rounds"] >= 4


def test_by_default_a_cpu_run_measures_no_advice():
    report = fp16doctor.speed(SLOW)
    assert all(a.measured is None and a.not_measured is None for a in report.advice)


def test_a_padded_linear_computes_what_the_linear_computed():
    from torch import nn

    from fp16doctor.measure.speed_changes import PaddedLinear, padded_features

    torch.manual_seed(0)
    linear = nn.Linear(61, 1001)
    padded = PaddedLinear(linear, *padded_features(linear))
    assert tuple(padded.weight.shape) == (1024, 64)
    x = torch.randn(3, 5, 61, requires_grad=True)
    assert torch.allclose(padded(x), linear(x), atol=1e-5)
    padded(x).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    linear(x).sum().backward()
    assert torch.allclose(grad, x.grad, atol=1e-5)
    assert padded.weight.grad[1001:].abs().sum() == 0 and padded.weight.grad[:, 61:].abs().sum() == 0


def test_a_fused_optimizer_made_in_place_steps_as_one_built_fused():
    from fp16doctor.measure.speed_changes import FuseOptimizer

    torch.manual_seed(0)
    start = torch.randn(40, 8)
    grads = [torch.randn(40, 8) for _ in range(3)]
    built, flipped = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    fused = torch.optim.AdamW([built], lr=1e-2, fused=True)
    plain = torch.optim.AdamW([flipped], lr=1e-2)
    change = FuseOptimizer("opt")
    assert change.applicable(torch.nn.Linear(1, 1), {"opt": plain}) is None
    change.on_optimizers({"opt": plain})
    for grad in grads:
        built.grad, flipped.grad = grad.clone(), grad.clone()
        fused.step()
        plain.step()
    assert torch.equal(built, flipped) and plain._step_supports_amp_scaling


def test_a_linear_whose_only_misaligned_dimension_is_the_batch_is_not_padded():
    from fp16doctor.measure.speed_changes import PadLinear

    model = torch.nn.Sequential(torch.nn.Linear(64, 128))
    reason = PadLinear("0").applicable(model, {})
    assert "batch's rows" in reason
    assert "pads only nn.Linear" in PadLinear("").applicable(model, {})


def test_an_optimizer_with_no_fused_kernel_is_not_told_to_fuse(training_file):
    source = SLOW.read_text().replace("torch.optim.AdamW(params, lr=1e-3)", "torch.optim.RMSprop(params, lr=1e-3)")
    report = fp16doctor.speed(training_file(source, "rmsprop_amp.py"))
    assert report.to_json()["optimizer"]["optimizers"][0]["fused"] is None
    assert not any("fused=True" in a.what for a in report.advice)


def test_speed_measure_from_the_command_line_prints_each_measurement(training_file):
    source = SLOW.read_text().replace("        self.act = TanhGelu()", "        self.act = nn.GELU(approximate='tanh')")
    proc = run_cli("speed", training_file(source, "no_swarm.py"), "--measure")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("measured: AMP step") == 2  # the padded head, the fused optimizer
    assert "on a CPU: does not predict a GPU" in proc.stdout
    assert "not measured: it changes your code" in proc.stdout


CONV_NET = """
import torch
from torch import nn


def model():
    return nn.Sequential(
        nn.Conv2d(3, 17, 3, padding=1), nn.ReLU(), nn.Conv2d(17, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 16),
    )


def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 16, (8,), generator=g)) for _ in range(4)]


def loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01, fused=True)
"""


def test_a_conv_nets_backward_runs_in_half_precision_and_its_channels_are_what_is_checked(training_file):
    report = fp16doctor.speed(training_file(CONV_NET, "conv_net.py"))
    assert report.counts.half_share == 1.0 and not report.counts.fp32_ops  # the backward's convolutions too
    shapes = {(g["op"], g["module"]): g["shape"] for g in report.counts.misaligned}
    assert shapes[("convolution", "0")] == {"out_channels": 17, "in_channels": 3}
    assert shapes[("convolution_backward", "2")] == {"out_channels": 32, "in_channels": 17}
    assert not any("more of the step in half" in a.what for a in report.advice)


SCALER_RECIPE = """
import torch
import torch.nn.functional as F
from torch import nn


def model():
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 16))


def data():
    g = torch.Generator().manual_seed(7)
    for _ in range(8):
        yield torch.randn(64, 128, generator=g), torch.randint(0, 16, (64,), generator=g)


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        out = model(x)
        keep = y > 3
        value = F.cross_entropy(out[keep], y[keep])  # boolean-mask indexing: the host reads the mask's count
    scaler.scale(value).backward()
    scaler.step(optimizer)
    scaler.update()
    return value
"""


def test_the_scaler_recipe_in_a_train_step_waits_only_where_torch_does(training_file):
    """The doctor's own reads of the scale and the skips are not the training's; GradScaler.step reads its skip
    check on the host for an optimizer that is not fused, and an unfused AdamW's step counts live on the host (no
    wait on a GPU); a boolean mask's count is read on the host."""
    fused = fp16doctor.speed(training_file(SCALER_RECIPE, "recipe_fused.py"))
    masked, backward = _line_of_text(SCALER_RECIPE, "out[keep]"), _line_of_text(SCALER_RECIPE, ".backward()")
    assert dict(fused.counts.syncs) == {
        f"recipe_fused.py:{masked}  {_code(SCALER_RECIPE, masked)}": 2,  # out[keep] and y[keep]
        f"recipe_fused.py:{backward}  {_code(SCALER_RECIPE, backward)}": 1,  # out[keep]'s gradient put back by it
    }
    assert fused.counts.scaler_syncs == 0
    plain = fp16doctor.speed(training_file(SCALER_RECIPE.replace(", fused=True", ""), "recipe_plain.py"))
    assert sum(plain.counts.syncs.values()) == 3 and plain.counts.scaler_syncs == 1
    fuse = next(a for a in plain.advice if a.what == "AdamW(..., fused=True)")
    assert "GradScaler.step waits for the device 1 time(s)" in fuse.why


def _line_of_text(source, text):
    return next(n for n, line in enumerate(source.splitlines(), 1) if text in line)


def _code(source, line):
    return source.splitlines()[line - 1].strip()


def test_a_change_the_training_cannot_take_is_not_measured_and_says_why(training_file):
    """A file whose optimizers() reads the head's shape refuses the padded head: the measurement says so, the rest
    of the report stands."""
    source = SLOW.read_text() + (
        "\n\ndef optimizers(model):\n"
        "    assert model.head.weight.shape[0] == VOCAB, 'the head must hold the vocabulary'\n"
        "    return torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
    )
    source = source.replace("def optimizer(params):", "def unused_optimizer(params):")
    report = fp16doctor.speed(training_file(source, "checks_head.py"), measure_advice=True)
    pad = next(a for a in report.advice if a.change is not None and a.change.KIND == "pad-linear")
    assert pad.measured is None and "could not run" in pad.not_measured and "AssertionError" in pad.not_measured
    fuse = next(a for a in report.advice if a.change is not None and a.change.KIND == "fuse-optimizer")
    assert fuse.measured is not None


def test_a_padded_layer_is_still_a_linear_layer_and_a_tied_weight_is_not_padded():
    from torch import nn

    from fp16doctor.measure.speed_changes import PaddedLinear, PadLinear

    assert isinstance(PaddedLinear(nn.Linear(3, 5), 8, 8), nn.Linear)  # minGPT groups weight decay by it
    model = nn.ModuleDict({"embed": nn.Embedding(1001, 64), "head": nn.Linear(64, 1001, bias=False)})
    model["head"].weight = model["embed"].weight
    assert "shared with another module" in PadLinear("head").applicable(model, {})


def test_each_probe_stepped_in_turn_keeps_its_own_module_level_counters(training_file):
    from fp16doctor.userfile.spec import load_training_file

    source = "CALLS = 0\n\ndef model():\n    return None\n\ndef data():\n    return [0]\n"
    spec = load_training_file(training_file(source, "counter.py"))
    spec.reset_file_state()  # the first probe records the file's values
    first, second = {}, {}
    for _ in range(3):
        with spec.own_file_state(first):
            spec.module.CALLS += 1
    with spec.own_file_state(second):
        spec.module.CALLS += 1
    assert first == {"CALLS": 3} and second == {"CALLS": 1}


OWN_OPTIMIZER_SYNC = """
import torch
from torch import nn


class ClippedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.abs().max().item() < 1e3:  # reads each gradient on the host
                    p.add_(p.grad, alpha=-group["lr"])


def model():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 8, (32,), generator=g)) for _ in range(4)]


def loss(model, batch):
    x, y = batch
    logits = model(x).float()
    logits[y == 0] = 0.0  # a masked fill: no host wait
    return nn.functional.cross_entropy(logits, y)


def optimizer(params):
    return ClippedSGD(params)
"""


def test_an_optimizers_own_waits_are_its_lines_and_the_scalers_check_is_counted_apart(training_file):
    report = fp16doctor.speed(training_file(OWN_OPTIMIZER_SYNC, "own_opt.py"))
    line = _line_of_text(OWN_OPTIMIZER_SYNC, ".item() < 1e3")
    assert dict(report.counts.syncs) == {f"own_opt.py:{line}  {_code(OWN_OPTIMIZER_SYNC, line)}": 4}  # 4 tensors
    assert report.counts.scaler_syncs == 1  # GradScaler.step's skip check, before it calls the step
