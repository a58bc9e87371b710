"""`torchrun -m fp16doctor watch` on sharded and replicated training scripts (FSDP2, FSDP1, DDP), 2 processes with
gloo on CPU, each run in fresh torchrun processes: a watched run computes exactly what the unwatched one does (every
rank's losses, scales and final weights, bit for bit) and exits as it does; every rank is observed; each rank's
story of a non-finite step tells a rank's own bad gradients from a reduction that overflowed; ranks that disagree on
a skip or whose replicated weights drift apart are named; the watch's own failure is reported once and the run goes
on; a rank left waiting in the watch's collective stops after --rank-timeout with a line naming it.

What the pinned torch does, measured here and asserted: FSDP2's DTensor gradients make even a plain GradScaler's
skip decision global (its found-inf is combined across the ranks), while FSDP1 with a plain GradScaler lets the ranks
disagree when an overflow is confined to one rank's shard."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
from conftest import ROOT
from rank_launches import launch_ranks

from fp16doctor.live.observe import SHARDED_DISAGREEMENT

pytestmark = pytest.mark.slow

SCRIPTS = ROOT / "tests" / "scripts"
FSDP2 = SCRIPTS / "fsdp2_loop.py"
FSDP_LM = SCRIPTS / "fsdp_lm.py"
DDP = SCRIPTS / "ddp_loop.py"
FORKED_TORCHRUN = ROOT / "tests" / "forked_torchrun.py"
NUMBER = r"(?:[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|-?inf)"
RECORD = re.compile(rf"rank (\d) (step \d+ loss {NUMBER} scale {NUMBER}|final weights {NUMBER})")
APPLIED_ON_RANK_0 = (
    "No capsule: the step was applied on rank(s) 0: the state it started from is gone (a sharded capsule is written "
    "for a step every rank skipped)"
)
RANKS_CAPSULE = "Capsule: {}/ranks_step_{:08d}. Diagnose it: fp16doctor diagnose --capsule {}/ranks_step_{:08d}"

INJECTED_FAILURE = """
import os

if os.environ.get("RANK") == "1":  # the second worker only: not the launcher, not rank 0
    from fp16doctor.live import watch

    def broken(self, *args, **kwargs):
        raise RuntimeError("injected failure\\nits second line")

    watch.Watch._measure = broken
"""


def torchrun(tmp_path, script, *args, watch=None, pythonpath=()):
    """``torchrun --nproc-per-node 2 [-m fp16doctor watch WATCH...] SCRIPT ARGS`` in ``tmp_path``, with this checkout's
    fp16doctor first on the path: torchrun's agent, its ranks forked once torch is imported (``forked_torchrun.py``)."""
    command = [sys.executable, str(FORKED_TORCHRUN), "--standalone", "--nproc-per-node", "2"]
    if watch is not None:
        command += ["-m", "fp16doctor", "watch", *watch]
    path = os.pathsep.join([*map(str, pythonpath), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return launch_ranks(list(map(str, [*command, script, *args])), tmp_path, env)


def outcome(*procs):
    """What went wrong, for an assertion's message: each run's exit code and the end of its stderr."""
    return "\n".join(f"exit {p.returncode}:\n{p.stderr[-2500:]}" for p in procs)


def records(proc):
    """Every rank's printed numbers, sorted (two ranks share one stdout: their lines may interleave mid-line)."""
    return sorted(RECORD.findall(proc.stdout))


def said(proc, text, times=None):
    """``text`` is on stderr (``times`` times, where given): a line may be cut by the other rank's."""
    count = proc.stderr.count(text)
    return count == times if times is not None else count > 0


def test_fsdp2_fp16_with_a_sharded_scaler_runs_as_unwatched_and_names_the_rank_and_module_of_a_bad_batch(tmp_path):
    """Rank 1's batch of step 4 has a NaN: unwatched, the ShardedGradScaler skips it on both ranks and the run goes
    on; watched, the same numbers until then, then rank 1's alarm names its own gradients (before the reduction) and
    rank 0 stops with it in update(), which proves it was watching too."""
    plain = torchrun(tmp_path, FSDP2, "--poison-rank", "1", "--poison-step", "4")
    watched = torchrun(tmp_path, FSDP2, "--poison-rank", "1", "--poison-step", "4", watch=["--capsule-dir", "caps"])
    assert plain.returncode == 0, outcome(plain)
    assert len(records(plain)) == 18 and ("1", "step 4 loss nan scale 32768.0") in records(plain)
    assert watched.returncode == 1 and "tolist" not in watched.stderr, outcome(watched)
    before = [r for r in records(plain) if r[1].startswith("step ") and int(r[1].split()[1]) < 4]
    assert records(watched) == before and len(before) == 8  # bit for bit, both ranks, then stopped
    assert said(
        watched,
        "fp16doctor: nonfinite at optimizer step 4 on rank 1: the loss is nan; rank 1's own gradients were non-finite "
        "before the ranks reduced them (micro-batch 0, first module head (head.bias)); rank 0's were finite: a batch "
        f"of rank 1's, not the reduction. {RANKS_CAPSULE.format('caps', 4, 'caps', 4)}",
        times=1,
    )
    assert said(
        watched,
        f"fp16doctor: stopped at optimizer step 4 on rank 0: rank 1 raised an alarm. {RANKS_CAPSULE.format('caps', 4, 'caps', 4)}",
        times=1,
    )
    assert [p.name for p in (tmp_path / "caps").iterdir()] == ["ranks_step_00000004"]  # one capsule for every rank


def test_fsdp2_bf16_without_a_scaler_runs_as_unwatched(tmp_path):
    plain = torchrun(tmp_path, FSDP2, "--param-dtype", "bfloat16")
    watched = torchrun(tmp_path, FSDP2, "--param-dtype", "bfloat16", watch=[])
    assert plain.returncode == watched.returncode == 0, outcome(plain, watched)
    assert records(watched) == records(plain) and len(records(plain)) == 18  # losses and final weights
    assert "fp16doctor" not in watched.stderr and not any(tmp_path.iterdir())


def test_fsdp1_with_mixed_precision_and_a_sharded_scaler_runs_as_unwatched(tmp_path):
    plain = torchrun(tmp_path, FSDP_LM, "--wrap", "fsdp1", "--scaler", "sharded")
    watched = torchrun(tmp_path, FSDP_LM, "--wrap", "fsdp1", "--scaler", "sharded", watch=[])
    assert plain.returncode == watched.returncode == 0, outcome(plain, watched)
    assert records(watched) == records(plain) and len(records(plain)) == 12
    assert "fp16doctor" not in watched.stderr and not any(tmp_path.iterdir())


def test_ddp_runs_as_unwatched_and_a_rank_that_resumed_alone_is_rank_divergence(tmp_path):
    """The healthy run saves its model; resumed on rank 0 only after DDP wrapped it (DDP broadcast the weights when
    it was built), the ranks train apart: the checksum of the replicated weights names the first parameter."""
    plain = torchrun(tmp_path, DDP, "--save", "ck.pt")
    watched = torchrun(tmp_path, DDP, watch=[])
    assert plain.returncode == watched.returncode == 0, outcome(plain, watched)
    assert records(watched) == records(plain) and len(records(plain)) == 18
    assert "fp16doctor" not in watched.stderr

    resumed = torchrun(tmp_path, DDP, "--resume", "ck.pt", watch=["--checksum-every", "50"])
    assert resumed.returncode == 1, outcome(resumed)
    for rank in (0, 1):
        assert said(
            resumed,
            f"fp16doctor: rank-divergence at optimizer step 0 on rank {rank}: the ranks' copies of body.0.weight "
            "differ (rank 0 vs rank 1) after optimizer step 0 (the first replicated parameter to differ, compared "
            "every 50 steps): the ranks trained apart.",
            times=1,
        )
    assert "step 1" not in resumed.stdout


def test_replicas_that_drift_apart_after_the_last_comparison_are_compared_once_more_at_the_end(tmp_path):
    """Rank 1 alone scales a bias from step 5 on; the checksums are compared every 100 steps (the default), so only
    step 0 was compared: where the ranks meet in destroy_process_group() they are compared once more."""
    drifted = torchrun(tmp_path, DDP, "--drift-rank", "1", "--drift-step", "5", watch=[])
    assert drifted.returncode == 1, outcome(drifted)
    assert "rank 0 step 7" in drifted.stdout and "rank 1 final weights" in drifted.stdout  # the run was not cut short
    for rank in (0, 1):
        assert said(
            drifted,
            f"fp16doctor: rank-divergence at optimizer step 7 on rank {rank}: the ranks' copies of body.2.bias differ "
            "(rank 0 vs rank 1) at the end of the training, after optimizer step 7 (compared there once more).",
            times=1,
        )


def test_ddp_with_fp16_compress_hook_runs_as_unwatched_and_is_named(tmp_path):
    plain = torchrun(tmp_path, DDP, "--fp16-compress")
    watched = torchrun(tmp_path, DDP, "--fp16-compress", watch=[])
    assert plain.returncode == watched.returncode == 0, outcome(plain, watched)
    assert records(watched) == records(plain) and len(records(plain)) == 18
    assert said(watched, "all-reduced in half precision (fp16_compress_hook)", times=1)  # rank 0 says so, once


def test_fsdp1_with_a_plain_gradscaler_lets_the_ranks_disagree_on_an_overflow_in_one_shard(tmp_path):
    """Rank 1's batch of step 3 is mostly padding: its own pad-token logit gradient overflows fp16; reduce-scattered,
    the inf lands in rank 1's shard only. A plain GradScaler under FSDP1 decides on each shard: rank 1 skips, rank 0
    steps."""
    proc = torchrun(
        tmp_path, FSDP_LM, "--wrap", "fsdp1", "--scaler", "plain", "--pad-rank", "1", "--pad-step", "3",
        watch=["--skip-streak", "1"],
    )  # fmt: skip
    assert proc.returncode == 1, outcome(proc)
    disagreement = (
        "rank-disagreement at optimizer step 3 on rank {}: the ranks disagree (rank 0: scale 65536, stepped, rank 1: "
        "scale 65536, found inf, skipped): a GradScaler that decides on each rank's own gradients lets the ranks' "
        "weights drift apart (cause scaler-misuse): use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, "
        "which all-reduces the found-inf so that every rank skips together."
    )
    assert said(proc, disagreement.format(0), times=1) and said(proc, disagreement.format(1), times=1)
    # both ranks' lines say why there is no capsule, not only the writing rank's
    assert said(proc, f"together. No capsule: {SHARDED_DISAGREEMENT}.", times=2)
    assert said(
        proc,
        "fp16doctor: skip-streak at optimizer step 3 on rank 1: 1 optimizer steps skipped in a row (inf/NaN gradients "
        "in flat parameter (embed.weight, mix.weight, ..., lm_head.bias)); rank 1's own gradients were non-finite "
        "before the ranks reduced them (micro-batch 0, first module lm_head (lm_head.weight)); rank 0's were finite: "
        "a batch of rank 1's, not the reduction; the reduced gradients are non-finite in rank 1's shard only (first in "
        f"lm_head.weight), and only rank 1 skipped. {APPLIED_ON_RANK_0}",
        times=1,
    )
    assert "skip-streak at optimizer step 3 on rank 0" not in proc.stderr  # rank 0 stepped
    assert "step 3" not in proc.stdout


def test_fsdp2_makes_even_a_plain_gradscalers_skip_decision_global(tmp_path):
    """The same padded batch under FSDP2: the inf lands in rank 0's shard only, and yet both ranks skip (DTensor
    combines the found-inf across the ranks): no disagreement, the ranks' stories say so."""
    proc = torchrun(
        tmp_path, FSDP_LM, "--wrap", "fsdp2", "--scaler", "plain", "--pad-rank", "1", "--pad-step", "3",
        watch=["--skip-streak", "1"],
    )  # fmt: skip
    assert proc.returncode == 1, outcome(proc)
    assert "rank-disagreement" not in proc.stderr
    story = (
        "rank 1's own gradients were non-finite before the ranks reduced them (micro-batch 0, first module lm_head "
        "(lm_head.weight)); rank 0's were finite: a batch of rank 1's, not the reduction; the reduced gradients are "
        "non-finite in rank 0's shard only (first in lm_head.weight), and every rank skipped: the skip decision was "
        f"global. {RANKS_CAPSULE.format('fp16doctor_capsules', 3, 'fp16doctor_capsules', 3)}"
    )
    assert said(
        proc,
        "fp16doctor: skip-streak at optimizer step 3 on rank 0: 1 optimizer steps skipped in a row (inf/NaN gradients "
        f"in lm_head.weight); {story}",
        times=1,
    )
    assert said(
        proc,
        "fp16doctor: skip-streak at optimizer step 3 on rank 1: 1 optimizer steps skipped in a row (inf/NaN gradients "
        f"in another rank's shard); {story}",
        times=1,
    )


def test_fsdp2_with_an_fp16_reduce_dtype_tells_a_reduction_overflow_from_the_ranks_own_gradients(tmp_path):
    """fp32 compute, gradients reduce-scattered in fp16, features in the thousands: every rank's own (fp32) gradients
    are finite, the reduced ones overflow at every scale."""
    proc = torchrun(
        tmp_path, FSDP2, "--param-dtype", "float32", "--reduce-dtype", "float16", "--feature-scale", "1e4",
        "--steps", "12", watch=[],
    )  # fmt: skip
    assert proc.returncode == 1, outcome(proc)
    for rank in (0, 1):
        assert said(
            proc,
            f"fp16doctor: skip-streak at optimizer step 10 on rank {rank}: 11 optimizer steps skipped in a row from "
            "the scaler's initial scale 65536 down to 64, more than calibrating it takes (inf/NaN gradients in "
            "embed.weight, head.weight); every rank's own gradients were finite before the reduction and the reduced "
            "ones are not: the reduction overflowed (reduce_dtype=torch.float16, world size 2; first in embed.weight).",
            times=1,
        )


def test_the_watchs_own_failure_on_one_rank_is_reported_once_and_the_run_completes_as_unwatched(tmp_path):
    """The measurement raises on rank 1 at every step: it says so once; rank 0 hears of it at the next update() and
    stops meeting it (no rank is left waiting); the training's numbers and exit code are the unwatched run's."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECTED_FAILURE)
    plain = torchrun(tmp_path, FSDP2)
    watched = torchrun(tmp_path, FSDP2, watch=[], pythonpath=[inject])
    assert plain.returncode == watched.returncode == 0, outcome(plain, watched)
    assert records(watched) == records(plain) and len(records(plain)) == 18
    assert said(
        watched,
        "fp16doctor: warning: rank 1: the watch's per-step measurement failed (RuntimeError: injected failure); the "
        "training goes on unwatched.",
        times=1,
    )
    assert said(watched, "fp16doctor: warning: the watch failed on rank 1: the ranks are compared no more.", times=1)
    assert watched.stderr.count("fp16doctor") == 2


def test_a_rank_left_waiting_in_the_watchs_all_gather_stops_after_the_rank_timeout(tmp_path):
    """Rank 1 takes a minute between its step and update() at step 2: rank 0 stops after 3 s, naming the collective,
    and torchrun ends rank 1."""
    start = time.monotonic()
    proc = torchrun(
        tmp_path, DDP, "--slow-rank", "1", "--slow-step", "2", "--slow-seconds", "120", watch=["--rank-timeout", "3"]
    )
    assert proc.returncode == 1 and time.monotonic() - start < 90, outcome(proc)
    assert said(
        proc,
        "fp16doctor: rank-timeout at optimizer step 2 on rank 0: the watch's all-gather of the ranks' scale and skip "
        "decision in GradScaler.update() did not complete within 3 s (RuntimeError: Operation timed out!): another "
        "rank did not reach update().",
        times=1,
    )
    assert "rank 0 step 2" not in proc.stdout
