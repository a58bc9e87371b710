"""The watch engine in a hand-written loop: each alarm at the step it should fire, and capsules that load."""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from fp16doctor.config import CALIBRATION_SKIPS
from fp16doctor.live.observe import scaler_decision
from fp16doctor.live.watch import Watch, WatchOptions


def loop(
    tmp_path,
    steps=12,
    init_scale=2.0**16,
    spike_at=None,
    nan_at=None,
    optimizer_class=torch.optim.SGD,
    loss_factor=lambda step: 1.0,
    first_step=0,
    decided=False,
    **options,
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    watch = Watch(model, WatchOptions(capsule_dir=tmp_path, **{"spike_window": 6, **options}), dtype="float16")
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        if step == spike_at:
            x = x * 300
        if step == nan_at:
            x[0, 0] = float("nan")
        watch.capture_batch((x, y))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) * loss_factor(step)
        watch.record_loss(loss)
        scaler.scale(loss).backward()
        if decided:  # as the observer checks: inside scaler.step, the scaler's own found-inf given
            found_inf = scaler_decision(scaler, optimizer)
            alarm = watch.before_optimizer_step(first_step + step, optimizer, scaler, found_inf=found_inf)
        else:
            alarm = watch.before_optimizer_step(first_step + step, optimizer, scaler, grads_scaled=True)
        scaler.step(optimizer)
        scaler.update()
        if alarm is not None:
            return watch, alarm
    return watch, None


def test_a_healthy_loop_raises_nothing_and_reads_unscaled_norms(tmp_path):
    watch, alarm = loop(tmp_path)
    assert alarm is None and len(watch.history) == 12 and not any(tmp_path.iterdir())
    assert all(0 < h.grad_norm < 100 for h in watch.history)  # divided by the 65536 scale


def test_with_the_scalers_decision_norms_are_read_every_k_steps_and_on_each_skipped_step(tmp_path):
    """A step the scaler applies needs no per-layer norm (half the watch's cost): they are read every norms_every
    steps, and on a skipped step, whose non-finite layers the alarm names."""
    watch, alarm = loop(tmp_path, steps=9, decided=True, norms_every=4, nan_at=6, alarms=("skip-streak",))
    read = [h.step for h in watch.history if h.grad_norm is not None]
    assert alarm is None and read == [0, 4, 6, 8]
    skipped = watch.history[6]
    assert skipped.skipped and skipped.nonfinite_layers and not math.isfinite(skipped.grad_norm)
    assert all(not h.nonfinite_layers and h.largest_layer is None for h in watch.history if h.grad_norm is None)
    everywhere, _ = loop(tmp_path, steps=4, decided=True, norms_every=1)
    assert all(h.grad_norm is not None and 0 < h.grad_norm < 100 for h in everywhere.history)


def test_nan_loss_alarms_at_its_step_with_a_loadable_capsule(tmp_path):
    watch, alarm = loop(tmp_path, nan_at=7)
    assert (
        alarm.kind == "nonfinite"
        and alarm.step == 7
        and "Diagnose it: fp16doctor diagnose --capsule" in alarm.pointer()
    )
    state = torch.load(alarm.capsule / "capsule.pt", weights_only=True)
    assert state["step"] == 7 and torch.isnan(state["batches"][0][0]).any() and state["scaler"]["scale"] > 1
    assert (alarm.capsule / "train_capsule.py").is_file() and (alarm.capsule / "config.json").is_file()


def test_each_optimizer_the_capsule_builds_starts_from_its_own_copy_of_the_saved_moments(tmp_path):
    """The diagnosis builds one optimizer per probe: a probe whose NaN gradients poison its Adam moments must
    not hand them to the next probe (a data fix was once measured on moments an earlier probe had made NaN)."""
    import importlib.util

    _, alarm = loop(tmp_path, nan_at=7, optimizer_class=torch.optim.AdamW)
    spec = importlib.util.spec_from_file_location("capsule_file", alarm.capsule / "train_capsule.py")
    capsule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capsule)
    first, second = capsule.model(), capsule.model()
    poisoned, clean = capsule.optimizer(first.parameters()), capsule.optimizer(second.parameters())
    for p in first.parameters():
        p.grad = torch.full_like(p, float("nan"))
    poisoned.step()
    moments = [state["exp_avg"] for state in clean.state.values()]
    assert moments and all(torch.isfinite(m).all() for m in moments)
    assert all(torch.isfinite(s["exp_avg"]).all() for s in capsule.STATE["optimizer"]["state"].values())


def test_a_scale_far_too_high_alarms_as_a_skip_streak_once_settling_would_have_ended(tmp_path):
    """A fresh scaler's leading skips are settling up to CALIBRATION_SKIPS (what diagnose counts as settling);
    from 2^60 the scale still overflows after them."""
    watch, alarm = loop(tmp_path, init_scale=2.0**60, skip_streak=4)
    assert alarm.kind == "skip-streak" and alarm.step == CALIBRATION_SKIPS and all(h.skipped for h in watch.history)
    assert "from the scaler's initial scale 1.15292e+18" in alarm.message


def test_a_default_scale_settling_is_no_alarm_but_a_streak_after_applied_steps_is(tmp_path):
    """The loss x 300 overflows fp16 logit gradients at scales above ~3000: a default scaler skips 5 steps in a
    row while it settles (the watch alarmed on them at 5, where the capsule's diagnosis then said healthy);
    from step 10 the loss x 1e7 overflows at every scale that is left: 5 skips after applied steps alarm (the
    loss-spike alarm, which would see the jump first, is off)."""
    factor = lambda step: 300.0 if step < 10 else 1e7  # noqa: E731
    scaled_down = lambda params, lr: torch.optim.SGD(params, lr=lr / 300)  # noqa: E731  the same updates
    watch, alarm = loop(
        tmp_path,
        steps=20,
        loss_factor=factor,
        skip_streak=5,
        optimizer_class=scaled_down,
        alarms=("nonfinite", "skip-streak", "scale-collapse"),
    )
    leading = next(i for i, h in enumerate(watch.history) if not h.skipped)
    assert 5 <= leading <= CALIBRATION_SKIPS  # longer than the streak: the settling is what is tested
    assert not any(h.skipped for h in watch.history[leading:10])
    assert alarm.kind == "skip-streak" and alarm.step == 14 and "initial scale" not in alarm.message


def test_a_resumed_scaler_is_settled_from_its_first_step(tmp_path):
    """A watch that begins past optimizer step 0 (a resumed Trainer's global_step) sees a scale that settled before:
    skips alarm at the streak."""
    watch, alarm = loop(tmp_path, init_scale=2.0**60, skip_streak=4, first_step=100)
    assert alarm.kind == "skip-streak" and alarm.step == 103


def test_a_collapsed_scale_alarms(tmp_path):
    watch, alarm = loop(tmp_path, init_scale=2.0**60, skip_streak=1000, min_scale=2.0**50)
    assert alarm.kind == "scale-collapse" and watch.history[-1].loss_scale <= 2.0**50


def test_a_loss_spike_alarms(tmp_path):
    watch, alarm = loop(tmp_path, spike_at=9)
    assert alarm.kind == "loss-spike" and alarm.step == 9


def test_a_loss_spike_in_the_first_steps_alarms_against_their_median_with_the_factor_squared(tmp_path):
    """With the default 20-step window, step 4 has 4 steps of history (10 are needed for the running median): it is
    measured against their median, at 10**2 = 100x."""
    blows_up = {4: 300.0}
    watch, alarm = loop(tmp_path, spike_window=20, loss_factor=lambda step: blows_up.get(step, 1.0))
    assert alarm.kind == "loss-spike" and alarm.step == 4
    assert "x the median of the first 4 steps" in alarm.message
    ratio = watch.history[-1].loss / statistics.median(h.loss for h in watch.history[:-1])
    assert ratio > 100


def test_an_early_loss_below_the_squared_factor_or_with_too_few_steps_is_no_spike(tmp_path):
    grows = {4: 30.0}  # a 30x loss at step 4: a spike after 10 steps, not yet before
    watch, alarm = loop(tmp_path, spike_window=20, loss_factor=lambda step: grows.get(step, 1.0))
    assert alarm is None and len(watch.history) == 12
    blows_up = {2: 300.0}  # 2 earlier steps: too few for a median
    _, alarm = loop(tmp_path, spike_window=20, loss_factor=lambda step: blows_up.get(step, 1.0))
    assert alarm is None


def test_checking_a_step_and_writing_its_capsule_leaves_the_trainings_random_numbers_alone(tmp_path, monkeypatch):
    """Capsule and probe work inside someone else's training may draw or reseed (here: every generator is
    drawn from while the capsule is saved); the training's next random numbers must not change."""
    import random

    import numpy as np

    import fp16doctor.live.watch as watch_module

    save = watch_module.atomic_torch_save

    def drawing_save(path, obj, **options):
        torch.manual_seed(123), torch.rand(3), random.random(), np.random.rand(2)
        save(path, obj, **options)

    monkeypatch.setattr(watch_module, "atomic_torch_save", drawing_save)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = Watch(model, WatchOptions(capsule_dir=tmp_path), dtype="float16")
    watch.capture_batch(torch.ones(1, 4))
    watch.record_loss(torch.tensor(float("nan")))
    model(torch.ones(1, 4)).sum().backward()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    alarm = watch.before_optimizer_step(0, optimizer)
    assert alarm is not None and (alarm.capsule / "capsule.pt").is_file()  # the capsule work did run
    drawn = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert drawn == (torch.rand(2).tolist(), random.random(), float(np.random.rand()))


def test_the_observer_holds_large_output_gradients_only_once_a_skip_armed_it_and_restores_torch(monkeypatch, tmp_path):
    import fp16doctor.live.observe as observe

    monkeypatch.setattr(observe, "OUTPUT_GRAD_LIMIT", 10)  # the 16x3 logits count as large
    held: list[bool] = []

    class Spy(observe.TrainingObserver):
        def check(self, optimizer, scaler, found_inf):
            held.extend(c.grads[0] is not None for c in self._calls)
            super().check(optimizer, scaler, found_inf)

    def patched():
        return (
            torch.Tensor.backward,
            torch.amp.GradScaler.step,
            torch.amp.GradScaler.update,
            torch.amp.GradScaler.scale,
            torch.optim.Optimizer.__init__,
            torch.optim.Optimizer.zero_grad,
            torch.nn.Module.zero_grad,
            torch.nn.modules.module._global_forward_hooks.copy(),
        )

    originals = patched()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # overflows: the first steps are skipped
    with Spy(WatchOptions(capsule_dir=tmp_path, stop_on_alarm=False, skip_streak=100)) as observer:
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    history = next(iter(observer.watches.values())).history
    assert history[0].skipped and held == [False, True, True]  # step 0 was not armed; its skip armed the next ones
    assert all(abs(h.loss - 1.1) < 0.5 for h in history)  # the unscaled loss, read at the backward
    assert patched() == originals and observe._active is None


def test_a_finite_loss_with_a_non_finite_output_gradient_is_localised_to_the_loss(tmp_path):
    """sqrt at 0 in the loss: the loss is 0, its gradient w.r.t. the logits NaN; the capsule says where it arises."""
    import json

    from fp16doctor.live.capsule import check_capsule, replay_note
    from fp16doctor.live.observe import TrainingObserver, WatchStopped

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    try:  # a first, healthy step is applied: the scale has settled, so one skip is the streak of 1
        with TrainingObserver(WatchOptions(capsule_dir=tmp_path, skip_streak=1)) as observer:
            for sqrt_at_zero in (False, True):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(torch.randn(16, 8))
                loss = torch.sqrt((logits.float() * 0).sum()) if sqrt_at_zero else logits.float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
    except WatchStopped as stopped:
        alarm = stopped.alarm
    assert alarm.kind == "skip-streak" and alarm.step == 1 and observer.alarms == [alarm]
    manifest = check_capsule(alarm.capsule)
    assert "outside the model" in manifest["loss_finding"] and "outside the model" in replay_note(manifest)
    assert json.loads((alarm.capsule / "manifest.json").read_text())["replay"] == "output-grads"


def test_the_capsule_trains_in_the_precision_the_scripts_autocast_used(tmp_path):
    """fp16 autocast without a GradScaler (no loss scaling at all) must replay in fp16, not in bf16."""
    import json

    from fp16doctor.live.observe import TrainingObserver, WatchStopped

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8)
    x[0, 0] = float("inf")
    try:
        with TrainingObserver(WatchOptions(capsule_dir=tmp_path)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), torch.randint(0, 3, (16,)))
            loss.backward()
            optimizer.step()
    except WatchStopped as stopped:
        alarm = stopped.alarm
    assert alarm.kind == "nonfinite" and json.loads((alarm.capsule / "config.json").read_text())["dtype"] == "float16"


def test_the_observer_holds_the_steps_batches_as_references_and_copies_them_only_for_a_capsule(tmp_path):
    """No per-step host copy of a batch (on a GPU each is a transfer and a sync): the held micro-batch is the very
    tensor the model received; only the capsule an alarm writes copies it."""
    from host_copies import HostCopies

    import fp16doctor.live.observe as observe

    held: list[bool] = []
    batches: list[torch.Tensor] = []

    class Spy(observe.TrainingObserver):
        def check(self, optimizer, scaler, found_inf):
            held.extend(c.batch["args"][0] is batches[-1] for c in self._calls)
            super().check(optimizer, scaler, found_inf)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    copies_per_step = []
    with HostCopies() as copies, Spy(WatchOptions(capsule_dir=tmp_path, stop_on_alarm=False)):
        for step in range(5):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            if step == 4:
                x[2, 2] = float("nan")
            batches.append(x)
            copies.watch(x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            scaler.scale(torch.nn.functional.cross_entropy(logits.float(), y)).backward()
            before = copies.count
            scaler.step(optimizer)
            scaler.update()
            copies_per_step.append(copies.count - before)
    assert held == [True] * 5 and copies_per_step[:4] == [0, 0, 0, 0]  # healthy steps: references, no copy
    assert copies_per_step[4] > 0 and (tmp_path / "step_00000004").is_dir()  # the capsule's copy is counted


def test_only_gradients_holding_an_inf_or_nan_are_non_finite_layers_not_those_whose_norm_overflows():
    """The one pass the watch makes is an L2 norm per layer; a finite gradient whose squares overflow fp32 (or
    whose norm passes fp16's range) is looked at again and stays finite."""
    from fp16doctor.live.watch import nonfinite_layers

    grads = [
        torch.full((4,), 1e20),
        torch.full((8,), 6e4, dtype=torch.float16),
        torch.tensor([1.0, float("inf")]),
        torch.tensor([float("nan"), 0.0]),
        torch.ones(3),
    ]
    names = ["huge", "half", "inf", "nan", "fine"]
    norms = [float(n) for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]
    assert not math.isfinite(norms[0]) and math.isfinite(norms[1])
    assert nonfinite_layers(grads, names, norms) == ["inf", "nan"]


def watched_amp_steps(folder, optimizer, losses):
    """PyTorch's AMP recipe, one step per loss function in ``losses``, under a TrainingObserver that alarms at the
    first skipped step and writes its capsule into ``folder``: the alarm."""
    from fp16doctor.live.observe import TrainingObserver, WatchStopped

    scaler = torch.amp.GradScaler("cpu")
    try:
        with TrainingObserver(WatchOptions(capsule_dir=folder, skip_streak=1)):
            for compute in losses:
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = compute()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
    except WatchStopped as stopped:
        return stopped.alarm
    raise AssertionError("the observer did not alarm")


def test_a_capsule_whose_loss_gradient_is_non_finite_is_diagnosed_as_the_loss_not_as_fp32(tmp_path):
    """log(softmax + 1e-8) in fp16: a probability that is 0 in fp16 stays 0 (1e-8 is 0 there too), the loss (of the
    targets' probabilities) is finite, and its gradient w.r.t. the logits is NaN. The capsule replays the model from
    that gradient: with its NaN entries the FP32 replay was NaN too and the diagnosis said fp32-divergence, "not
    precision" (user check). Its finite entries drive the model; the finding is about the loss, outside the model."""
    import json

    from conftest import run_cli

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    x, y = torch.randn(16, 8), torch.zeros(16, dtype=torch.long)

    def sharp_nll(sharp: float) -> torch.Tensor:
        logits = model(x) * sharp
        logits = logits + torch.tensor([30.0, 0.0, 0.0]) * (sharp > 1)  # the target's probability stays ~1
        return F.nll_loss(torch.log(torch.softmax(logits, -1) + 1e-8), y)

    # a first, healthy step is applied; then sharp logits
    alarm = watched_amp_steps(
        tmp_path, torch.optim.SGD(model.parameters(), lr=1e-2), [lambda: sharp_nll(1.0), lambda: sharp_nll(40.0)]
    )
    manifest = json.loads((alarm.capsule / "manifest.json").read_text())
    assert manifest["loss_finding"] and manifest["replay"] == "output-grads"
    proc = run_cli("diagnose", "--capsule", alarm.capsule, "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    payload = json.loads(proc.stdout)
    causes = [f["cause"] for f in payload["findings"]]
    assert causes[0] == "loss-in-half" and "fp32-divergence" not in causes, causes
    top = payload["findings"][0]
    assert top["severity"] == "error" and top["evidence"]["recorded"] == manifest["loss_finding"]
    assert top["fix"]["config_patch"] == {} and "log_softmax" in top["fix"]["summary"]
    assert "non-finite" not in {s["name"]: s["summary"] for s in payload["stages"]}["fp32 baseline"]
    direct = run_cli("diagnose", alarm.capsule / "train_capsule.py", "--json")  # the capsule's own file: the same
    assert json.loads(direct.stdout)["findings"][0]["cause"] == "loss-in-half", direct.stderr[-2000:]


def test_a_capsule_whose_loss_is_inf_from_a_log_of_zero_in_some_rows_is_diagnosed_as_the_loss(tmp_path):
    """-log(p + 1e-8) with p of fp16: a target whose probability rounds to 0 makes the loss itself inf (a user's
    script: the capsule said healthy, the watch's 'the loss is inf' unexplained). The manifest keeps the step's
    loss; the replayed model is finite under AMP on the same weights and batch, so the loss is named."""
    import json

    from conftest import run_cli

    from fp16doctor.live.capsule import recorded_loss_evidence

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    x, y = torch.randn(16, 8), torch.tensor([0, 1] * 8)

    def hand_nll(sharp: float) -> torch.Tensor:
        logits = model(x) + torch.tensor([30.0, 0.0, 0.0]) * (sharp > 1)  # class 1's probability: exp(-30), 0 in fp16
        probs = torch.softmax(logits, -1).half()
        return -torch.log(probs.gather(1, y[:, None]) + 1e-8).mean()

    alarm = watched_amp_steps(
        tmp_path, torch.optim.SGD(model.parameters(), lr=1e-2), [lambda: hand_nll(1.0), lambda: hand_nll(40.0)]
    )
    manifest = json.loads((alarm.capsule / "manifest.json").read_text())
    assert manifest["loss"] == "inf" and not manifest["loss_finding"]  # the loss itself: no finding about its gradient
    assert manifest["loss_dtypes"] == ["float16"]
    proc = run_cli("diagnose", "--capsule", alarm.capsule, "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    top = json.loads(proc.stdout)["findings"][0]
    assert top["cause"] == "loss-in-half" and "loss of inf" in top["evidence"]["recorded"], top["title"]
    inf_loss = {
        "step": 3,
        "loss": "inf",
        "loss_finding": None,
        "replay": "output-grads",
        "loss_dtypes": ["float32"],
        "output_dtypes": ["float16"],
    }
    assert "from float16 outputs" in recorded_loss_evidence(inf_loss)
    assert recorded_loss_evidence({**inf_loss, "loss": "2.5"}) is None
    assert recorded_loss_evidence({**inf_loss, "replay": "hf"}) is None  # a trainer's capsule replays its loss
    # no half precision in or out of the loss (a 0/0 over an all-padding batch): no evidence about precision
    assert recorded_loss_evidence({**inf_loss, "output_dtypes": ["float32"]}) is None
    assert recorded_loss_evidence({"step": 3}) is None  # a capsule from before the loss was kept


def test_a_capsule_whose_outputs_went_non_finite_is_diagnosed_from_the_data_not_as_fp32(tmp_path):
    """Raw inputs (~1e5) overflow fp16 in the first Linear: the loss is NaN and so is its whole gradient w.r.t. the
    outputs. The replay used that gradient as recorded: the FP32 replay turned NaN and the diagnosis said
    fp32-divergence (user trial), while its data scan and localisation had the answer. The NaN entries now count
    as 0, a tensor without a finite entry stands in its mean's gradient."""
    import json

    from conftest import run_cli

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def regression(raw: bool) -> torch.Tensor:
        x = torch.randn(16, 8)
        y = x.sum(1, keepdim=True)
        return F.mse_loss(model(x * 2e4 + 1e5 if raw else x).float(), y)

    # a first, healthy step; then a shard in raw units
    alarm = watched_amp_steps(
        tmp_path, torch.optim.Adam(model.parameters(), lr=1e-3), [lambda: regression(False), lambda: regression(True)]
    )
    manifest = json.loads((alarm.capsule / "manifest.json").read_text())
    assert not manifest["loss_finding"] and manifest["replay"] == "output-grads"  # the loss itself is NaN
    proc = run_cli("diagnose", "--capsule", alarm.capsule, "--json", "--device", "cpu")
    assert proc.returncode == 1, proc.stderr[-2000:]
    payload = json.loads(proc.stdout)
    causes = [f["cause"] for f in payload["findings"]]
    assert causes[0] == "extreme-data" and "fp32-divergence" not in causes, causes
    assert "non-finite" not in {s["name"]: s["summary"] for s in payload["stages"]}["fp32 baseline"]


def test_a_script_that_loads_its_scaler_state_is_settled_under_the_observer(tmp_path):
    """Under fp16doctor watch every process counts its optimizer steps from 0, and load_state_dict makes the
    loaded scale the scaler's init_scale: the observer sees the load, so a resumed run alarms at the streak (4),
    not after the 11 skips a fresh scaler may take to settle (review)."""
    from fp16doctor.live.observe import TrainingObserver

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with TrainingObserver(WatchOptions(capsule_dir=tmp_path, skip_streak=4, stop_on_alarm=False)) as observer:
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(
            {
                "scale": 2.0**60,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
                "_growth_tracker": 7,
            }
        )  # a checkpoint's scaler
        for _ in range(6):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert [a.kind for a in observer.alarms] == ["skip-streak"] and observer.alarms[0].step == 3
    assert "initial scale" not in observer.alarms[0].message


def test_the_capsules_model_keeps_the_users_hooks_and_their_marks_but_none_of_the_watchs():
    """A hook registered with kwargs is marked in a table keyed by its id. The watch's hook was dropped from the
    pickled model but its mark stayed: in the replay's process the next hook registered under that id was called
    with kwargs it does not take (a TypeError inside the doctor's own instruments, blamed on the training)."""
    import functools

    from fp16doctor.live.capsule import detached_module
    from fp16doctor.tensors import norms

    model = torch.nn.Linear(2, 2)
    users = model.register_forward_hook(lambda module, args, kwargs, out: None, with_kwargs=True)
    watchs = model.register_forward_hook(functools.partial(norms), with_kwargs=True)
    plain = model.register_forward_pre_hook(functools.partial(norms))
    clone = detached_module(model)
    assert list(clone._forward_hooks) == [users.id] and list(clone._forward_hooks_with_kwargs) == [users.id]
    assert not clone._forward_pre_hooks and watchs.id in model._forward_hooks_with_kwargs
    assert plain.id in model._forward_pre_hooks and plain.id not in clone._forward_pre_hooks


class GroupsItself(torch.optim.SGD):
    """An optimizer that takes a flat list of tensors and groups them itself (Muon's kind): it refuses groups."""

    def __init__(self, params, lr=1e-2):
        params = list(params)
        assert all(isinstance(p, torch.Tensor) for p in params), "tensors only"
        super().__init__(
            [{"params": [p for p in params if p.ndim == 2]}, {"params": [p for p in params if p.ndim < 2]}], lr=lr
        )


def test_a_capsules_optimizer_that_groups_its_parameters_itself_is_built_from_the_flat_list(tmp_path):
    import importlib.util

    _, alarm = loop(tmp_path, nan_at=7, optimizer_class=GroupsItself)
    spec = importlib.util.spec_from_file_location("capsule_file", alarm.capsule / "train_capsule.py")
    capsule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capsule)
    net = capsule.model()
    opt = capsule.optimizer(net.parameters())
    assert type(opt).__name__ == "GroupsItself" and [len(g["params"]) for g in opt.param_groups] == [2, 2]
