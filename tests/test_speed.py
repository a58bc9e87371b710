"""``speed``: the training step timed in FP32 and AMP, one AMP step's operators counted, and what would make AMP
faster, each named with its layer or line: a vocabulary that is not a multiple of 8, a host synchronisation in the
loss, a swarm of element-wise operators, an unfused optimizer; and the same model with all four fixed, where none
is named."""

from __future__ import annotations

import json

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
