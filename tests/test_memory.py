"""The diagnosis's memory: one probe alive at a time, kept states within a budget and spilled to a
temporary folder that goes away however the run ends, and ``--max-memory``'s bad values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import MLP_FILE, ROOT, SAMPLES, run_cli

from fp16doctor.engine.kept import StateKeeper


def state(value: float, size: int = 1000) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((size,), value), "bias": torch.full((10,), value)}


def test_kept_states_past_the_budget_go_to_disk_and_come_back_the_same():
    budget = 4 * 1010  # one state of 1010 floats
    with StateKeeper(budget) as keeper:
        kept = keeper.kept()
        live = state(1.0)
        kept[0] = live
        live["weight"].add_(1)  # a probe goes on training: the kept state is a copy
        kept[5] = state(2.0)
        kept[9] = state(3.0)
        assert keeper.in_memory == budget and keeper.spilled == 2
        assert not kept.on_disk(0) and kept.on_disk(5) and kept.on_disk(9)
        folder = keeper.folder
        assert folder is not None and len(list(folder.iterdir())) == 2
        assert list(kept) == [0, 5, 9] and 9 in kept and 4 not in kept
        assert torch.equal(kept[0]["weight"], torch.full((1000,), 1.0))
        assert torch.equal(kept[9]["weight"], torch.full((1000,), 3.0))
        owned = kept.owned(0)
        owned["weight"].zero_()
        assert torch.equal(kept[0]["weight"], torch.full((1000,), 1.0))  # owned: a copy of an in-memory state
        del kept[5]
        assert len(list(folder.iterdir())) == 1
    assert not folder.exists()


@pytest.mark.parametrize("interruption", [RuntimeError, KeyboardInterrupt])
def test_the_spill_folder_is_removed_after_an_exception_or_ctrl_c(interruption):
    with pytest.raises(interruption):
        with StateKeeper(0) as keeper:
            keeper.kept()[0] = state(1.0)
            folder = keeper.folder
            assert folder is not None and any(folder.iterdir())
            raise interruption()
    assert not folder.exists()


PROBE_CENSUS = r"""
import gc, json, sys, weakref
import fp16doctor.engine.kept as kept_module
from fp16doctor.config import build_config
from fp16doctor.diagnosis import DiagnoseOptions, diagnose
from fp16doctor.engine.probe import Probe, Workbench
from fp16doctor.userfile.spec import load_training_file

alive = weakref.WeakSet()
census = {"most_alive": 0, "alive_at_stage_start": [], "folders": [], "spilled": 0, "reference_in_memory": []}
benches = []
make_bench = Workbench.__init__

def kept_bench(self, *args, **kwargs):
    make_bench(self, *args, **kwargs)
    benches.append(self)

Workbench.__init__ = kept_bench
build = Probe.__init__

def counted(self, *args, **kwargs):
    build(self, *args, **kwargs)
    alive.add(self.model)  # a probe's model: its weights, gradients and optimizer state go with it
    census["most_alive"] = max(census["most_alive"], len(alive))

Probe.__init__ = counted
spill = kept_module.StateKeeper.spill

def spilled(self, value):
    path = spill(self, value)
    census["folders"].append(str(path.parent))
    census["spilled"] += 1
    return path

kept_module.StateKeeper.spill = spilled
stop_at = sys.argv[3] if len(sys.argv) > 3 else None

def on_stage(name):
    census["alive_at_stage_start"].append([name, len(alive)])  # no collection first: released, not collected later
    census["reference_in_memory"].append(benches[-1]._initial_state is not None)
    if name == stop_at:
        raise KeyboardInterrupt

spec = load_training_file(sys.argv[1])
config = build_config(spec.config, {"device": "cpu"})
try:
    result = diagnose(spec, config, DiagnoseOptions(ci=True, max_memory=int(sys.argv[2]) or None), on_stage=on_stage)
    census["causes"] = [f.cause for f in result.findings]
    census["reference_back"] = benches[-1]._initial_state is not None and len(benches[-1].initial_state) > 0
except KeyboardInterrupt:
    census["interrupted"] = True
print(json.dumps(census))
"""


def census(sample: str, max_memory: int = 0, stop_at: str | None = None) -> dict:
    """Run a diagnosis in a fresh process, counting the probes alive (weak references, no collection forced)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE_CENSUS, str(SAMPLES / sample), str(max_memory), *([stop_at] if stop_at else [])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def needed_bytes(sample: str) -> int:
    """What --max-memory must leave at least: one probe and the reference weights (diagnosis/memory.py)."""
    from fp16doctor.config import build_config
    from fp16doctor.diagnosis.memory import memory_plan
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(SAMPLES / sample)
    plan = memory_plan(Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 2})))
    return plan.probe_bytes + plan.model_bytes


def test_one_probe_alive_at_a_time_and_none_between_stages():
    # warmup_peak: AMP overflows after the LR jump, so the AMP snapshots, the localisation, the LR-peak pause
    # and the fix verification all run; the budget leaves nothing for kept states in memory: all on disk.
    found = census("warmup_peak.py", max_memory=needed_bytes("warmup_peak.py"))
    assert found["most_alive"] == 1, found
    assert found["alive_at_stage_start"] and all(count == 0 for _, count in found["alive_at_stage_start"]), found
    assert found["spilled"] >= 3  # the FP32 states, the AMP snapshot at the jump, the failing step's snapshot
    assert not any((ROOT / f).exists() for f in set(found["folders"]))  # removed at the end
    assert found["causes"][0] == "lr-schedule-peak"  # the same diagnosis from states read back from disk
    # the reference weights every probe starts from wait on disk too, and are in memory again afterwards
    assert found["reference_in_memory"] and not any(found["reference_in_memory"]) and found["reference_back"], found


def test_an_interrupted_diagnosis_removes_its_spilled_states():
    found = census("warmup_peak.py", max_memory=needed_bytes("warmup_peak.py"), stop_at="LR schedule peak")
    assert found.get("interrupted") and found["spilled"] >= 2, found
    assert not any((ROOT / f).exists() for f in set(found["folders"]))


@pytest.mark.parametrize("value", ["lots", "2XB", "-1GB", "12"])
def test_max_memory_that_is_not_a_size_exits_2_naming_the_flag(training_file, value):
    proc = run_cli("diagnose", training_file(MLP_FILE), "--max-memory", value)
    assert proc.returncode == 2, proc.stderr
    message = " ".join(proc.stderr.split())
    assert "--max-memory" in message and "2GB" in message and "Traceback" not in proc.stderr


def test_max_memory_too_small_for_one_probe_says_what_one_probe_needs(training_file):
    proc = run_cli("diagnose", training_file(MLP_FILE), "--max-memory", "1kB")
    assert proc.returncode == 2, proc.stderr
    message = " ".join(proc.stderr.split())
    assert "too small" in message and "one probe needs about" in message, message
    needed = message.split("one probe needs about ")[1].split()[0]
    assert needed.endswith("kB")  # the MLP of tests/conftest.py: a few hundred parameters
    again = run_cli("diagnose", training_file(MLP_FILE), "--max-memory", "0.25", "--ci", "--json")
    assert again.returncode in (0, 1), again.stderr  # a share of the machine's memory is accepted
    assert json.loads(again.stdout)["stages"]


def test_the_cli_runs_with_every_state_on_disk_and_leaves_no_folder(tmp_path):
    proc = run_cli(
        "diagnose",
        SAMPLES / "warmup_peak.py",
        "--ci",
        "--json",
        "--max-memory",
        str(needed_bytes("warmup_peak.py")),
        env={"TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["findings"][0]["cause"] == "lr-schedule-peak"
    assert not list(tmp_path.glob("fp16doctor-states-*"))


@pytest.mark.cuda
def test_kept_states_of_a_cuda_run_are_in_host_memory():
    with StateKeeper(None) as keeper:
        kept = keeper.kept()
        kept[0] = {"w": torch.ones(3, device="cuda")}
        assert kept[0]["w"].device.type == "cpu"


def test_a_stage_out_of_memory_is_skipped_with_the_reason_and_the_next_runs():
    from types import SimpleNamespace

    from fp16doctor.diagnosis.findings import StageReport
    from fp16doctor.diagnosis.stages import Stage
    from fp16doctor.diagnosis.triage import run_stage

    def too_big(ctx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    ctx = SimpleNamespace(bench=SimpleNamespace(device=torch.device("cpu")))
    report = run_stage(Stage("precision-gap search", too_big), ctx)
    assert report.status == "skipped" and "did not fit in memory" in report.summary and "20.00 GiB" in report.summary
    after = run_stage(Stage("bf16 check", lambda ctx: StageReport("bf16 check", "ran", "fine")), ctx)
    assert after.status == "ran" and after.seconds is not None


HUNGRY_UNDER_AMP = """
import torch
from torch import nn

class Hungry(nn.Module):
    '''Runs out of memory in half precision: a stand-in for an AMP run that does not fit the device.'''
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 3)

    def forward(self, x):
        out = self.inner(x)
        if out.dtype == torch.float16:
            raise torch.OutOfMemoryError("out of memory: tried to allocate 80.00 GiB")
        return out

def model():
    return Hungry()

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(6)]
"""


def test_an_amp_probe_out_of_memory_is_no_verdict_but_one_clear_message(training_file):
    proc = run_cli("diagnose", training_file(HUNGRY_UNDER_AMP), "--ci", "--json")
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    message = " ".join(proc.stderr.split())
    assert "amp as configured probe ran out of memory" in message and "80.00 GiB" in message, message
    assert "Traceback" not in proc.stderr
    error = json.loads(proc.stdout)["error"]  # --json: stdout is still one object, saying why
    assert error["exit_code"] == 2 and "ran out of memory" in error["message"]


def test_compare_out_of_memory_is_one_clear_message(training_file):
    proc = run_cli("compare", training_file(HUNGRY_UNDER_AMP), "--fp32", "--amp", "--steps", "3")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "amp run ran out of memory" in message and "80.00 GiB" in message, (
        proc.returncode,
        proc.stdout[-500:],
        message[-1500:],
    )
    assert "Traceback" not in proc.stderr and "internal error" not in message


def test_train_out_of_memory_stops_as_failed_not_as_an_internal_error(training_file, tmp_path):
    proc = run_cli("train", training_file(HUNGRY_UNDER_AMP), "--steps", "3", "--run-dir", str(tmp_path / "run"))
    output = " ".join((proc.stdout + proc.stderr).split())
    assert "out of memory at step 0" in output and "80.00 GiB" in output, (proc.returncode, output[-1500:])
    assert "Traceback" not in output and "internal error" not in output


def test_a_fix_whose_trial_runs_out_of_memory_stays_untried_with_the_reason(monkeypatch):
    from types import SimpleNamespace

    from fp16doctor.diagnosis.verify import Intervention, Verifier

    ctx = SimpleNamespace(
        evidence=SimpleNamespace(symptoms=[SimpleNamespace(code="nonfinite-loss")]),
        bench=SimpleNamespace(device=torch.device("cpu")),
    )
    verifier = Verifier(ctx)

    def out_of_memory(intervention):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(verifier, "run", out_of_memory)
    verification = verifier.verify(
        Intervention("keep the head in fp32", config_patch={"fp32_modules": ["head"]}), "n/a"
    )
    assert verification.tried is None and not verification.repaired
    assert "did not fit in memory" in verification.reason and verification.symptoms_before == ["nonfinite-loss"]


def test_host_copies_keep_namedtuples_and_a_state_dicts_metadata():
    import collections

    from fp16doctor.engine.kept import host_copy_of

    state = torch.nn.Linear(2, 2).state_dict()
    copied = host_copy_of(state)
    assert type(copied) is type(state) and copied._metadata == state._metadata
    assert copied["weight"].data_ptr() != state["weight"].data_ptr() and torch.equal(copied["weight"], state["weight"])
    Pair = collections.namedtuple("Pair", "tensor count")
    pair = host_copy_of(Pair(torch.ones(2), 3))
    assert isinstance(pair, Pair) and pair.count == 3 and torch.equal(pair.tensor, torch.ones(2))


def test_a_share_of_memory_on_a_system_that_cannot_say_is_bad_input(monkeypatch):
    import os

    from fp16doctor.config import parse_memory_size
    from fp16doctor.errors import ConfigError

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    with pytest.raises(ConfigError, match="does not say how much memory"):
        parse_memory_size("0.5")
    assert parse_memory_size("2GB") == 2 * 10**9


FREED_BLOCKS = """
import sys, torch
from fp16doctor.engine.kept import return_large_blocks_on_free
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096 / 2**20
fixed = sys.argv[1] == "fixed" and return_large_blocks_on_free()
big = torch.ones(4 * 2**20); del big                 # 16 MiB mapped and freed: glibc raises its threshold
before = rss()
blocks, pins = [], []
for _ in range(20):                                   # a closed probe's tensors: 20 x 8 MiB, each followed by
    blocks.append(torch.ones(2 * 2**20))              # a 64 KiB block that outlives them (nothing to trim at the top)
    pins.append(torch.ones(16384))
del blocks
print(fixed, rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_model_sized_blocks_go_back_to_the_system_in_the_diagnosing_process():
    """glibc keeps freed blocks below its (self-raising) mmap threshold resident: a closed probe's memory
    stayed in the process beside the next probe's. The CLI's diagnosing commands fix the threshold."""

    def leftover(variant: str) -> tuple[str, float]:
        out = subprocess.run(
            [sys.executable, "-c", FREED_BLOCKS, variant], capture_output=True, text=True, check=True, cwd=ROOT
        )
        fixed, megabytes = out.stdout.split()
        return fixed, float(megabytes)

    if leftover("plain")[1] < 16:
        pytest.skip("this allocator handed the freed blocks back by itself: nothing to show")
    fixed, kept_resident = leftover("fixed")
    assert fixed == "True" and kept_resident < 8


def test_the_state_block_threshold_is_the_size_of_the_tensors_holding_most_of_the_model():
    from fp16doctor.engine.kept import MMAP_THRESHOLD, state_block_threshold

    mlp = [(896, 64), (896,)] + [(896, 896), (896,)] * 6 + [(10, 896), (10,)]  # 3.2 MB weights hold 98% of it
    assert state_block_threshold(mlp) == 896 * 896 * 4
    assert state_block_threshold([(128, 128)] * 12) == MMAP_THRESHOLD  # 64 KiB tensors: activations would be mapped too
    assert state_block_threshold([(4096, 4096)] * 3) == MMAP_THRESHOLD  # mapped already at the default
    assert state_block_threshold([]) == MMAP_THRESHOLD
    bert_like = [(30522, 768)] + [(768, 768)] * 48 + [(3072, 768)] * 24  # the embedding alone is not 90% of it
    assert state_block_threshold(bert_like) == 768 * 768 * 4


MAPPED_STATE_BLOCK = """
import ctypes, sys, torch
from fp16doctor.engine.kept import StateBlockMapping, return_large_blocks_on_free
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = Info
def mapped():  # how many of four 3.2 MB blocks (below the 4 MiB default) get their own mapping
    before = libc.mallinfo2().hblks
    blocks = [torch.empty(896, 896) for _ in range(4)]
    return libc.mallinfo2().hblks - before
return_large_blocks_on_free()
variant, activations = sys.argv[1], {"same size": [64 * 1024, 4 * 896 * 896], "other sizes": [64 * 1024, 8 * 2**20]}
if variant == "default":
    print(mapped())
elif variant == "after":
    with StateBlockMapping([(896, 896)] * 6):
        pass
    print(mapped())
else:
    with StateBlockMapping([(896, 896)] * 6) as mapping:
        mapping.saw_activations(activations.get(variant, []))
        print(mapped())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_diagnosed_models_weight_sized_blocks_get_their_own_mappings_while_no_activation_shares_the_size():
    """Each variant in a fresh process: glibc serves a block from free heap space of its size before it maps
    one, so a process that freed such blocks in its heap already would not show the threshold."""

    def mapped(variant: str) -> int:
        try:
            out = subprocess.run(
                [sys.executable, "-c", MAPPED_STATE_BLOCK, variant],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
        except subprocess.CalledProcessError as exc:
            if "mallinfo2" in exc.stderr:
                pytest.skip("glibc before 2.33: no mallinfo2 to count mapped blocks with")
            raise
        return int(out.stdout)

    assert mapped("default") == 0  # in the heap, where their holes stay resident between probes
    assert mapped("lowered") == 4 and mapped("other sizes") == 4
    assert mapped("same size") == 0  # every such activation would be a fresh mapping per step: back to the default
    assert mapped("after") == 0  # diagnose --train trains in the same process next
