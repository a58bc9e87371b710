"""Operator-level precision attribution: every half-precision torch call of AMP's step recomputed in fp32, its
rounding error weighted by the loss's gradient, summed by the line of the user's code that made it; and the
operator-level override (``overrides.fp32_lines``) that computes a line's calls in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp16doctor.config import build_config
from fp16doctor.diagnosis.rules.precision_gap import fp32_line_code
from fp16doctor.engine.microbatch import UNSPLIT
from fp16doctor.engine.probe import Workbench
from fp16doctor.errors import ConfigError
from fp16doctor.measure.attribution import attribute_operators
from fp16doctor.measure.records import OUTSIDE_MODEL, ROOT, SiteShare
from fp16doctor.precision.call_sites import SourceLine, SourceLines
from fp16doctor.userfile.spec import load_training_file

READOUT = """
import torch
from torch import nn

CONFIG = {"dtype": "bfloat16", "scaler": {"enabled": False}, "steps": 2}


class Scale(nn.Module):
    def forward(self, h):
        return h * 0.3                                    # SMALL


class Readout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.scale = Scale()

    def forward(self, x):
        h = self.lin(x)                                   # LINEAR
        big = h[:, 0] * 50.0 - 9000.0                     # BIG
        small = self.scale(h[:, 1])
        return big, small


def model():
    torch.manual_seed(0)
    return Readout()


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)) for _ in range(2)]


def loss(model, batch):
    x, y = batch
    big, small = model(x)
    return ((big - (y[:, 0] * 50 - 9000)) ** 2).mean() + ((small - y[:, 1]) ** 2).mean()   # LOSS
"""


def line_of(path, marker: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


def attributed(path, **config):
    spec = load_training_file(path)
    bench = Workbench(spec, build_config(spec.config, {"device": "cpu", **config}))

    def make(mode):
        return bench.probe(mode, instruments=None, batch_plan=UNSPLIT)

    return spec, bench, attribute_operators(make, path.parent)


def by_site(found) -> dict[str, SiteShare]:
    return {s.site: s for s in found.sites}


def test_each_lines_weighted_error_is_the_loss_change_its_rounding_makes(training_file):
    """On a quadratic loss the weighted error is exact: the big line's is what its two bf16 operators' rounding
    errors change the loss by (computed here by hand), and the lines' shares add up to the whole gap."""
    path = training_file(READOUT)
    spec, bench, found = attributed(path)
    x, y = bench.batches[0]
    model = spec.model()
    model.load_state_dict(bench.initial_state)
    w, b = (p.detach().bfloat16().float() for p in (model.lin.weight, model.lin.bias))
    h16 = F.linear(x.bfloat16().float(), w, b).bfloat16()  # the emulated tensor-core product, rounded
    mul = h16[:, 0] * 50.0  # bf16 arithmetic, as AMP's step runs it
    big16 = mul - 9000.0
    errors = (mul.float() - h16[:, 0].float() * 50.0) + (big16.float() - (mul.float() - 9000.0))
    with torch.no_grad():
        h32 = model.lin(x)
    target = y[:, 0] * 50 - 9000
    fp32_grad = 2 * (h32[:, 0] * 50.0 - 9000.0 - target) / len(x)
    amp_grad = 2 * (big16.float() - target) / len(x)
    expected = float((errors * (fp32_grad + amp_grad) / 2).sum())
    sites = by_site(found)
    big = sites[f"train_me.py:{line_of(path, '# BIG')}"]
    assert big.operators == ["mul", "sub"] and big.module == ROOT
    assert big.weighted_error == pytest.approx(expected, rel=2e-2)
    assert big.first_order == pytest.approx(float((errors * fp32_grad).sum()), rel=2e-2)
    assert found.explained == pytest.approx(1.0, abs=2e-2)  # the whole gap, line by line
    assert found.loss_amp - found.loss_fp32 == pytest.approx(sum(s.weighted_error for s in found.sites), rel=2e-2)
    assert found.unmatched == 0 and found.operators >= 3


def test_lines_are_ranked_by_share_and_named_by_file_line_and_whose_code_they_are(training_file):
    """The de-standardisation near -9000 (bf16 keeps multiples of 32 there) makes nearly all of the gap; the
    linear's line in the root's forward is the root's code though its operator runs inside 'lin'; a line of a
    submodule's forward is that submodule's."""
    path = training_file(READOUT)
    _, _, found = attributed(path)
    assert found.sites[0].site == f"train_me.py:{line_of(path, '# BIG')}" and found.sites[0].share > 0.9
    assert [s.share for s in found.sites] == sorted((s.share for s in found.sites), reverse=True)
    sites = by_site(found)
    linear = sites[f"train_me.py:{line_of(path, '# LINEAR')}"]
    assert linear.module == ROOT and linear.operators == ["linear"] and linear.lower_precision
    assert linear.inside == ["lin"] and linear.own_share == 0.0  # its operator runs inside the module it calls
    big = found.sites[0]
    assert big.inside == [] and big.own_share == big.share
    small = sites[f"train_me.py:{line_of(path, '# SMALL')}"]
    assert small.module == "scale" and small.code == "return h * 0.3                                    # SMALL"
    assert all(s.module != OUTSIDE_MODEL for s in found.sites)  # the loss computes in fp32: no error of its own


AMP_ONLY_OP = """
import torch
from torch import nn

CONFIG = {"dtype": "bfloat16", "scaler": {"enabled": False}, "steps": 2}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.dtype == torch.bfloat16:
            h = h * 3.0 / 3.0                             # AMP ONLY
        return h * 40.0 + 3000.0                          # OFFSET


def model():
    torch.manual_seed(0)
    return Net()


def data():
    g = torch.Generator().manual_seed(1)
    teacher = model()  # the same weights: FP32 fits the targets exactly
    xs = [torch.randn(16, 8, generator=g) for _ in range(2)]
    with torch.no_grad():
        return [(x, teacher(x)) for x in xs]


def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
"""


def test_an_operator_the_fp32_pass_lacks_is_counted_unmatched_and_the_rest_still_match(training_file):
    """A branch on the dtype runs two more operators under AMP: they are skipped over, counted, weighted by AMP's
    gradient alone, and the operators after them are matched to their FP32 twins. FP32 fits the targets exactly,
    so its gradient is 0 and the first-order term sees nothing: the gap is the rounding errors' square."""
    path = training_file(AMP_ONLY_OP)
    _, _, found = attributed(path)
    sites = by_site(found)
    assert found.unmatched == 2
    assert sites[f"train_me.py:{line_of(path, '# AMP ONLY')}"].first_order is None  # no FP32 twin
    offset = sites[f"train_me.py:{line_of(path, '# OFFSET')}"]
    assert offset.first_order == 0.0 and offset.share > 0.9 and found.sites[0] is offset
    assert found.explained == pytest.approx(1.0, abs=2e-2)


def probe_losses(path, lines: list[str]) -> dict[str, float]:
    spec = load_training_file(path)
    config = build_config(spec.config, {"device": "cpu", "overrides": {"fp32_lines": lines}})
    bench = Workbench(spec, config)
    out = {}
    for mode in ("fp32", "amp"):
        probe = bench.probe(mode, instruments=None)
        out[mode] = float(probe.step().loss)
        probe.close()
    return out


def test_the_operators_at_a_line_in_fp32_close_the_gap_they_make(training_file):
    path = training_file(READOUT)
    plain = probe_losses(path, [])
    fixed = probe_losses(path, [f"train_me.py:{line_of(path, '# BIG')}"])
    elsewhere = probe_losses(path, [f"train_me.py:{line_of(path, '# SMALL')}"])
    assert abs(plain["amp"] - plain["fp32"]) > 0.05 * plain["fp32"]
    assert fixed["fp32"] == plain["fp32"]  # the baseline is never changed
    assert abs(fixed["amp"] - fixed["fp32"]) < 0.002 * fixed["fp32"]
    assert abs(elsewhere["amp"] - elsewhere["fp32"]) > 0.05 * elsewhere["fp32"]


def test_a_line_is_matched_by_the_end_of_its_path():
    line = SourceLine.parse("model.py:42")
    assert line.matches("/home/me/project/model.py", 42)
    assert not line.matches("/home/me/project/model.py", 41) and not line.matches("/home/me/mymodel.py", 42)
    nested = SourceLine.parse("models/net.py:7")
    assert nested.matches("/srv/models/net.py", 7) and not nested.matches("/srv/other/net.py", 7)
    assert not SourceLines([])


@pytest.mark.parametrize("entry", ["model.py", "model.py:0", ":12", "model.py:x"])
def test_an_fp32_line_that_is_not_file_colon_line_is_a_config_error(entry):
    with pytest.raises(ConfigError, match="fp32_lines"):
        build_config({"overrides": {"fp32_lines": [entry]}})


@pytest.mark.parametrize(
    ("code", "lower", "rewritten"),
    [
        ("y = h * std + mean", False, "y = h.float() * std + mean"),
        ("return x.sum(-1)", False, "return x.float().sum(-1)"),
        ("total = torch.sum(a * w, -1)  # readout", False, "total = torch.sum(a.float() * w, -1)  # readout"),
        ("return self.head(h) * 3.0", True, "    return self.head(h.float()) * 3.0"),
    ],
)
def test_the_code_to_write_casts_the_lines_first_tensor_operand_up(code, lower, rewritten):
    site = SiteShare("model.py:9", ROOT, ["mul"], 0.9, 0.9, [], 1.0, 0.2, code, lower)
    written = fp32_line_code(site)
    assert written.splitlines()[-1] == rewritten
    assert ("autocast('cuda', enabled=False)" in written) == lower
    assert written.startswith("# model.py:9, in the model's own forward code")


def test_a_line_that_does_not_parse_alone_is_shown_with_what_to_do():
    written = fp32_line_code(SiteShare("model.py:9", "block", ["add"], 0.9, 0.9, [], 1.0, None, "x = (a +", False))
    assert "cast this line's tensor inputs with .float()" in written and written.endswith("x = (a +")


def test_where_no_line_set_closes_the_gap_the_warning_names_the_lines_that_make_most_of_it():
    from fp16doctor.diagnosis import rule_cases as fx
    from fp16doctor.diagnosis.rules.precision_gap import PrecisionGap

    def warned(*sites: SiteShare) -> str:
        (found,) = PrecisionGap().check(fx.evidence(gap=fx.gap(0.45, operators=fx.attribution(*sites), lines_tried=[])))
        assert found.needs_search and found.evidence.fp32_lines is None and not found.fix.config_patch
        return found.fix.summary

    assert "model.py:9 (60%)" in warned(fx.site("model.py:9", 0.6), fx.site("model.py:3", 0.01))
    assert "model.py" not in warned(fx.site("model.py:9", 0.01))  # rounding that accounts for nothing is not named


IN_PLACE = """
import torch
from torch import nn

CONFIG = {"dtype": "bfloat16", "scaler": {"enabled": False}, "steps": 2}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        h = self.lin(x)
        h[:, 0] = h[:, 0] * 40.0 + 3000.0                 # SET
        h += 0.001                                        # IADD
        return h


def model():
    torch.manual_seed(0)
    return Net()


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(2)]


def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
"""


def test_an_in_place_call_at_an_fp32_line_still_changes_its_tensor(training_file):
    """``x[i] = v`` and ``h += c`` at a line kept in fp32 are computed in fp32 and written back into the tensor, in
    its dtype, as the line would have written them: the loss is the same as without the override."""
    path = training_file(IN_PLACE)
    plain = probe_losses(path, [])
    lines = [f"train_me.py:{line_of(path, marker)}" for marker in ("# SET", "# IADD")]
    fixed = probe_losses(path, lines)
    assert fixed["amp"] == pytest.approx(plain["amp"], rel=1e-2) and fixed["amp"] > 1e5  # the writes happened
