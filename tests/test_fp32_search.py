"""FP32 failing is a symptom: the cause is what repairs FP32 as well, and fp32-divergence stands only where nothing
does. Each training file (tests/training_files/) holds its fault the way people write it and is diagnosed in a
fresh CLI process; the capsule cases run a watched script (or loop), then diagnose its capsule in another process.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from conftest import ROOT, diagnose_ci, run_cli

from fp16doctor.diagnosis.stages.lr_peak import growth_before
from fp16doctor.live.stepstate import StepStart, StepStartKeeper

FILES = ROOT / "tests" / "training_files"
SCRIPTS = ROOT / "tests" / "scripts"


def diagnosed(name: str) -> dict:
    proc = diagnose_ci(FILES / name)
    assert proc.returncode == 1, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.report()


def stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def causes(report: dict) -> list[str]:
    return [f["cause"] for f in report["findings"]]


def repaired_in_fp32_and_amp(finding: dict) -> bool:
    """The finding's fix, tried, removed FP32's failure and AMP's symptoms: nothing measured is left, AMP finite."""
    v = finding["verification"]
    return (
        v["repaired"] is True
        and "fp32-nonfinite" in v["symptoms_before"]
        and v["symptoms_after"] == []
        and v["summary"].startswith("AMP finite")
    )


def test_a_constant_learning_rate_too_high_is_named_and_a_tenth_of_it_verified():
    """Momentum SGD at 0.5, no schedule: FP32 diverges too. The doctor's own fp32 gradient norm once made it look
    like 'aten::linalg_vector_norm in the loss'; a tenth of the rate keeps FP32 and AMP finite, and that is the
    cause, not fp32-divergence's 'data, learning rate or model'."""
    report = diagnosed("sgd_lr_too_high.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("lr-too-high", "intervention"), causes(report)
    assert top["fix"]["config_patch"] == {"overrides": {"max_lr": 0.05}} and top["evidence"]["lr"] == 0.5
    assert top["evidence"]["fp32_operator"] == "aten::mse_loss" and "fp32-divergence" not in causes(report)
    assert "fp32-nonfinite" not in (top["verification"]["symptoms_after"] or [])


@pytest.mark.parametrize(
    ("name", "lag"),
    [("warmup_jump_count_model.py", 1), ("warmup_jump_momentum_sgd.py", 4), ("warmup_jump_bf16.py", 6)],
)
def test_a_warmup_jump_that_breaks_fp32_too_is_the_schedule_whatever_the_lag(name, lag):
    """A warm-up whose LR jumps 300x: FP32 and AMP diverge 1, 4 or 6 steps after the jump. The trouble is tied to
    the jump by the measured trajectory (a three-step window missed the bf16 one, which grows for six steps), the
    cause is the schedule, and the capped LR is verified in FP32 and AMP."""
    report = diagnosed(name)
    top = report["findings"][0]
    assert top["cause"] == "lr-schedule-peak" and repaired_in_fp32_and_amp(top), [
        f["title"] for f in report["findings"]
    ]
    assert "fp32-divergence" not in causes(report)
    evidence = top["evidence"]
    assert evidence["jump_ratio"] == pytest.approx(300.0) and evidence["step"] == evidence["jump_step"]
    growth = evidence["growth"]
    assert growth["first_nonfinite_step"] - evidence["step"] == lag
    # the trajectory from before the jump up to the first non-finite step, each step's gradient norm and loss
    assert growth["steps"][0] < evidence["step"] and growth["steps"][-1] == growth["first_nonfinite_step"]
    finite = [v for v in growth["grad_norm"][:-1]]
    assert all(isinstance(v, float) for v in finite) and (growth["grad_norm"][-1] in ("inf", "nan") or lag == 1)
    if lag > 1:  # it grew step after step, tenfold and more, from the jump on
        values = growth[growth["growing"]]
        grown = values[growth["steps"].index(growth["growth_step"]) - 1 : -1]
        assert growth["growth"] >= 10 and all(b > a for a, b in zip(grown, grown[1:])), growth
    assert top["fix"]["config_patch"] == {"overrides": {"max_lr": evidence["lr_before"]}}
    assert report["corrected"]["healthy_after"] is True
    assert stage(report, "LR schedule peak")["details"]["trajectory"]["trouble_step"] == growth["first_nonfinite_step"]


def test_a_warmup_to_a_peak_far_too_high_is_capped_below_the_climb_and_verified_in_fp32_and_amp():
    """transformers' linear warm-up and decay to a peak 30x too high: the loss grows from the second warm-up step
    and FP32 overflows after the peak. The rate before the peak does not hold; a lower peak, found by the pause
    from the start of the climb, does, and the full probes verify it in FP32 and AMP."""
    report = diagnosed("warmup_decay_peak_too_high.py")
    top = report["findings"][0]
    assert top["cause"] == "lr-schedule-peak" and repaired_in_fp32_and_amp(top), [
        f["title"] for f in report["findings"]
    ]
    evidence = top["evidence"]
    assert evidence["step"] == evidence["peak_step"] and evidence["capped_from"] < evidence["step"]
    assert evidence["lr_before"] <= evidence["lr_at_event"] / 4  # a lower peak, not the rate of the step before
    growth = evidence["growth"]
    assert growth["probe"] == "fp32" and growth["growth_step"] < evidence["step"] and growth["growth"] > 1e6
    assert "Lower the peak" in top["fix"]["summary"] and "warm-up" in top["fix"]["summary"]
    assert "fp32-divergence" not in causes(report)


def test_rows_holding_a_sentinel_that_breaks_fp32_are_extreme_data_found_by_dropping_them():
    """float32's largest value written for missing readings: FP32 overflows at the first such batch. No rule names
    it (the data holds no NaN, and FP32 is not finite); the data without those rows repairs FP32 and AMP."""
    report = diagnosed("sentinel_rows_fp32.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("extreme-data", "intervention") and repaired_in_fp32_and_amp(top)
    assert "reaches 1000 in magnitude" in top["verification"]["tried"] and "3.4e+38" in top["title"]
    search = stage(report, "intervention search")
    assert search["status"] == "ran" and search["details"]["trials"][0]["kind"] == "drop-extreme-rows"
    assert "fp32-divergence" not in causes(report)


def test_a_loss_whose_sigmoid_saturates_in_fp32_is_found_by_computing_it_in_float64():
    """-(y log p + (1 - y) log(1 - p)) on p = sigmoid(logit): fp32 rounds p to 1.0 and the log is -inf. FP32's first
    non-finite value is in the loss, and the loss in float64 repairs FP32 and AMP: the formulation is at fault."""
    report = diagnosed("bce_by_hand_saturates.py")
    top = report["findings"][0]
    assert (top["cause"], top["found_by"]) == ("unstable-loss", "intervention") and repaired_in_fp32_and_amp(top)
    assert top["fix"]["config_patch"] == {"overrides": {"loss_in_fp64": True}}
    assert top["evidence"]["operator"] == "aten::log" and top["evidence"]["output"].startswith("-inf")
    assert "binary_cross_entropy_with_logits" in top["fix"]["code"]
    assert "fp32-divergence" not in causes(report)


def test_a_model_bug_nothing_repairs_is_fp32_divergence_listing_what_was_tried():
    """A ReLU rate scored by torch.distributions.Poisson: log(0) in fp32 and in float64. The search runs on the FP32
    probe, nothing repairs it, and fp32-divergence stands, with the interventions tried in its evidence."""
    report = diagnosed("poisson_relu_rate.py")
    top = report["findings"][0]
    assert (top["cause"], top["severity"]) == ("fp32-divergence", "error")
    tried = top["evidence"]["tried"]
    assert [t["kind"] for t in tried] == ["loss-fp64", "lr-lower", "lr-lower"]  # --ci: three tries, no 1000th
    assert all("still fails" in t["screen"] for t in tried)
    assert all(t["symptoms_after"] is None for t in tried)  # the screen on FP32's failing step stopped each
    assert "computing the loss in float64" in top["verification"]["reason"]
    assert stage(report, "intervention search")["status"] == "ran"
    assert "fp32-nonfinite" in top["evidence"]["symptoms"] and report["unexplained"] == []
    assert "unexplained" not in causes(report)


def test_a_watched_temporal_graph_network_is_diagnosed_from_the_state_its_step_started_from(tmp_path):
    """A TGN's memory module writes its buffers in forward; the time encoder overflows fp16 on raw seconds and the
    failing forward writes NaN into the memory. Taken after the forward, the capsule replayed from that NaN memory
    and said fp32-divergence at step 0 (user trial). The watch keeps the buffers as the step found them: the FP32
    replay is finite and the fault is the time encoder's, under AMP."""
    proc = run_cli("watch", "--capsule-dir", tmp_path / "caps", SCRIPTS / "temporal_graph_memory.py", cwd=tmp_path)
    assert proc.returncode == 1 and "nonfinite at optimizer step" in proc.stderr, proc.stderr[-2000:]
    capsule = next((tmp_path / "caps").iterdir())
    manifest = json.loads((capsule / "manifest.json").read_text())
    assert set(manifest["step_state"]["restored"]) == {"memory.memory", "memory.last_update"}
    assert manifest["step_state"]["uncaptured"] == [] and manifest["history_finite"] is True
    state = torch.load(capsule / "capsule.pt", weights_only=True)
    assert torch.isfinite(state["model"]["memory.memory"]).all()  # as the step found it, not as its forward left it

    diagnosed = run_cli("diagnose", "--ci", "--json", "--capsule", capsule, cwd=ROOT)
    assert diagnosed.returncode == 1, diagnosed.stderr[-3000:]
    report = json.loads(diagnosed.stdout)
    assert "non-finite" not in stage(report, "fp32 baseline")["summary"]
    assert "fp32-divergence" not in causes(report) and "capsule-state" not in causes(report)
    localised = stage(report, "localisation")["details"]["amp"]
    assert localised["module"] == "memory.time_enc.lin" and localised["output"].endswith("(float16)")
    top = report["findings"][0]
    assert top["severity"] == "error" and top["verification"]["repaired"], top["title"]
    assert "memory.time_enc.lin" in top["title"]


class BankedEncoder(torch.nn.Module):
    """An encoder that keeps its last batches' mean features in a Python list (a memory bank) and adds their mean."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 16)
        self.bank = []

    def forward(self, x):
        h = self.net(x)
        context = torch.stack(self.bank).mean(0) if self.bank else torch.zeros_like(h[0])
        self.bank = (self.bank + [h.detach().float().mean(0)])[-4:]
        return h + context


def test_state_the_watch_cannot_keep_is_named_instead_of_blaming_fp32(tmp_path):
    """A memory bank kept in a Python list: the failing forward appends an inf to it, and the watch can neither copy
    nor undo a list. The capsule's FP32 replay is non-finite from its first step although the watched run was
    finite before the alarm: the diagnosis says which state the capsule lacks, not fp32-divergence."""
    from test_watch import watched_amp_steps

    torch.manual_seed(0)
    model = BankedEncoder()
    x = torch.randn(16, 8)

    def energy(scale: float) -> torch.Tensor:
        return (model(x * scale).float() ** 2).mean()

    alarm = watched_amp_steps(
        tmp_path,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        [lambda: energy(1.0), lambda: energy(1.0), lambda: energy(1e5)],
    )
    manifest = json.loads((alarm.capsule / "manifest.json").read_text())
    assert manifest["step_state"]["uncaptured"] == ["bank"]
    proc = run_cli("diagnose", "--ci", "--json", "--capsule", alarm.capsule)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    top = report["findings"][0]
    assert top["cause"] == "capsule-state" and top["evidence"]["uncaptured"] == ["bank"], causes(report)
    assert "fp32-divergence" not in causes(report) and "'bank'" in top["title"]


# --- the pieces, without a diagnosis -------------------------------------------------------------------------


class Memory(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("state", torch.zeros(3, 2))
        self.cache = torch.zeros(2)
        self.calls = 0
        self.seen = []

    def forward(self, x):
        self.state[0] = x.sum()  # written in place
        self.cache = self.cache + 1  # rebound
        self.calls += 1
        return self.lin(x)


def test_the_state_a_forward_writes_is_put_back_as_the_step_found_it_for_the_capsule_only():
    model = Memory()
    start = StepStart.take(model, copied=None)
    model(torch.full((1, 2), float("nan")))
    with start.restored(model) as report:
        assert torch.equal(model.state, torch.zeros(3, 2)) and torch.equal(model.cache, torch.zeros(2))
        assert model.calls == 0 and model.state_dict()["state"].isfinite().all()
    assert set(report.restored) == {"state", "cache", "calls"} and report.uncaptured == []
    assert model.state[0, 0].isnan() and model.calls == 1  # the training's own state is left as it was


def test_what_the_watch_cannot_undo_is_reported_and_only_written_tensors_are_copied_after_the_first_step():
    model = Memory()
    keeper = StepStartKeeper()
    keeper.begin(model)
    model(torch.ones(1, 2))
    keeper.end()
    assert keeper.written == {"state"}  # learned: the cache is rebound, only the buffer is written in place
    keeper.begin(model)
    assert keeper.start is not None
    assert keeper.start.held["state"].copy is not None and keeper.start.held["cache"].copy is None
    model.seen.append(1)
    model(torch.ones(1, 2))
    with keeper.start.restored(model) as report:
        assert torch.equal(model.cache, torch.ones(2))  # the start's tensor, untouched by the rebinding
    assert report.uncaptured == ["seen"] and "cache" in report.restored


def test_the_keepers_slots_are_found_again_when_a_forward_adds_state_and_only_then():
    """A step's two reads walk the slots found before; an attribute a forward adds is found at the next step."""
    model = Memory()
    keeper = StepStartKeeper()
    keeper.begin(model)
    model(torch.ones(1, 2))
    keeper.end()
    slots = keeper.slots.of(model)
    assert keeper.slots.of(model) is slots  # nothing changed in number: the same list, no walk of the tree
    model.lin.running = torch.zeros(2)  # state a later forward creates
    assert "lin.running" in {key for key, *_ in keeper.slots.of(model)}
    model.lin = torch.nn.BatchNorm1d(2)  # a submodule replaced in place: the same counts, other state
    assert "lin.running_mean" in {key for key, *_ in keeper.slots.of(model)}
    keeper.begin(model)
    assert keeper.start is not None and "lin.running_mean" in keeper.start.held


def test_a_weight_view_whose_storage_a_sharding_wrapper_freed_is_no_state_and_is_never_read():
    """FSDP1 keeps a module's weight as a plain tensor attribute viewing its flat parameter, and frees that storage
    between forwards: copying the view would read freed memory."""
    model = Memory()
    flat = torch.ones(8)
    model.lin.weight_view = flat[:4].view(2, 2)
    flat.untyped_storage().resize_(0)  # resharded
    start = StepStart.take(model, copied=None)
    assert "lin.weight_view" not in start.held and start.held["cache"].copy is not None


def test_a_growth_is_the_run_of_rising_values_up_to_the_step_before_the_trouble():
    values = pd.Series([1.0, 0.9, 1.1, 5.0, 80.0, 3e4, float("inf")])
    assert growth_before(values, trouble=6) == (3e4 / 0.9, 2)
    assert growth_before(pd.Series([1.0, 2.0, 1.5, float("nan")]), trouble=3) is None  # fell right before


def test_a_peak_rate_typed_three_orders_too_high_is_lowered_until_amp_stops_skipping_too():
    """A warm-up to 3.0 (meant 3e-3): a tenth still diverges, a hundredth keeps FP32 finite but leaves AMP skipping
    most steps; the rate that leaves the fewest symptoms is named, and no skip is left unexplained."""
    proc = run_cli("diagnose", ROOT / "tests" / "training_files" / "warmup_peak_typo.py", "--json", timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    top = report["findings"][0]
    assert top["cause"] == "lr-too-high" and top["fix"]["config_patch"] == {"overrides": {"max_lr": 0.003}}, top
    assert "unexplained" not in causes(report)
