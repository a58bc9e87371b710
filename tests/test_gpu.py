"""GPU checks: native CUDA autocast, the corrected run on one GPU, and CPU diagnoses matching GPU ones.

Marked ``cuda``: skipped without a GPU (CI is CPU-only). Run on a GPU machine with
``python3 -m pytest -q -m cuda``.
"""

from __future__ import annotations

import pytest
from conftest import SAMPLES, diagnosed

from fp16doctor.config import build_config
from fp16doctor.diagnosis import DiagnoseOptions, diagnose, fixed_config
from fp16doctor.diagnosis.rules import all_rules
from fp16doctor.engine.probe import Workbench
from fp16doctor.run.train import Trainer, TrainOptions
from fp16doctor.userfile.spec import load_training_file

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("mode,dtype", [("amp", "float16"), ("bf16", "bfloat16")])
def test_native_cuda_autocast_probe(mode, dtype):
    spec = load_training_file(SAMPLES / "transformer_encoder.py")
    bench = Workbench(spec, build_config(spec.config, {"device": "cuda", "steps": 6}))
    probe = bench.probe(mode)
    frame = probe.run()
    assert frame["loss"].notna().all() and probe.device.type == "cuda"
    assert probe.instruments.compute_dtypes["head"] == dtype  # a linear layer under CUDA autocast
    cpu = Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 6})).probe(mode).run()
    assert abs(frame["loss"].iloc[0] - cpu["loss"].iloc[0]) / cpu["loss"].iloc[0] < (
        1e-2 if dtype == "float16" else 5e-2
    )


def test_corrected_run_on_one_gpu(tmp_path):
    layers, result = diagnosed("model_half.py")
    config = build_config(fixed_config(layers, result), {"device": "cuda"})
    run = Trainer(load_training_file(SAMPLES / "model_half.py"), config, TrainOptions(run_dir=tmp_path)).run()
    assert run.ok and run.steps == config.steps


SAMPLE_CAUSES = [(r.code, s) for r in all_rules() for s in r.triggers]


@pytest.mark.parametrize("code,sample", SAMPLE_CAUSES, ids=[s for _, s in SAMPLE_CAUSES])
def test_cpu_diagnosis_matches_the_gpu_one(code, sample):
    _, on_cpu = diagnosed(sample)
    spec = load_training_file(SAMPLES / sample)
    on_gpu = diagnose(spec, build_config(spec.config, {"device": "cuda"}), DiagnoseOptions())
    assert on_gpu.verdict == on_cpu.verdict
    assert on_gpu.findings[0].cause == on_cpu.findings[0].cause == code


def test_speed_on_a_gpu_measures_each_change_it_can_apply():
    from conftest import ROOT

    import fp16doctor

    report = fp16doctor.speed(ROOT / "tests" / "speed" / "slow_amp.py", device="cuda")
    assert report.device == "cuda" and report.timing["amp"]["peak_memory_bytes"] > 0
    measured = [a for a in report.advice if a.measured is not None]
    assert {a.change.KIND for a in measured} == {"pad-linear", "compile-module", "fuse-optimizer"}
    assert all(a.measured.device == "cuda" for a in measured)
