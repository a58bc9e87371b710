"""Completing a partial repair with the measured loss scale, and the prose that names where a fault is.

Each case is built by hand (the rules' fixtures), so a changed condition shows here, not only in a slow CLI run.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SAMPLES, diagnosed

from fp16doctor.diagnosis import rule_cases as fx
from fp16doctor.diagnosis.findings import Verification
from fp16doctor.diagnosis.rules.divisor_underflow import divisor_in_fp32_code
from fp16doctor.diagnosis.verify import Intervention, with_recommended_scale
from fp16doctor.measure.localise import _range, _spread
from fp16doctor.measure.thresholds import CONSTANT_SPREAD


def tried(after: list[str], skipped: list[int]) -> Verification:
    """A fix tried on a 20-step probe that skipped ``skipped`` and left ``after``."""
    return Verification(
        tried="the fix",
        symptoms_before=["nonfinite", "skips"],
        symptoms_after=after,
        removed_share=0.5,
        repaired=not after,
        amp_records=fx.records(steps=20, skipped=skipped),
    )


def evidence(low: float = 0.01, high: float = 2000.0, **config):
    return fx.evidence(window=fx.window(low, high), config=config or None)


FIX = Intervention("keeping 'head' in fp32", {"overrides": {"fp32_modules": ["head"]}})


def test_a_fix_that_leaves_only_a_settling_scale_is_completed_with_the_windows_scale():
    completion = with_recommended_scale(FIX, tried(["skips"], list(range(6))), evidence(), fx.evidence().config)
    assert completion is not None
    intervention, also = completion
    scale = intervention.config_patch["scaler"]["init_scale"]
    assert 0.01 <= scale <= 2000.0 and scale < 65536
    assert intervention.config_patch["overrides"] == {"fp32_modules": ["head"]}  # the fix itself is kept
    assert FIX.config_patch == {"overrides": {"fp32_modules": ["head"]}}  # and not edited in place
    assert also == f"an initial loss scale of {scale:g}" and also in intervention.description


@pytest.mark.parametrize(
    "case",
    [
        "fault left",  # the fix did not remove the non-finite loss: no scale completes it
        "repaired",  # nothing to complete
        "no skips",  # a drift without a skipped step is not a settling scale's
        "scale already low",  # the window's scale is not below the configured one
        "scaler off",  # no GradScaler to set
        "fix sets a scale",  # the fix's own scale stands
        "data fix",  # a fix that changes the batches: the window was measured on the original ones
        "skips alone",  # the fix removed no fault of its own: skips before, skips after
    ],
)
def test_a_fix_is_not_completed_where_the_scale_is_not_what_is_left(case):
    v = {
        "fault left": tried(["nonfinite", "skips"], [0, 1]),
        "repaired": tried([], []),
        "no skips": tried(["trajectory-drift"], []),
    }.get(case, tried(["skips"], list(range(6))))
    if case == "skips alone":
        v.symptoms_before = ["skips"]
    ev = evidence(low=1e5, high=1e6) if case == "scale already low" else evidence()
    config = fx.evidence(config={"scaler": {"enabled": False}}).config if case == "scaler off" else ev.config
    fix = Intervention("a scale", {"scaler": {"init_scale": 4.0}}) if case == "fix sets a scale" else FIX
    if case == "data fix":
        fix = Intervention("dropping the bad rows", {}, batches=lambda batches: batches[1:])
    assert with_recommended_scale(fix, v, ev, config) is None


def test_module_names_read_as_names_not_counts():
    assert fx.localisation("forward", "6").place == "module '6' (forward)"
    assert fx.localisation("optimizer", None).place == "the optimizer"
    assert fx.localisation("loss", "<loss: outside the model>").place == "the loss computation, outside the model"
    assert "in module '6' (forward) at step 0" in fx.localisation("forward", "6").describe()


def test_the_line_that_called_the_culprit_is_named_where_a_line_of_code_did():
    import dataclasses

    loss = dataclasses.replace(fx.localisation("loss", "<loss: outside the model>"), line="/runs/train.py:31")
    assert loss.place == "the loss computation, outside the model at train.py:31"
    forward = dataclasses.replace(fx.localisation("forward", "attn"), line="/runs/train.py:21")
    assert forward.place == "module 'attn' (forward, at train.py:21)"
    assert fx.localisation("backward", "attn").place == "module 'attn' (backward)"  # autograd's: its node says


def test_a_loss_operator_that_breaks_is_traced_to_its_line_of_the_training_file():
    source = (SAMPLES / "log_of_zero.py").read_text().splitlines()
    line = next(n for n, text in enumerate(source, 1) if "torch.log(rate)" in text)
    loc = diagnosed("log_of_zero.py")[1].evidence.localisation
    assert loc.operator == "aten::log" and loc.line.endswith(f"log_of_zero.py:{line}"), loc


@pytest.mark.parametrize(
    "operator, output, expected",
    [
        ("aten::rsqrt", "+inf (float16)", "torch.rsqrt(v.float() + eps)"),
        ("aten::log", "-inf (float16)", "torch.log(p.float() + eps)"),
        ("aten::div", "nan (float16)", "x.float() / (d.float() + eps)"),  # 0/0: a zero row and an epsilon fp16 lost
        ("aten::div", "nan/+inf (float16)", "x32 = x.float()"),  # x/0 = inf: the divisor flushed before the division
    ],
)
def test_the_divisor_snippet_rewrites_the_operator_that_was_localised(operator, output, expected):
    code = divisor_in_fp32_code(fx.localisation("forward", "mixer", operator, [(0.0, 1.0)], output))
    assert expected in code and "'mixer'" in code and "self.weight" not in code
    compile(code, "<fix>", "exec")  # the snippet is Python


@pytest.mark.parametrize(
    "values, constant",
    [
        (torch.randn(1000) * 130 - 1e9, True),  # -1e9 plus scores: fp32 rounds them away
        (torch.randn(1000) + torch.finfo(torch.float32).min, True),  # an additive finfo(float32).min mask
        (torch.tensor([0.0, -1e9, -2e9]), True),  # two masks' fills added
        (torch.exp(torch.linspace(-20, 20, 1000)), False),  # an exp that grew past 65504
    ],
)
def test_a_constant_beyond_fp16_is_told_from_an_activation_by_its_distinct_values(values, constant):
    spread = _spread(values, _range(values))
    assert 0 < spread and (spread <= CONSTANT_SPREAD) is constant


def test_tensors_inside_fp16s_range_or_not_floating_have_no_spread():
    assert _spread(torch.randn(10), _range(torch.randn(10))) == 0
    assert _spread(torch.tensor([10**6, 2 * 10**6]), (1e6, 2e6)) == 0  # integer ids are not values fp16 rounds
    assert _spread(torch.zeros(0), (0.0, 0.0)) == 0


def _traced_culprit(step) -> dict:
    """The culprit the tracer finds in ``step``, run as a module's forward."""
    from fp16doctor.measure.localise import NonFiniteTracer, _Context

    tracer = NonFiniteTracer(_Context(stack=["attn"]))
    with torch.no_grad(), tracer:
        step()
    assert tracer.found is not None
    return tracer.found


def test_an_exp_on_a_cosine_attentions_diagonal_is_an_activation_though_it_is_one_value():
    """Head dim 64: only the diagonal's exp(1/tau) passes 65504, one distinct value; an exp made it."""
    g = torch.Generator().manual_seed(0)

    def step():
        q = torch.nn.functional.normalize(torch.randn(2, 4, 32, 64, generator=g), dim=-1)
        weights = torch.exp(q @ q.transpose(-1, -2) / 0.05) * torch.ones(32, 32, dtype=torch.bool).tril()
        weights.half()  # autocast's cast before the next matmul

    found = _traced_culprit(step)
    assert found["operator"] == "aten::mul" and found["input_spreads"][0] <= CONSTANT_SPREAD
    assert found["input_constants"] == [False]
    loc = fx.localisation(
        "forward",
        "attn",
        found["operator"],
        found["input_ranges"],
        found["output"],
        input_spreads=found["input_spreads"],
        input_constants=found["input_constants"],
    )
    from fp16doctor.diagnosis.rules.constant_out_of_range import _constant_met

    assert _constant_met(loc) is None


def test_a_mask_made_in_the_step_from_a_python_number_carries_its_constant():
    mask = torch.ones(2, 8)
    mask[:, 5:] = 0

    def step():
        scores = torch.randn(2, 8)
        bias = (1.0 - mask) * torch.finfo(torch.float32).min
        (scores + bias).half()

    found = _traced_culprit(step)
    assert found["operator"] == "aten::add" and found["input_constants"] == [False, True]
    loc = fx.localisation(
        "forward",
        "attn",
        found["operator"],
        found["input_ranges"],
        found["output"],
        input_spreads=found["input_spreads"],
        input_constants=found["input_constants"],
    )
    from fp16doctor.diagnosis.rules.constant_out_of_range import _constant_met

    assert _constant_met(loc) == pytest.approx(3.4028e38, rel=1e-3)


def test_an_in_place_optimizer_update_that_writes_inf_is_the_culprit():
    """A half-precision Adam whose eps of 1e-8 is 0 in fp16: the foreach update divides by a zero denominator
    and returns nothing (it writes the parameters in place); the tracer reads the parameters before and after."""
    from fp16doctor.measure.localise import NonFiniteTracer, _Context

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).half()
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3, eps=1e-8, foreach=True)
    (layer(torch.randn(4, 8).half()).float().pow(2).mean() * 1e-4).backward()
    tracer = NonFiniteTracer(_Context(in_optimizer=True))
    with tracer:
        opt.step()
    found = tracer.found
    assert found is not None and found["phase"] == "optimizer" and "addcdiv" in found["operator"]
    assert found["input_ranges"][0][0] > -1.0  # the parameters as they were, finite, not as the update left them
    assert any(r == (0.0, 0.0) for r in found["input_ranges"])  # the denominator that eps did not keep from 0


def test_an_in_place_op_that_overflows_its_own_tensor_is_seen_by_its_values_before():
    def step():
        x = torch.full((4,), 300.0, dtype=torch.float16)
        x.mul_(1000.0)

    found = _traced_culprit(step)
    assert found["operator"] == "aten::mul_" and found["input_ranges"][0] == (300.0, 300.0)


@pytest.mark.parametrize("case", ["nan buffer overwritten", "scaled in place, then cast", "parameter copied"])
def test_in_place_writes_are_judged_by_what_they_read(case):
    """copy_ overwrites without reading (garbage in its destination is no input); mul_ read its values before
    the op; a parameter copied into an fp16 buffer is the parameter fp16 cannot hold."""
    from fp16doctor.measure.localise import NonFiniteTracer, _Context

    weight = torch.nn.Parameter(torch.full((4,), 2e5))

    def step():
        if case == "nan buffer overwritten":
            torch.full((4,), float("nan"), dtype=torch.float16).copy_(torch.full((4,), 1e5))
        elif case == "scaled in place, then cast":
            y = torch.full((4,), 0.5)
            y.mul_(1e6)
            y.half()
        else:
            torch.zeros(4, dtype=torch.float16).copy_(weight)

    tracer = NonFiniteTracer(_Context(stack=["m"]), {id(weight): (weight, "w")})
    with torch.no_grad(), tracer:
        step()
    found = tracer.found
    assert found is not None
    if case == "nan buffer overwritten":
        assert found["operator"] == "aten::full"  # the fill that made 1e5, cast by the copy
    elif case == "scaled in place, then cast":
        assert found["operator"] == "aten::mul_" and found["input_ranges"][0] == (0.5, 0.5) and found["peak"] == 5e5
    else:
        assert found["parameter"] == "w" and found["peak"] == 2e5


def test_a_scale_overflow_whose_window_ends_far_below_the_default_points_at_a_summed_loss():
    from fp16doctor.diagnosis.rules.scale_overflow import ScaleOverflow

    rule = ScaleOverflow()
    summed = rule.check(rule.fires_on[1]())[0]  # the window ends at 14.6
    assert "reduction='sum'" in summed.fix.summary and "14.6" in summed.fix.summary
    assert "reduction" not in rule.check(rule.fires_on[0]())[0].fix.summary  # the default window: no such hint
