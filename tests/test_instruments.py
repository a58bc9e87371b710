"""Numerics instruments on small purpose-built trainings: each statistic is right."""

import math

import pytest
import torch

from fp16doctor.config import build_config
from fp16doctor.engine.instruments import (
    InstrumentOptions,
    Instruments,
    SampleCounter,
    histogram_of,
    precision_map,
    strided_sample,
)
from fp16doctor.engine.probe import Workbench
from fp16doctor.measure.localise import OUTSIDE_MODEL, localise
from fp16doctor.measure.numerics import (
    GradientCapture,
    capture_gradients,
    largest_magnitude,
    observed_underflow,
    predicted_underflow,
    scale_window,
)
from fp16doctor.tensors import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from fp16doctor.userfile.spec import load_training_file

EXACT = InstrumentOptions(sample=0)


def bench_for(training_file, source, **config):
    spec = load_training_file(training_file(source))
    return Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 2, **config}))


def instrumented_run(bench, mode="amp", steps=1, options=EXACT):
    probe = bench.probe(mode)
    instruments = probe.instrument(options)
    frame = probe.run(steps)
    return probe, instruments, frame


OVERFLOW = """
import torch
from torch import nn

class Amplify(nn.Module):                      # a projection with huge weights: 64 * 40 * 40 = 102400
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 8, bias=False)
    def forward(self, x):
        return self.proj(x)

def model():
    net = nn.Sequential(nn.Identity(), Amplify(), nn.ReLU())
    with torch.no_grad():
        net[1].proj.weight.fill_(40.0)
    return net

def data():
    return [(torch.full((4, 64), 40.0), torch.zeros(4, dtype=torch.long))]
"""


def test_overflowing_layer_is_measured_and_localised(training_file):
    bench = bench_for(training_file, OVERFLOW)
    _, instruments, _ = instrumented_run(bench)
    forward = instruments.frames()["forward"].set_index("module")
    assert (forward.loc["1.proj", "posinf"], forward.loc["1.proj", "neginf"], forward.loc["1.proj", "nan"]) == (1, 0, 0)
    assert math.isnan(forward.loc["1.proj", "abs_max"])  # not held: the largest finite magnitude is not measured
    assert forward.loc["1.proj", "over_fp16_max"] == 1.0 and forward.loc["1.proj", "inputs_finite"]
    assert forward.loc["0", "posinf"] == 0 and forward.loc["0", "abs_max"] == 40.0
    first = instruments.first_nonfinite_forward()
    assert first["module"] == "1.proj"  # the innermost culprit, not its parent "1"
    loc = localise(bench, "amp", 0)
    assert (loc.module, loc.phase) == ("1.proj", "forward")
    assert loc.operator in ("aten::mm", "aten::matmul", "aten::linear")
    assert loc.input_ranges[0] == (40.0, 40.0) and "+inf" in loc.output and "float16" in loc.note
    # the same training in fp32 stays finite
    _, fp32_instruments, _ = instrumented_run(bench, "fp32")
    assert fp32_instruments.first_nonfinite_forward() is None
    assert fp32_instruments.frames()["forward"].set_index("module").loc["1.proj", "abs_max"] == 102400.0


UNDERFLOW = """
import torch
from torch import nn

def model():                                   # 12 sigmoid layers: sigmoid' <= 1/4 shrinks gradients layer by layer
    layers = []
    for _ in range(12):
        layer = nn.Linear(32, 32, bias=False)
        nn.init.normal_(layer.weight, std=32 ** -0.5)
        layers += [layer, nn.Sigmoid()]
    return nn.Sequential(*layers)

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 32, (16,), generator=g))]

CONFIG = {"scaler": {"enabled": False}}
"""


def test_underflowing_deep_stack_predicted_and_observed(training_file):
    bench = bench_for(training_file, UNDERFLOW)
    capture = capture_gradients(bench.probe("fp32"))
    predicted = predicted_underflow(capture, scale=1.0).set_index(["kind", "name"])
    first, last = (
        predicted.loc[("param", "0.weight"), "predicted_underflow"],
        predicted.loc[("param", "22.weight"), "predicted_underflow"],
    )
    assert first > 0.5 and last == 0.0  # early layers flush to zero without loss scaling
    assert predicted_underflow(capture, scale=2.0**24).loc[:, "predicted_underflow"].max() < 0.01
    observed = observed_underflow(bench).set_index(["kind", "name"])
    assert observed.loc[("param", "0.weight"), "observed_underflow"] > 0.5
    assert observed.loc[("param", "22.weight"), "observed_underflow"] == 0.0
    window = scale_window(capture)
    assert window.feasible and window.low > 1.0  # scaling is needed
    per = window.per_tensor.set_index(["kind", "name"])
    assert per.loc[("param", "0.weight"), "min_scale"] > per.loc[("param", "22.weight"), "min_scale"]
    s = window.recommended()
    assert window.low <= s <= window.high and math.log2(s).is_integer()
    # at the recommended scale, at most 0.1% of any tensor's gradient mass flushes to zero
    assert predicted_underflow(capture, s)["predicted_underflow_mass"].max() <= 1e-3 + 1e-9


def test_activation_gradients_are_recorded_scaled(training_file):
    bench = bench_for(training_file, UNDERFLOW, scaler={"enabled": True, "init_scale": 1024.0})
    _, instruments, _ = instrumented_run(bench)
    grads = instruments.frames()["activation_grads"]
    assert set(grads["loss_scale"]) == {1024.0} and set(grads["dtype"]) == {"float16"}
    deepest = grads.set_index("module").loc["0"]
    assert deepest["zero_share"] > 0.1  # fp16 flushed part of the first layer's grad_output
    assert grads.set_index("module").loc["22", "zero_share"] == 0.0  # the last layer's are intact


HALF_BATCHNORM = """
import torch
from torch import nn

def model():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))
    net[1].half()                                 # "saves memory": the norm layer stored in fp16
    return net

def data():
    return [(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))]

def loss(model, batch):
    x, y = batch
    h = model[0](x)
    h = model[1](h.half())
    return torch.nn.functional.cross_entropy(model[4](model[3](model[2](h)).float()), y)
"""


def test_precision_map_shows_a_half_batchnorm(training_file):
    bench = bench_for(training_file, HALF_BATCHNORM, scaler={"enabled": False})
    probe, instruments, frame = instrumented_run(bench)
    table = precision_map(probe.model, probe.optimizer, instruments.compute_dtypes).set_index("module")
    assert table.loc["1", "param_dtypes"] == "float16" and "float16" in table.loc["1", "buffer_dtypes"]
    assert table.loc["1", "compute_dtype"] == "float16"
    assert table.loc["0", "param_dtypes"] == "float32" and table.loc["0", "compute_dtype"] == "float16"
    assert table.loc["1", "optimizer_state_dtypes"] == "float16"  # AdamW keeps state in the parameter's dtype
    assert table.loc["4", "optimizer_state_dtypes"] == "float32"


HALF_LOSS = """
import torch
from torch import nn

def model():
    return nn.Linear(16, 4)

def data():
    return [(torch.randn(8, 16), torch.randint(0, 4, (8,)))]

def loss(model, batch):
    x, y = batch
    logits = model(x)
    return (logits.half() - nn.functional.one_hot(y, 4).half()).pow(2).mean().half()
"""


def test_loss_dtype_is_recorded(training_file):
    bench = bench_for(training_file, HALF_LOSS)
    probe = bench.probe("amp")
    probe.run(1)
    assert probe.records[0].trace.loss_dtype == "float16"
    fp32 = bench.probe("fp32")
    fp32.run(1)
    assert fp32.records[0].trace.loss_dtype == "float32"  # the baseline neutralises the half casts


LOST_UPDATES = """
import torch
from torch import nn

def model():
    net = nn.Linear(64, 64)
    with torch.no_grad():
        net.weight.fill_(1.0)                   # weights near 1.0: fp16 spacing 2^-10
    return net.half()

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 64, (32,), generator=g))]

def optimizer(params):
    return torch.optim.SGD(params, lr=1e-4)   # lr * grad far below half a spacing at 1.0

def loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x.half()).float(), y)

CONFIG = {"scaler": {"enabled": False}}
"""


def test_lost_updates_in_fp16_parameters(training_file):
    bench = bench_for(training_file, LOST_UPDATES)
    _, instruments, frame = instrumented_run(bench)
    assert frame["optimizer_stepped"].all()
    updates = instruments.frames()["updates"].set_index("param")
    assert updates.loc["weight", "lost_update_share"] > 0.9 and updates.loc["weight", "dtype"] == "float16"
    _, fp32_instruments, _ = instrumented_run(bench, "fp32")
    fp32_updates = fp32_instruments.frames()["updates"].set_index("param")
    assert fp32_updates.loc["weight", "lost_update_share"] < updates.loc["weight", "lost_update_share"] / 5
    assert 0 < fp32_updates.loc["weight", "update_to_weight"] < 1e-3


def test_param_gradient_statistics_match_direct_computation(training_file):
    from conftest import MLP_FILE

    bench = bench_for(training_file, MLP_FILE)
    probe, instruments, _ = instrumented_run(bench, "fp32")
    rows = instruments.frames()["param_grads"].set_index("param")
    for name, param in probe.model.named_parameters():
        assert rows.loc[name, "grad_norm"] == pytest.approx(float(param.grad.norm()), rel=1e-5)
        assert rows.loc[name, "zero_share"] == pytest.approx(float((param.grad == 0).double().mean()))


def test_localisation_of_a_loss_outside_the_model():
    from conftest import SAMPLES

    spec = load_training_file(SAMPLES / "loss_in_half.py")
    bench = Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 2}))
    loc = localise(bench, "amp", 0)
    assert (loc.phase, loc.module, loc.operator) == ("loss", OUTSIDE_MODEL, "aten::exp")
    assert loc.input_ranges[0][1] > math.log(65504)  # exp of more than ln(65504) = 11.09
    assert localise(bench, "fp32", 0) is None


def bucketize_histogram(values: torch.Tensor, sample: int) -> torch.Tensor:
    """The reference the instruments' counts must equal: |x| of a strided sample in the buckets zero, below
    2^-24, below 2^-14, normal, above 65504, by ``bucketize`` (what the instruments computed before their
    counting moved into :class:`SampleCounter`)."""
    a = strided_sample(values, sample).abs()
    edges = torch.tensor([2.0**-149, FP16_MIN_SUBNORMAL, FP16_MIN_NORMAL, FP16_MAX * (1 + 2.0**-23)])  # fp32, as before
    return torch.bincount(torch.bucketize(a, edges, right=True), minlength=5)


def counted_histogram(values: torch.Tensor, sample: int) -> torch.Tensor:
    """The instruments' own histogram of ``values``: its strided sample counted by a :class:`SampleCounter`."""
    counter = SampleCounter(torch.device("cpu"))
    piece = strided_sample(values, sample)
    index = counter.add(piece)
    counts, padded = counter.take()
    return torch.tensor(histogram_of([(piece.numel(), padded[index], counts.tolist()[index])]))


def test_histogram_buckets_and_sampling():
    x = torch.tensor([0.0, 2.0**-30, -(2.0**-20), 1.0, -70000.0, 3.0])
    assert counted_histogram(x, 0).tolist() == [1, 1, 1, 2, 1]
    big = torch.randn(1_000_000)
    exact = counted_histogram(big, 0).double() / big.numel()
    sampled = counted_histogram(big, 65536).double()
    assert 60000 <= sampled.sum() <= 65536
    sampled /= sampled.sum()
    assert torch.allclose(exact, sampled, atol=0.01)


def test_one_host_transfer_per_step(training_file, monkeypatch):
    from conftest import MLP_FILE

    bench = bench_for(training_file, MLP_FILE)
    probe = bench.probe("amp")
    instruments = probe.instrument(InstrumentOptions())  # every table, not only the diagnosis's
    transfers = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: transfers.append(self.shape) or original(self))
    probe.run(2)
    assert len(transfers) == 2  # one stacked transfer per step, healthy steps need no second one
    assert len(instruments.forward_rows) > 0 and len(instruments.param_rows) > 0


def test_sampling_interval(training_file):
    from conftest import MLP_FILE

    bench = bench_for(training_file, MLP_FILE, steps=4)
    _, instruments, _ = instrumented_run(bench, "amp", steps=4, options=InstrumentOptions(every=2))
    assert sorted(set(instruments.frames()["forward"]["step"])) == [0, 2]


def edge_values(dtype, n=3000, seed=0):
    """Values on and around every histogram edge, zeros of both signs, infinities and NaN, shuffled, as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    edges = [2.0**-149, 2.0**-24, 2.0**-14, 65504.0, 65504.0078125]
    special = [0.0, -0.0, math.inf, -math.inf, math.nan] + [
        e * f for e in edges for f in (0.5, 1 - 2**-20, 1.0, 1 + 2**-20, 2.0)
    ]
    body = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-50, 6, n, dtype=torch.float64)
    values = torch.cat([torch.tensor(special, dtype=torch.float64), -torch.tensor(special, dtype=torch.float64), body])
    return values[torch.randperm(values.numel(), generator=g)].to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_sample_counter_counts_as_bucketize_does(dtype):
    """The in-place integer passes over the buffered samples give bucketize's histogram, in every dtype, for
    samples of any length, buffered with others, flushed when the buffer is full or counted on their own."""
    counter = SampleCounter(torch.device("cpu"), capacity=4096)  # small: flushes and oversized samples happen
    tensors = [edge_values(dtype, n, seed) for seed, n in enumerate([1, 200, 3000, 255, 257, 5000, 40])]
    tensors.append(edge_values(dtype, 3000)[::3])  # a strided view
    indices = [counter.add(t) for t in tensors]
    counts, padded = counter.take()
    values = counts.tolist()
    for t, i in zip(tensors, indices):
        assert histogram_of([(t.numel(), padded[i], values[i])]) == bucketize_histogram(t, 0).tolist()
    assert counter.take() == (None, [])  # taken: the next step starts empty
    assert counter.buffer is None or not counter.buffer.any()  # and the buffer is zero again


def test_forward_rows_of_several_inputs_and_outputs_match_direct_computation():
    class Split(torch.nn.Module):
        def forward(self, x, y):
            return x * 2, y[:, :3] - 1e6

    split = Split()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    instruments = Instruments(split, optimizer, EXACT)
    instruments.begin_step(0, 1.0)
    x, y = torch.randn(4, 5), torch.randn(4, 6) * 1e-6
    a, b = split(x, y)
    instruments.end_step()
    row = instruments.frames()["forward"].iloc[0]
    assert row["numel"] == a.numel() + b.numel()
    assert row["abs_max"] == pytest.approx(max(a.abs().max().item(), b.abs().max().item()))
    assert row["input_abs_max"] == pytest.approx(max(x.abs().max().item(), y.abs().max().item()))
    assert row["over_fp16_max"] == pytest.approx(float((b.abs() > 65504).sum()) / (a.numel() + b.numel()))
    assert row["inputs_finite"] and row["nan"] == 0


def test_param_gradient_shares_at_the_scale_match_direct_computation():
    """Zero share, flushed share and mass at the loss scale, and the largest |g|, per parameter, against
    computing them directly on the gradients (exact sampling)."""
    model = torch.nn.Sequential(torch.nn.Linear(300, 7), torch.nn.Linear(7, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, EXACT)
    scale = 2.0**10
    instruments.begin_step(0, scale)
    out = model(torch.randn(5, 300) * torch.logspace(-40, 0, 300))
    out.sum().backward()
    with torch.no_grad():
        model[0].weight.grad[0, :50] = 0.0
    optimizer.step()
    instruments.end_step()
    rows = instruments.frames()["param_grads"].set_index("param")
    for name, param in model.named_parameters():
        g = param.grad.abs().float()
        flushed = (g * scale > 0) & (g * scale < 2.0**-24)
        nonzero = int((g > 0).sum())
        assert rows.loc[name, "zero_share"] == pytest.approx(1 - nonzero / g.numel())
        assert rows.loc[name, "underflow_at_scale"] == pytest.approx(int(flushed.sum()) / max(nonzero, 1))
        assert rows.loc[name, "underflow_mass_at_scale"] == pytest.approx(
            float(g.double()[flushed].sum() / g.double().sum())
        )
        assert rows.loc[name, "grad_abs_max"] == float(g.max())
    assert rows.loc["0.weight", "underflow_at_scale"] > 0  # the test reaches the flushed bucket


def test_an_optimizer_that_writes_inf_into_the_weights_is_localised_at_its_own_step():
    """The loss first turns NaN at step 1, whose every input (the weights) is already inf: the update
    of step 0 wrote it, so the replay traces step 0 and blames the optimizer's division."""
    from conftest import SAMPLES

    spec = load_training_file(SAMPLES / "half_optimizer_state.py")
    bench = Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 3}))
    loc = localise(bench, "amp", 1)
    assert (loc.step, loc.phase, loc.module, loc.operator) == (0, "optimizer", None, "aten::div")
    assert loc.replayed == [] and "in the optimizer at step 0" in loc.describe()
    assert "float16" in loc.output


def test_a_float64_parameter_beside_fp32_ones_is_measured():
    """``_foreach_norm`` refuses to narrow fp64 to the fp32 the half gradients' norms accumulate in."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1).double())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer)
    instruments.begin_step(0, 1.0)
    model[1](model[0](torch.randn(3, 4)).double()).sum().backward()
    optimizer.step()
    instruments.end_step()
    grads = instruments.frames()["param_grads"].set_index("param")
    assert grads.loc["1.bias", "dtype"] == "float64" and grads.loc["1.bias", "grad_norm"] == pytest.approx(3.0)
    expected = model[0].weight.grad.norm().item()
    assert grads.loc["0.weight", "grad_norm"] == pytest.approx(expected, rel=1e-6)
    assert len(instruments.frames()["updates"]) == 4


def test_activation_gradients_are_not_held_until_the_step_ends():
    """Autograd frees each activation gradient once the next node consumed it; the instruments must not keep
    them all alive until the step's transfer (a second copy of a step's activation gradients)."""
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, EXACT)
    seen: list[weakref.ref] = []

    def watch(module, args, out):  # returns None: the output stays the module's own
        out.register_hook(lambda g: seen.append(weakref.ref(g)))

    model[1].register_forward_hook(watch)
    instruments.begin_step(0, 1.0)
    model(torch.randn(4, 8)).square().mean().backward()
    assert seen and all(ref() is None for ref in seen)  # freed before end_step, though the instruments saw it
    instruments.end_step()
    grads = instruments.frames()["activation_grads"].set_index("module")
    assert grads.loc["1", "abs_max"] > 0 and grads.loc["1", "nan"] == 0


def test_non_finite_activation_gradients_are_flagged_by_kind():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, EXACT)
    instruments.begin_step(0, 1.0)
    out = model(torch.randn(3, 4))
    (out * torch.tensor([[math.inf], [1.0], [1.0]])).sum().backward()  # +inf into the last layer's grad_output
    instruments.end_step()
    row = instruments.frames()["activation_grads"].set_index("module").loc["1"]
    assert (row["posinf"], row["neginf"], row["nan"]) == (1, 0, 0)
    assert math.isnan(row["abs_max"])  # the largest finite value of an unheld gradient is not measured


def test_strided_sample_of_a_non_contiguous_tensor_takes_the_flattened_order():
    """A transposed tensor's sample is every k-th element of its flattened (logical) order, as ``reshape`` gives,
    without copying the whole tensor first."""
    from fp16doctor.engine.instruments import strided_sample

    cases = [
        ((16, 128, 256), 16384),
        ((16, 128, 256), 1000),
        ((16, 128, 6), 1000),
        ((16, 128, 6), 100),
        ((4, 64, 6), 4),
        ((3, 5, 7), 0),
        ((3, 5, 7), 20000),
        ((40, 2, 8), 10),
    ]
    for shape, size in cases:
        t = torch.arange(math.prod(shape), dtype=torch.float32).view(shape).transpose(0, 1)
        assert not t.is_contiguous()
        n = t.numel()
        k = 1 if size == 0 or n <= size else -(-n // size)
        assert torch.equal(strided_sample(t, size), t.reshape(-1)[::k]), (shape, size)


def test_detached_instruments_let_their_step_buffers_go():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer)
    instruments.begin_step(0, 1.0)
    model(torch.randn(32, 64)).sum().backward()
    optimizer.step()
    instruments.end_step()
    assert instruments._counters  # the step's samples were counted in a buffer kept for the next step
    instruments.detach()
    assert not instruments._counters and not instruments._segment_cache


def test_predicted_underflow_counts_only_gradients_that_carry_signal():
    """A gradient that is rounding noise (an RMS 1e-9 of its kind's median: a key bias under softmax's shift
    invariance) flushes whole at any scale; the window ignores it, and so must the underflow the sweep and its
    summary quote (the summary read 'predicted underflow 100%' inside a window that held the scale: user check)."""
    from fp16doctor.measure.numerics import GradientCapture, scale_window

    g = torch.Generator().manual_seed(0)
    capture = GradientCapture(
        {
            "param:w1": torch.randn(1000, generator=g) * 1e-8,
            "param:w2": torch.randn(1000, generator=g) * 1e-7,
            "param:bias_k": torch.randn(1000, generator=g) * 1e-19,
        },
        scale=1.0,
    )
    window = scale_window(capture)
    predicted = predicted_underflow(capture, 65536.0)
    assert predicted.set_index("name").loc["bias_k", "predicted_underflow_mass"] == 1.0  # the noise flushes whole
    assert window.worst_signal_underflow(predicted) < 0.01  # the signal does not
    flushing = predicted_underflow(capture, 1.0)  # no scaling: the signal tensors flush too, and that is counted
    assert window.worst_signal_underflow(flushing) > 0.5


def test_the_window_top_is_the_gradients_exact_largest_magnitude_not_its_samples():
    """A capture keeps a strided sample of each gradient; a spike between the sampled elements is what overflows
    fp16 at a high scale, so the window's top reads the whole tensor's largest magnitude."""
    g = torch.full((10_000,), 1e-3)
    g[4_321] = 500.0
    sample = strided_sample(g, 2_500).clone()  # every 4th element: the spike is not among them
    assert float(sample.max()) < 1.0
    sampled_only = scale_window(GradientCapture({"param:w": sample}, scale=1.0))
    exact = scale_window(GradientCapture({"param:w": sample}, scale=1.0, abs_max={"param:w": largest_magnitude(g)}))
    assert exact.high == pytest.approx(FP16_MAX / 500.0)
    assert sampled_only.high > 1000 * exact.high  # the sample alone would allow scales that overflow the spike


def test_count_nonfinite_counts_forward_outputs_exactly(training_file):
    """The train command's report of a bad step counts NaN and inf exactly; the probes only flag them."""
    bench = bench_for(training_file, OVERFLOW)
    _, instruments, _ = instrumented_run(bench, options=InstrumentOptions(sample=0, count_nonfinite=True))
    row = instruments.frames()["forward"].set_index("module").loc["1.proj"]
    assert (row["posinf"], row["nan"]) == (32, 0)  # 4 x 8 outputs, each 102400 in fp16
    assert row["abs_max"] == 0.0  # every element is inf: no finite magnitude


@pytest.mark.parametrize("count_nonfinite", [False, True])
def test_forward_outputs_are_freed_before_the_step_ends(count_nonfinite):
    """The instruments hold no forward output: one autograd no longer needs is freed during the step, as it
    would be without them (holding them all kept a step's activations alive), also where they count
    non-finite values exactly."""
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, InstrumentOptions(sample=0, count_nonfinite=count_nonfinite))
    seen: list[weakref.ref] = []
    model[2].register_forward_hook(lambda module, args, out: seen.append(weakref.ref(out)))
    instruments.begin_step(0, 1.0)
    model(torch.randn(4, 8)).sum().backward()  # the head's output: consumed by sum, whose backward keeps nothing
    assert seen and seen[0]() is None
    instruments.end_step()
    assert instruments.frames()["forward"].set_index("module").loc["2", "abs_max"] > 0


def test_count_nonfinite_counts_each_kind_and_the_largest_finite_magnitude():
    """A partly overflowing output: its NaN, +inf and -inf counted exactly, its largest finite magnitude kept, over
    the micro-batches of a step as over a whole one (counts add up, the magnitude is the larger)."""

    class Blowup(torch.nn.Module):
        def forward(self, x):
            return x * torch.tensor([1.0, math.inf, -math.inf, math.nan, 1.0])

    model = torch.nn.Sequential(torch.nn.Linear(5, 5), Blowup())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, InstrumentOptions(sample=0, count_nonfinite=True))
    instruments.begin_step(0, 1.0)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(5))
        model[0].bias.zero_()
    model(torch.full((2, 5), 3.0))
    instruments.end_micro_batch()
    model(torch.full((1, 5), -7.0))
    instruments.end_step()
    rows = instruments.frames()["forward"]
    blowup = rows[rows["module"] == "1"]
    assert list(blowup["nan"]) == [2, 1]
    assert list(blowup["posinf"]) == [2, 1] and list(blowup["neginf"]) == [2, 1]  # -7 * -inf, -7 * inf
    assert list(blowup["abs_max"]) == [3.0, 7.0]


def test_a_freed_outputs_id_on_a_new_tensor_is_measured_afresh():
    """Outputs are not held, so a later tensor can take a freed output's id: its range is its own."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, EXACT)
    instruments.begin_step(0, 1.0)
    with torch.no_grad():
        for _ in range(50):  # many short-lived outputs: CPython reuses their ids
            model[1](torch.full((2, 4), 1.0))
        x = torch.full((2, 4), 1000.0)
        model[1](x)
        reused = id(x) in instruments._pending.known  # x took a freed output's id (CPython reuses them)
    instruments.end_step()
    rows = instruments.frames()["forward"]
    last = rows[rows["module"] == "1"].iloc[-1]
    assert last["input_abs_max"] == 1000.0
    if not reused:
        pytest.skip("no id was reused in this run: the lookup is tested on its own below")


def test_an_id_table_entry_of_a_freed_tensor_is_not_found():
    import weakref

    from fp16doctor.engine.instruments import _lookup

    t = torch.ones(2)
    table = {id(t): (weakref.ref(t), 7)}
    assert _lookup(table, t) == 7
    other = torch.ones(2)
    table[id(other)] = (weakref.ref(torch.ones(3)), 9)  # the entry's tensor is dead, its id now other's
    assert _lookup(table, other) is None


def test_module_shares_off_leaves_them_unmeasured_and_the_ranges_exact():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, InstrumentOptions(module_shares=False))
    x = torch.randn(3, 4)
    instruments.begin_step(0, 1.0)
    out = model(x)
    out.sum().backward()
    instruments.end_step()
    forward = instruments.frames()["forward"].set_index("module")
    assert forward.loc["1", "abs_max"] == pytest.approx(out.abs().max().item())
    assert all(math.isnan(forward.loc["1", c]) for c in ("over_fp16_max", "below_fp16_subnormal", "zero_share"))
    grads = instruments.frames()["activation_grads"].set_index("module")
    assert grads.loc["1", "abs_max"] == 1.0 and math.isnan(grads.loc["1", "below_fp16_normal"])


def test_the_diagnosis_option_sets_take_forward_ranges_and_updates_and_the_plots_gradient_tables():
    """Every probe: forward ranges and update health (the rules' reads); the AMP probe of a report also the
    activation-gradient ranges and parameter-gradient statistics its plots read."""
    from fp16doctor.engine.probe import DEFAULT_INSTRUMENTS, PLOT_INSTRUMENTS

    assert DEFAULT_INSTRUMENTS.forward and DEFAULT_INSTRUMENTS.updates
    assert not (
        DEFAULT_INSTRUMENTS.activation_grads or DEFAULT_INSTRUMENTS.param_grads or DEFAULT_INSTRUMENTS.module_shares
    )
    assert PLOT_INSTRUMENTS.activation_grads and PLOT_INSTRUMENTS.param_grads and PLOT_INSTRUMENTS.forward


def test_parameter_statistics_of_a_second_step_are_its_own():
    """The packed buffers are kept from step to step: a second step's numbers come from its own gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    instruments = Instruments(model, optimizer, EXACT)
    for step, factor in enumerate((1.0, 1e-3)):
        optimizer.zero_grad()
        instruments.begin_step(step, 1.0)
        (model(torch.randn(5, 300)).sum() * factor).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        instruments.end_step()
    rows = instruments.frames()["param_grads"]
    last = rows[rows["step"] == 1].set_index("param")
    updates = instruments.frames()["updates"]
    moved = updates[updates["step"] == 1].set_index("param")
    for name, p in model.named_parameters():
        assert last.loc[name, "grad_abs_max"] == pytest.approx(grads[name].abs().max().item())
        delta = (p.detach() - before[name]).norm() / before[name].norm()
        assert moved.loc[name, "update_to_weight"] == pytest.approx(delta.item(), rel=1e-5)


def test_a_module_non_finite_at_every_fp32_step_has_no_measured_peak():
    """A non-finite output's largest finite magnitude is not measured (NaN): the rules' FP32 peak of such a
    module is unknown (None), not a number that would call it fp16-safe."""
    import pandas as pd

    from fp16doctor.diagnosis import rule_cases as fx
    from fp16doctor.diagnosis.rules._helpers import module_abs_max

    forward = pd.DataFrame(
        [
            {"module": "mask", "abs_max": math.nan},
            {"module": "mask", "abs_max": math.nan},
            {"module": "head", "abs_max": math.nan},
            {"module": "head", "abs_max": 12.0},
        ]
    )
    summary = fx.probe("fp32", tables={"forward": forward})
    assert module_abs_max(summary, "mask") is None
    assert module_abs_max(summary, "head") == 12.0
    assert module_abs_max(summary, "absent") is None


def test_the_gradient_norm_of_a_diverging_training_is_finite_where_its_gradients_are_and_unseen_by_tracers():
    """Gradients of 1e22 (an SGD run diverging in FP32) are finite, but the squares of an fp32 norm are not: the
    step read as 'non-finite gradients' four steps before its loss was, and the localisation's tracer named the
    doctor's own norm as the training's first non-finite operator."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fp16doctor.precision.recording import global_grad_norm

    class Seen(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    huge, inf = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    huge.grad = torch.tensor([1e22, -1e22, 3.0])
    inf.grad = torch.tensor([1.0, float("inf")])
    with Seen() as seen:
        norm = global_grad_norm([huge])
    assert math.isclose(norm, math.sqrt(2) * 1e22, rel_tol=1e-6) and seen.ops == []
    assert math.isinf(global_grad_norm([huge, inf]))


def _sharded_norms(rank, world, init_file, out):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from fp16doctor.precision.recording import global_grad_norm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.tensor([1e22, -1e22, 3.0, 4.0])  # every rank builds the same full tensor, each keeps its rows
        huge = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
        huge.grad = distribute_tensor(full, mesh, [Shard(0)])
        finite = global_grad_norm([huge])
        bad = full.clone()
        bad[3] = float("inf")  # on the last rank's shard only: every rank must read it, and none may hang
        huge.grad = distribute_tensor(bad, mesh, [Shard(0)])
        replica = torch.nn.Parameter(distribute_tensor(torch.zeros(2), mesh, [Replicate()]))
        replica.grad = distribute_tensor(torch.tensor([3.0, 4.0]), mesh, [Replicate()])  # whole on each rank: once
        read = {"finite": finite, "bad": global_grad_norm([huge]), "replica": global_grad_norm([replica])}
        torch.save(read, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_a_sharded_gradient_norm_of_a_diverging_training_is_finite_on_every_rank(tmp_path):
    """FSDP2's DTensor gradients: the fp32 norm of 1e22 overflows as a plain tensor's does; the fp64 retake sums each
    rank's shard and adds the ranks' sums, so both ranks read the true norm, and an inf on one rank's shard reads as
    inf on both."""
    import torch.multiprocessing as mp

    mp.start_processes(_sharded_norms, args=(2, tmp_path / "init", tmp_path / "norm"), nprocs=2, start_method="spawn")
    for rank in range(2):
        read = torch.load(tmp_path / f"norm.{rank}")
        assert math.isclose(read["finite"], math.sqrt(2e44 + 25), rel_tol=1e-6), (rank, read)
        assert math.isinf(read["bad"]) and read["replica"] == 5.0, (rank, read)
