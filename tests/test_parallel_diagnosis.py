"""``diagnose --nproc N``: the training parallelised under torchrun (gloo on CPU), as its ranks run it.

Fresh CLI processes on training files written as DDP users write them: a ``parallelize(model)`` that registers
PyTorch's fp16 compression hook, DDP's default wrapping, a ``parallelize()`` that raises, a ``model()`` that wraps
itself when a process group exists, a rank that stalls.
"""

from __future__ import annotations

import json
import math

from conftest import ROOT, SAMPLES, diagnose_ci, run_cli

FILES = ROOT / "tests" / "training_files"


def _stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def test_an_fp16_hook_under_bf16_training_fails_only_parallelised_and_an_fp32_reduction_repairs_it():
    proc = diagnose_ci(FILES / "bf16_prices_fp16_hook.py", "--nproc", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = proc.report()
    top = report["findings"][0]
    assert top["cause"] == "half-precision-reduce" and top["severity"] == "error", top
    evidence = top["evidence"]
    assert evidence["hooks"] == ["fp16_compress_hook"] and evidence["world"] == 2
    assert evidence["relative_error"] == "inf" and evidence["nonfinite_steps"] >= 1
    assert evidence["local_max"] > 65504  # a gradient fp16 cannot hold, handed to the fp16 cast
    assert evidence["parallel_only"] is True  # one process is healthy: the fault needs the ranks
    assert top["verification"]["repaired"] is True and top["verification"]["symptoms_after"] == []
    measured = [s for s in report["symptoms"] if s["symptom"] == "nonfinite"]
    assert measured and measured[0]["measured"]["ranks"] == 2
    stage = _stage(report, "parallel")
    assert stage["status"] == "ran" and stage["details"]["parallelized_by"] == "parallelize()"


def test_fsdp2_reducing_in_fp16_is_measured_on_each_ranks_shard_and_reduce_dtype_fp32_repairs_it():
    proc = diagnose_ci(FILES / "fsdp2_fp16_reduce_prices.py", "--nproc", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = proc.report()
    top = report["findings"][0]
    assert top["cause"] == "half-precision-reduce" and top["severity"] == "error", top
    assert top["evidence"]["relative_error"] == "inf" and top["evidence"]["local_max"] > 65504
    assert "reduce_dtype=torch.float32" in top["fix"]["code"]
    assert top["verification"]["repaired"] is True
    details = _stage(report, "parallel")["details"]
    assert details["topology"].startswith("FSDP") and details["policy"]["reduce_dtype"] == "float16"
    assert details["policy"]["param_dtype"] == "bfloat16"
    # output_dtype is unset, but the loss casts the bf16 outputs up: it runs in fp32, and no half-outputs is said
    assert details["loss_dtypes"] == ["float32"]
    assert "half-outputs" not in {f["cause"] for f in report["findings"]}


def test_an_fp16_reduce_scatter_within_range_is_measured_at_2_and_4_ranks_and_reported_as_its_growth():
    """FSDP2, bf16 parameters, reduce_dtype=torch.float16, gradients far inside fp16's range: the reduction only
    rounds. Its worst error is measured at --nproc's 2 ranks and again at 4, in the stage and the finding alike."""
    proc = diagnose_ci(FILES / "fsdp2_fp16_reduce_rounding.py", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = proc.report()
    details = _stage(report, "parallel")["details"]
    growth = details["growth"]
    assert sorted(growth) == ["2", "4"], growth
    # the 2-rank entry is the stage's own measurement, the 4-rank one a run of its own
    assert growth["2"]["relative_error"] == details["worst_reduction"]["relative_error"]
    assert growth["2"]["parameter"] == details["worst_reduction"]["name"]
    fp32_rounding = 2.0**-23  # what an fp32 reduction's summation order alone can leave
    for world in ("2", "4"):
        error = growth[world]["relative_error"]
        assert isinstance(error, float) and math.isfinite(error), growth
        assert fp32_rounding < error < 1e-2, growth  # fp16's rounding: above fp32's, no overflow
        assert growth[world]["nonfinite_steps"] == 0 and 0 < growth[world]["local_max"] < 65504
    warning = next(f for f in report["findings"] if f["cause"] == "half-precision-reduce")
    assert warning["severity"] == "warning"
    # the fix keeps the user's own policy settings beside the fp32 reduction
    assert (
        "param_dtype=torch.bfloat16, output_dtype=torch.float32, reduce_dtype=torch.float32" in warning["fix"]["code"]
    )
    evidence = warning["evidence"]
    assert evidence["growth"] == {world: growth[world]["relative_error"] for world in ("2", "4")}
    # FSDP2 pre-divides by 2 at 2 ranks: the sum of two halves peaks at the largest local gradient
    assert evidence["reduction_peak"] == evidence["local_max"]
    assert math.isclose(evidence["headroom"], 65504 / evidence["local_max"])


def test_fsdp2_fp16_params_without_a_scaler_and_half_outputs_are_warnings_on_a_healthy_run():
    """FSDP2 casting the parameters to fp16, no GradScaler, output_dtype unset, gradients fp16 holds: the
    measurement is healthy, so the policy's facts are warnings and the exit code is 0."""
    proc = diagnose_ci(FILES / "fsdp2_fp16_params_no_scaler.py", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = proc.report()
    details = _stage(report, "parallel")["details"]
    assert details["symptoms"] == [] and details["ranks_agree"] is True and details["scaler_enabled"] is False
    assert details["growth"].keys() == {"2"}  # an fp32 reduction: no run at 4 ranks
    found = {f["cause"]: f for f in report["findings"]}
    assert all(f["severity"] != "error" for f in report["findings"]), found
    unscaled = found["fp16-params-unscaled"]
    assert unscaled["severity"] == "warning" and unscaled["evidence"]["why_unscaled"] == "scaler.enabled is false"
    assert "GradScaler" in unscaled["fix"]["summary"]
    outputs = found["half-outputs"]
    assert outputs["evidence"]["param_dtype"] == "float16" and outputs["evidence"]["output_dtype"] is None
    assert details["loss_dtypes"] == ["float16"]  # the loss took the fp16 logits as they came
    assert "output_dtype=torch.float32" in outputs["fix"]["code"]
    assert "half-precision-reduce" not in found


def test_an_overflow_the_scaler_absorbs_as_calibration_is_a_warning_with_its_measurement():
    """fp16 + GradScaler, an fp32 head: the hook's cast overflows while the scale settles from 65536 (7 skips
    PyTorch's calibration would make anyway), no symptom in the probe's steps: a warning, measured."""
    proc = diagnose_ci(FILES / "fp32_head_compressed.py", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = next(f for f in proc.report()["findings"] if f["cause"] == "half-precision-reduce")
    assert warning["severity"] == "warning"
    assert warning["evidence"]["module"] == "head" and warning["evidence"]["nonfinite_steps"] >= 1


def test_ddp_by_default_is_healthy_and_its_fp32_reduction_matches_the_reference():
    proc = diagnose_ci(SAMPLES / "mlp.py", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = _stage(proc.report(), "parallel")
    details = stage["details"]
    assert details["topology"] == "DistributedDataParallel" and details["parallelized_by"] == "DistributedDataParallel"
    assert "DistributedDataParallel (the doctor's default)" in stage["summary"]  # no parallelize() to name
    assert details["hooks"] == [] and details["ranks_agree"] is True and details["symptoms"] == []
    worst = details["worst_reduction"]
    assert details["reduction_measured"] and math.isfinite(worst["relative_error"])
    assert worst["relative_error"] < 1e-5  # fp32 against fp32: summation order only


def test_a_parallelize_that_raises_exits_2_with_the_ranks_error_and_its_line(training_file):
    path = training_file(
        """
        import torch
        from torch import nn

        def model():
            return nn.Linear(8, 2)

        def data():
            return [(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))] * 4

        def parallelize(model):
            mesh = {"dp": 2}
            return nn.parallel.DistributedDataParallel(model, device_ids=[mesh["tp"]])
        """
    )
    proc = run_cli("diagnose", path, "--ci", "--nproc", "2")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "parallelize() raised KeyError" in proc.stderr and f"{path}:13" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_model_that_wraps_itself_under_a_process_group_is_pointed_at_parallelize(training_file):
    path = training_file(
        """
        import torch
        import torch.distributed as dist
        from torch import nn

        def model():
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
            return nn.parallel.DistributedDataParallel(net) if dist.is_initialized() else net

        def data():
            return [(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))] * 4
        """
    )
    proc = run_cli("diagnose", path, "--ci", "--nproc", "2")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "model() returns a DistributedDataParallel" in proc.stderr and "parallelize(model)" in proc.stderr


def test_a_rank_that_stalls_is_stopped_after_the_rank_timeout_with_where_each_rank_was(training_file):
    path = training_file(
        """
        import time
        import torch
        import torch.distributed as dist
        from torch import nn

        def model():
            return nn.Linear(8, 2)

        def data():
            return [(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))] * 4

        def parallelize(model):
            if dist.get_rank() == 1:
                time.sleep(600)  # a rank-dependent stall: rank 0 waits for it in DDP's first broadcast
            return nn.parallel.DistributedDataParallel(model)
        """
    )
    proc = run_cli("diagnose", path, "--ci", "--nproc", "2", "--rank-timeout", "15", timeout=200)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no rank moved for 15 s" in proc.stderr
    assert "rank 1 was in parallelize()" in proc.stderr and "rank 0 was in parallelize()" in proc.stderr


def test_train_nproc_trains_in_the_topology_parallelize_builds(tmp_path):
    """The corrected training runs as the file's parallelize() wraps the model: its hook is there, and reported."""
    proc = run_cli(
        "train", FILES / "bf16_prices_fp16_hook.py", "--nproc", "2", "--steps", "3", "--run-dir", tmp_path / "run"
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [f["cause"] for f in summary["findings"]] == ["ddp-half-allreduce"]
    assert "fp16_compress_hook" in summary["findings"][0]["title"]


def test_compare_nproc_runs_the_modes_on_the_ranks_and_tells_a_fault_only_the_ranks_show():
    """One process is healthy; on 2 ranks the fp16 compression hook overflows and the scaler skips: the ranks'
    comparison says so, beside the single process's, and the exit code is the worse of the two."""
    proc = run_cli("compare", FILES / "bf16_prices_fp16_hook.py", "--nproc", "2", "--steps", "4", "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["verdict_by_mode"]["amp"] == "healthy"
    ranks = report["ranks"]
    assert ranks["world"] == 2 and ranks["hooks"] == ["fp16_compress_hook"] and ranks["ranks_agree"] is True
    on_ranks = ranks["comparison"]
    assert on_ranks["verdict_by_mode"]["amp"] != "healthy" and on_ranks["skipped_steps"]["amp"] > 0
    assert report["verdict"] == on_ranks["verdict"]
    assert [row["step"] for row in on_ranks["steps"]] == [0, 1, 2, 3]  # aligned on steps taken, as one process is


def test_compare_nproc_on_a_healthy_ddp_training_is_healthy_on_the_ranks_too(tmp_path):
    proc = run_cli("compare", SAMPLES / "mlp.py", "--nproc", "2", "--steps", "3", "--csv", tmp_path / "steps.csv")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "amp on 2 ranks" in (tmp_path / "steps.csv").read_text()  # the ranks' records beside one process's
    assert "On 2 ranks" in proc.stdout and "DistributedDataParallel (the doctor's default)" in proc.stdout
    assert "the ranks agree" in proc.stdout


def test_a_fix_verified_in_one_process_is_measured_on_the_ranks_with_the_reduction_they_need_too():
    """Two faults: the head's fp16 backward overflows (keeping the linear layers in fp32 repairs one process) and
    the fp16 reduce-scatter overflows the offset's gradient (only the ranks show it). The corrected config is run on
    the ranks: alone it leaves them skipping; with the reduction in fp32 too, nothing is left, and the corrected
    config names that change."""
    proc = run_cli("diagnose", FILES / "fsdp2_price_scale_two_faults.py", "--nproc", "2", "--json", timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    corrected = json.loads(proc.stdout)["corrected"]
    assert corrected["symptoms_after"] == [] and corrected["ranks_symptoms_after"] == [], corrected
    assert corrected["needs_code_changes"] == ["half-precision-reduce"], corrected
    assert corrected["ranks_summary"] == "with 2 ranks: skips; with its reduction in fp32 too: no symptom left"


def test_more_cpu_ranks_than_cores_is_said_as_slower_not_different():
    from fp16doctor.diagnosis.stages.parallel import shared_cores

    assert shared_cores(8, "cpu", 2).startswith("8 ranks share this machine's 2 CPU cores: the parallel stage runs")
    assert shared_cores(2, "cpu", 2) is None and shared_cores(8, "cuda", 2) is None
