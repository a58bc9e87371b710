"""`diagnose --from-checkpoint`: every probe starts from the trained state a run left, in fresh CLI processes. A
fault only a trained state shows (a regression head whose outputs grew past 65504) is found from the checkpoint
where the same file from initialisation is healthy; a checkpoint of another model, or one that needs more than
weights-only loading, is bad input with one message. And the layouts it reads (torch.save, Lightning, a real
Hugging Face Trainer's checkpoint folder) and the data's continuation, in this process."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys

import pytest
import torch
from conftest import ROOT, diagnose_ci, run_cli

from fp16doctor.userfile.checkpoint import load_checkpoint
from fp16doctor.userfile.spec import draw_batches, load_training_file

FILE = ROOT / "tests" / "training_files" / "pretrained_price_head.py"


def train_price_model(path):
    """The file's model trained as such a run trains it: its head fitted by least squares on the features (a
    linear probe), then AdamW steps; saved as people save checkpoints."""
    spec = importlib.util.spec_from_file_location("price", FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    net = module.model()
    optimizer = module.optimizer(net.parameters())
    x, y = (torch.cat(parts) for parts in zip(*module.data()))
    with torch.no_grad():
        features = net[:-1](x)
        solution = torch.linalg.lstsq(torch.cat([features, torch.ones(len(x), 1)], 1), y).solution
        net[-1].weight.copy_(solution[:-1].T)
        net[-1].bias.copy_(solution[-1])
    for _ in range(3):
        optimizer.zero_grad()
        module.loss(net, (x, y)).backward()
        optimizer.step()
    scaler = torch.amp.GradScaler("cpu")
    torch.save(
        {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "step": 500},
        path,
    )
    return float(net(x).detach().abs().max())


def test_a_fault_only_the_trained_state_shows_is_found_from_its_checkpoint(tmp_path):
    checkpoint = tmp_path / "step_500.pt"
    assert train_price_model(checkpoint) > 65504  # the trained head's outputs: past fp16's range
    assert diagnose_ci(FILE).returncode == 0  # from initialisation: healthy
    proc = run_cli("diagnose", FILE, "--ci", "--json", "--from-checkpoint", checkpoint)
    report = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr[-3000:]
    top = report["findings"][0]
    assert top["cause"] == "activation-overflow" and "'4'" in top["title"]  # the head, model[4]
    assert any("torch.save dict" in n and "step 500" in n and "scaler" in n for n in report["notes"])


def test_a_checkpoint_of_another_model_is_bad_input_naming_the_keys(tmp_path):
    other = tmp_path / "other.pt"
    torch.save({"model": torch.nn.Linear(3, 3).state_dict()}, other)
    proc = run_cli("diagnose", FILE, "--ci", "--from-checkpoint", other)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "does not hold this model's weights" in text, proc.stderr[-2000:]
    assert "missing 0.bias, 0.weight" in text and "unexpected bias, weight" in text


def test_a_checkpoint_that_pickles_objects_needs_the_users_trust(tmp_path):
    """Training scripts often save their argparse arguments beside the weights: weights-only loading refuses the
    Namespace, and the message says how to load it anyway."""
    spec = load_training_file(FILE)
    pickled = tmp_path / "with_args.pt"
    torch.save({"model": spec.model().state_dict(), "args": argparse.Namespace(lr=0.1, epochs=3)}, pickled)
    refused = run_cli("compare", FILE, "--steps", "2", "--from-checkpoint", pickled)
    assert refused.returncode == 2 and "--trust-checkpoint" in " ".join(refused.stderr.split()), refused.stderr
    assert "(argparse.Namespace)" in refused.stderr and "\x1b" not in refused.stderr  # the global, no terminal codes
    trusted = run_cli("compare", FILE, "--steps", "2", "--json", "--from-checkpoint", pickled, "--trust-checkpoint")
    assert trusted.returncode in (0, 1), trusted.stderr[-2000:]  # loaded: the comparison ran


def test_a_lightning_checkpoint_is_read_through_its_module_prefix_and_list_of_states(tmp_path):
    net = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    path = tmp_path / "epoch=0-step=40.ckpt"
    torch.save(
        {
            "state_dict": {f"layer.{k}": v for k, v in net.state_dict().items()},
            "optimizer_states": [optimizer.state_dict()],
            "lr_schedulers": [],
            "MixedPrecision": torch.amp.GradScaler("cpu", init_scale=2.0**20).state_dict(),
            "global_step": 40,
            "pytorch-lightning_version": "2.5.0",
        },
        path,
    )
    start = load_checkpoint(path)
    assert start.layout == "Lightning checkpoint" and start.step == 40 and start.scaler["scale"] == 2.0**20
    assert len(start.optimizers) == 1 and start.schedulers == []
    assert set(start.model_state_for(net.state_dict())) == {"weight", "bias"}  # "layer." taken off
    assert load_checkpoint(path, from_step=12).step == 12


@pytest.mark.slow
def test_a_real_hugging_face_trainer_checkpoint_folder_is_read(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    from history_runs import Tagger, train_hf

    train_hf(tmp_path / "run", steps=20)
    start = load_checkpoint(tmp_path / "run" / "checkpoint-20")
    assert start.layout == "Hugging Face checkpoint" and start.step == 20
    assert len(start.optimizers) == len(start.schedulers) == 1  # optimizer.pt, scheduler.pt
    model = Tagger()
    model.load_state_dict(start.model_state_for(model.state_dict()))
    assert torch.equal(model.net[0].weight, start.model["net.0.weight"])
    assert start.rng is not None and start.rng["cpu"].dtype == torch.uint8  # rng_state.pth, NumPy's state and all
    assert {"python", "numpy"} <= set(start.rng) and "random generators" in start.describe()


def test_every_probe_draws_on_from_the_generators_the_checkpoint_kept(tmp_path, training_file):
    """Dropout in a probe started from a checkpoint draws what the training would have drawn next."""
    from fp16doctor import api
    from fp16doctor.engine.probe import Workbench

    path = training_file(
        """
        import torch
        def model():
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        def data():
            return [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(4)]
        """
    )
    torch.manual_seed(1234)
    torch.rand(7)  # the training drew something
    kept = torch.get_rng_state()
    state = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).state_dict()
    torch.save({"model": state, "step": 3, "rng_state": {"cpu": kept}}, tmp_path / "ckpt.pt")
    start = api.CheckpointStart(tmp_path / "ckpt.pt")
    loaded = api.start_from_checkpoint(api.load(path, steps=2, device="cpu"), start)
    for mode in ("fp32", "amp"):
        probe = Workbench(loaded.spec, loaded.config).probe(mode, instruments=None)
        assert torch.equal(torch.get_rng_state(), kept), mode
        probe.close()


def test_the_data_continues_at_the_checkpoints_step(tmp_path):
    taking = tmp_path / "takes_step.py"
    taking.write_text(
        "import torch\nfrom torch import nn\n\ndef model():\n    return nn.Linear(1, 1)\n\n"
        "def data(start_step=0):\n    return [torch.full((2, 1), float(start_step + i)) for i in range(3)]\n"
    )
    plain = tmp_path / "plain.py"
    plain.write_text(
        "import torch\nfrom torch import nn\n\ndef model():\n    return nn.Linear(1, 1)\n\n"
        "def data():\n    return (torch.full((2, 1), float(i)) for i in range(4))\n"
    )
    for path, expected in ((taking, [7.0, 8.0, 9.0]), (plain, [3.0, 0.0, 1.0])):  # 7 = 1 epoch of 4 + 3
        spec = load_training_file(path)
        spec.start = load_checkpoint(_saved(tmp_path, spec), from_step=7)
        assert [float(b[0, 0]) for b in draw_batches(spec, 3)] == expected, path.name


def _saved(tmp_path, spec):
    path = tmp_path / "state.pt"
    torch.save({"model": spec.model().state_dict(), "step": 0}, path)
    return path


def test_generators_saved_under_numpy_1_load_and_an_unreadable_file_is_no_generators(tmp_path):
    import numpy as np

    from fp16doctor.userfile.checkpoint import _load_rng, _rng_of

    state = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state()}
    torch.save(state, tmp_path / "rng.pth", _use_new_zipfile_serialization=False)
    legacy = (tmp_path / "rng.pth").read_bytes().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert legacy != (tmp_path / "rng.pth").read_bytes()  # the file names NumPy 1's module now
    (tmp_path / "legacy.pth").write_bytes(legacy)
    loaded = _rng_of(_load_rng(tmp_path / "legacy.pth", trust=False))
    assert loaded is not None and torch.equal(loaded["cpu"], state["cpu"])
    (tmp_path / "broken.pth").write_bytes(b"not a pickle")
    assert _rng_of(_load_rng(tmp_path / "broken.pth", trust=False)) is None


def test_a_gans_checkpoint_gives_each_optimizer_and_scheduler_its_own_state_and_a_misfit_is_refused(tmp_path):
    """Lightning keeps one state per optimizer, in configure_optimizers' order: each of the file's optimizers
    (and schedulers) takes up its own, in the order optimizers(model) returns them, or by the names of a dict. A
    checkpoint with another count of optimizers is of another training: refused, not trained on fresh moments."""
    from fp16doctor.config import build_config
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.errors import CheckpointError

    spec = load_training_file(ROOT / "tests" / "training_files" / "gan_two_optimizers.py")
    gan = spec.model()
    trained = spec.optimizers(gan)
    schedulers = spec.scheduler(trained)
    for k, opt in enumerate(trained):  # moments of its own in each: the generator's and the discriminator's differ
        ((k + 1) * sum(p.sum() for p in opt.param_groups[0]["params"])).backward()
        opt.step()
    for scheduler in schedulers:
        for _ in range(10):
            scheduler.step()
    ckpt = {
        "state_dict": gan.state_dict(),
        "optimizer_states": [opt.state_dict() for opt in trained],
        "lr_schedulers": [s.state_dict() for s in schedulers],
        "global_step": 10,
        "pytorch-lightning_version": "2.5.0",
    }
    torch.save(ckpt, tmp_path / "gan.ckpt")
    spec.start = load_checkpoint(tmp_path / "gan.ckpt")
    assert "2 optimizers" in spec.start.describe() and "2 schedulers" in spec.start.describe()
    probe = Workbench(spec, build_config({"steps": 2}, {"device": "cpu"})).probe("amp", instruments=None)
    for mine, saved in zip(probe.optimizers.all(), trained):
        assert torch.equal(_first_moment(mine), _first_moment(saved))
    assert [s.last_epoch for s in probe.schedulers] == [10, 10]
    probe.close()
    generator, discriminator = ckpt["optimizer_states"]
    torch.save({"model": gan.state_dict(), "optimizers": {"g": generator, "d": discriminator}}, tmp_path / "n.pt")
    named = load_checkpoint(tmp_path / "n.pt")
    by_name = named.optimizer_states_for(["d", "g"])  # a file whose optimizers(model) returns {"d": ..., "g": ...}
    assert _first_moment_of(generator) != _first_moment_of(discriminator)
    assert [_first_moment_of(s) for s in by_name] == [_first_moment_of(discriminator), _first_moment_of(generator)]
    in_order = named.optimizer_states_for(["optimizers[0]", "optimizers[1]"])  # the file names none: as saved
    assert [_first_moment_of(s) for s in in_order] == [_first_moment_of(generator), _first_moment_of(discriminator)]
    with pytest.raises(CheckpointError, match="named g, d; the file makes 2 optimizer"):
        named.optimizer_states_for(["g", "critic"])
    # fp16doctor train's own checkpoint keeps the first optimizer's state apart too: every one is taken
    torch.save(
        {
            "model": gan.state_dict(),
            "optimizer": generator,
            "optimizers": {"optimizers[0]": generator, "optimizers[1]": discriminator},
            "scheduler": ckpt["lr_schedulers"][0],
            "schedulers": ckpt["lr_schedulers"],
            "step": 10,
        },
        tmp_path / "step_10.pt",
    )
    trained_run = load_checkpoint(tmp_path / "step_10.pt")
    assert len(trained_run.optimizer_states_for(["optimizers[0]", "optimizers[1]"])) == 2
    assert len(trained_run.schedulers) == 2
    torch.save({**ckpt, "optimizer_states": ckpt["optimizer_states"][:1]}, tmp_path / "one.ckpt")
    spec.start = load_checkpoint(tmp_path / "one.ckpt")
    with pytest.raises(CheckpointError, match="holds 1 optimizer state.*makes 2 optimizer"):
        Workbench(spec, build_config({"steps": 2}, {"device": "cpu"})).probe("amp", instruments=None)


def _first_moment(optimizer):
    return next(iter(optimizer.state_dict()["state"].values()))["exp_avg"]


def _first_moment_of(state):
    return next(iter(state["state"].values()))["exp_avg"].tolist()


def test_weights_of_a_larger_model_or_under_two_prefixes_or_of_other_shapes_are_refused(tmp_path):
    """The model's keys inside a checkpoint of a larger model, the same keys under two prefixes (an EMA copy beside
    the student), shapes that differ: each a checkpoint of another model, never loaded as far as it goes."""
    from fp16doctor.errors import CheckpointError

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    larger = torch.nn.Sequential(*net, torch.nn.Linear(4, 2)).state_dict()
    cases = {
        "larger": ({"model": larger}, "unexpected 3.bias, 3.weight"),
        "two": ({"model": {**_prefixed(net, "ema."), **_prefixed(net, "student.")}}, "several prefixes ('ema."),
        "wrapped": ({"model": {**_prefixed(net, "module."), "module.3.weight": torch.ones(1)}}, "module.3.weight"),
        "shapes": ({"model": torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
                    .state_dict()}, "0.weight: [32, 8] in the checkpoint, [16, 8] in the model"),
    }  # fmt: skip
    for name, (saved, said) in cases.items():
        torch.save(saved, tmp_path / f"{name}.pt")
        with pytest.raises(CheckpointError, match=re.escape(said)):
            load_checkpoint(tmp_path / f"{name}.pt").model_state_for(net.state_dict())
    torch.save({"model": _prefixed(net, "module.")}, tmp_path / "ddp.pt")
    assert set(load_checkpoint(tmp_path / "ddp.pt").model_state_for(net.state_dict())) == set(net.state_dict())
    legacy = tmp_path / "legacy.pt"  # torch.save's format before zip files: torch reads no globals off it
    torch.save(
        {"model": net.state_dict(), "args": argparse.Namespace(lr=1)}, legacy, _use_new_zipfile_serialization=False
    )
    with pytest.raises(CheckpointError, match=re.escape("(argparse.Namespace)")) as raised:
        load_checkpoint(legacy)
    assert "--trust-checkpoint" in raised.value.hint
    (tmp_path / "trainer_state.json").write_text('{"global_step": 3}')
    for trust in (False, True):  # not a checkpoint at all: trusting it changes nothing, and is not suggested
        with pytest.raises(CheckpointError, match="is not a checkpoint torch.load reads") as raised:
            load_checkpoint(tmp_path / "trainer_state.json", trust=trust)
        assert "--trust-checkpoint" not in raised.value.hint


def _prefixed(module, prefix):
    return {prefix + k: v for k, v in module.state_dict().items()}


def test_optimizer_groups_that_differ_are_named_and_an_unused_scheduler_state_is_said(tmp_path, training_file):
    """Hugging Face's Trainer splits the parameters into two groups (weight decay, none): a file whose optimizer
    has one gets the groups named, not load_state_dict's complaint; a scheduler state the file has no scheduler for
    is said to be left, not listed as taken up."""
    from fp16doctor.config import build_config
    from fp16doctor.engine.probe import Workbench
    from fp16doctor.errors import CheckpointError

    path = training_file(
        """
        import torch
        def model():
            return torch.nn.Linear(4, 2)
        def data():
            return [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(4)]
        """
    )
    spec = load_training_file(path)
    net = spec.model()
    split = torch.optim.AdamW([{"params": [net.weight]}, {"params": [net.bias], "weight_decay": 0.0}])
    schedule = torch.optim.lr_scheduler.StepLR(split, 5).state_dict()
    torch.save({"model": net.state_dict(), "optimizer": split.state_dict(), "scheduler": schedule}, tmp_path / "a.pt")
    spec.start = load_checkpoint(tmp_path / "a.pt")
    config = build_config({"steps": 2}, {"device": "cpu"})
    with pytest.raises(CheckpointError, match=re.escape("2 parameter group(s) of [1, 1] parameters; the file's has 1")):
        Workbench(spec, config).probe("amp", instruments=None)
    one = torch.optim.AdamW(net.parameters())
    torch.save({"model": net.state_dict(), "optimizer": one.state_dict(), "scheduler": schedule}, tmp_path / "b.pt")
    spec.start = load_checkpoint(tmp_path / "b.pt", from_step=30)
    Workbench(spec, config).probe("amp", instruments=None).close()
    assert any("scheduler state (1) is not taken up" in note for note in spec.notes)
    assert "saved at" not in spec.start.describe() and spec.start.step == 30  # it says no step of its own


def test_the_schedules_dry_run_starts_where_the_checkpoint_left_it(tmp_path, training_file):
    """StepLR(5, 0.5) saved at step 12: the probes go on at 0.01 x 0.5^2, halving again 3 steps later; the LR
    stage's schedule is that one, not the schedule from initialisation. The loss-scale stage's underflow is at the
    scale the checkpoint's scaler had."""
    import fp16doctor
    from fp16doctor import api

    path = training_file(
        """
        import torch
        CONFIG = {"steps": 6, "lr": 0.01}
        def model():
            torch.manual_seed(0)
            return torch.nn.Linear(4, 2)
        def data():
            g = torch.Generator().manual_seed(0)
            return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(40)]
        def scheduler(optimizer):
            return torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.5)
        """
    )
    spec = load_training_file(path)
    net = spec.model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    schedule = spec.scheduler(optimizer)
    for _ in range(12):
        optimizer.step()
        schedule.step()
    state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict()}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict()
    torch.save({**state, "scaler": scaler, "step": 12}, tmp_path / "ts.pt")
    report = fp16doctor.diagnose(path, ci=True, device="cpu", from_checkpoint=api.CheckpointStart(tmp_path / "ts.pt"))
    lrs = report.evidence.lr_peak.schedule.lrs if report.evidence.lr_peak is not None else None
    assert lrs is not None and lrs[:5] == pytest.approx([0.0025, 0.0025, 0.0025, 0.00125, 0.00125])
    sweep = next(s for s in report.stages if s.name == "loss-scale sweep")
    assert "at the checkpoint's scale 1024" in sweep.summary  # the scale the AMP probe started at
    # a checkpoint that kept no scheduler state: the file's schedule at step 12, said so, not its start
    torch.save({"model": net.state_dict(), "step": 12}, tmp_path / "weights_only.pt")
    start = api.CheckpointStart(tmp_path / "weights_only.pt")
    report = fp16doctor.diagnose(path, ci=True, device="cpu", from_checkpoint=start)
    assert report.evidence.lr_peak.schedule.lrs[:4] == pytest.approx([0.0025, 0.0025, 0.0025, 0.00125])
    assert any("schedule is advanced to step 12" in note for note in report.notes)
