"""The readers of `fp16doctor logs`, each on a file in its format: the text logs built from each framework's own
message strings (quoted with where they come from), W&B's history as its sender writes it, fp16doctor's own files,
TensorBoard event files written by PyTorch's SummaryWriter."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from fp16doctor.errors import HistoryError
from fp16doctor.history import classify, read_history
from fp16doctor.history.formats import all_readers
from fp16doctor.history.formats.doctor_run import DOCTOR_COLUMNS

DS_PREFIX = "[2025-02-21 12:00:00,000] [INFO] [loss_scaler.py:183:update_scale] "
"""DeepSpeed's logger format (deepspeed/utils/logging.py): "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:
%(funcName)s] %(message)s"."""


def deepspeed_overflow(attempted: int, reduced: int) -> str:
    # deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale:
    #   overflow_msg = f"[deepspeed] OVERFLOW! Rank {dist.get_rank()} Skipping step."
    #   overflow_msg += f" Attempted loss scale: {int(self.cur_scale)}, reducing to {int(next_scale)}"
    return (
        DS_PREFIX
        + f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {attempted}, reducing to {reduced}"
    )


def deepspeed_progress(step: int, skipped: int, lr: float) -> str:
    # deepspeed/runtime/engine.py, _report_progress: log_dist(f"step={step}, skipped={self.skipped_steps}, lr={lr},
    # mom={mom}", ranks=[0]); log_dist prefixes "[Rank {}] "
    return f"[2025-02-21 12:00:00,000] [INFO] [logging.py:128:log_dist] [Rank 0] step={step}, skipped={skipped}, lr=[{lr}], mom=[(0.9, 0.999)]"


AT_MINIMUM = "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def deepspeed_collapse() -> list[str]:
    """Progress every 100 steps; every step from 196 on overflows, 2^16 down to 1, and the run exits."""
    lines, skipped = [], 0
    for step in range(1, 212):
        if step >= 196:
            lines.append(deepspeed_overflow(2**16 >> skipped, 2**15 >> skipped))
            skipped += 1
        if step % 100 == 0:
            lines.append(deepspeed_progress(step, skipped, 1e-4))
    return [*lines, AT_MINIMUM]


def test_a_deepspeed_run_collapsing_to_its_minimum_scale(tmp_path):
    lines = [deepspeed_overflow(2**16 >> i, 2**15 >> i) for i in range(3)]  # settling: 3 skips
    lines += [deepspeed_progress(step, 3, 1e-4) for step in range(10, 210, 10)]
    lines += ["Epoch 1 | loss 2.31 | tokens/s 10322"]  # the user's own line: not DeepSpeed's
    lines += [deepspeed_overflow(2**13 >> i, 2**12 >> i) for i in range(13)]  # 2^13 down to 1
    # deepspeed/runtime/fp16/loss_scaler.py: raise Exception("Current loss scale already at minimum - cannot
    # decrease scale anymore. Exiting run.")
    lines += ["Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."]
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    history = read_history([log])
    assert history.sources[0].format == "deepspeed" and history.carried() == ["loss_scale", "skipped", "lr"]
    assert int(history.skipped().sum()) == 16 and history.last_step() == 213
    (finding,) = classify(history)
    assert finding.pattern == "scale-collapse" and finding.cause is None
    assert finding.first_step == 201 and finding.evidence.at_minimum_message.startswith("Exception: Current loss")


def test_a_deepspeed_fall_that_starts_between_progress_lines_is_measured_from_where_it_began(tmp_path):
    """Progress every 100 steps, every step from 196 on overflowing, from 2^16 down to 1, the run ending at the
    minimum: the first overflow's attempted scale is the scale the run had at step 100 (DeepSpeed prints no other),
    so the fall is 16 halvings over 16 skips (steps 196..211), and one finding says it all."""
    log = tmp_path / "train.log"
    log.write_text("\n".join(deepspeed_collapse()) + "\n")
    (finding,) = classify(read_history([log]))
    assert finding.pattern == "scale-collapse" and finding.evidence.highest_scale == 2**16
    assert finding.evidence.skipped_in_fall == 16 and (finding.first_step, finding.steps[-1]) == (196, 211)


def test_only_checkpoints_this_run_writes_beside_its_log_are_offered(tmp_path):
    """Beside a DeepSpeed log: its own global_stepN/ and those in checkpoints/, not another run's checkpoint-N/ in
    a sibling folder, nor a Lightning .ckpt (a run that writes DeepSpeed's log does not write it)."""
    log = tmp_path / "train.log"
    log.write_text("\n".join(deepspeed_progress(step, 0, 1e-4) for step in range(10, 60, 10)) + "\n")
    for folder in ("global_step20", "checkpoints/global_step40", "other_run/checkpoint-30"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "epoch=0-step=10.ckpt").write_bytes(b"")
    found = [(c.path.relative_to(tmp_path).as_posix(), c.kind) for c in read_history([log]).checkpoints]
    assert found == [("global_step20", "deepspeed"), ("checkpoints/global_step40", "deepspeed")]


def fairseq_inner(updates: int, scale: float, loss: float) -> str:
    # fairseq/logging/progress_bar.py, SimpleProgressBar.log: "{}:  {:5d} / {:d} {}".format(self.prefix, self.i + 1,
    # self.size, postfix), postfix = ", ".join(key + "=" + value); fairseq_cli/train.py's logging.basicConfig format
    # "%(asctime)s | %(levelname)s | %(name)s | %(message)s", logger renamed to the tag "train_inner"
    stats = f"loss={loss:.3f}, nll_loss={loss:.3f}, ppl=12.3, wps=10000, ups=3.1, wpb=4096, bsz=128, num_updates={updates}, lr=0.0005, gnorm=1.234, loss_scale={scale:g}, train_wall=30, gb_free=10.2, wall=300"
    return f"2024-01-01 12:00:00 | INFO | train_inner | epoch 001:  {updates:5d} / 10000 {stats}"


def fairseq_overflow(scale: float) -> str:
    # fairseq/trainer.py, Trainer.train_step: logger.info(f"NOTE: gradient overflow detected, ignoring gradient,
    # {str(e)}"), e = OverflowError("setting loss scale to: " + str(self.loss_scale)) (dynamic_loss_scaler.py)
    return f"2024-01-01 12:00:00 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {scale}"


def test_a_fairseq_run_whose_scale_overflows_at_every_growth(tmp_path):
    lines, updates = [], 0
    for cycle in range(12):  # the scale grows to 256, overflows, halves to 128, and 40 updates later again
        updates += 40
        lines.append(fairseq_inner(updates, 128.0, 5.0 - 0.1 * cycle))
        lines.append(fairseq_overflow(128.0))
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    history = read_history([log])
    assert history.sources[0].format == "fairseq" and history.step[1] == 80 + 1  # num_updates + overflows so far
    (finding,) = classify(history)
    assert finding.cause == "scale-growth" and finding.evidence.median_gap == 41


def test_fairseq_json_stats_are_read_and_the_minimum_scale_message_too(tmp_path):
    # fairseq/logging/progress_bar.py, JsonProgressBar.log: logger.info(json.dumps(stats)), values formatted by
    # format_stat ("{:g}" for numbers, "{:.3f}" for meters)
    stats = {
        "epoch": 1,
        "update": 0.01,
        "loss": "4.2",
        "num_updates": "100",
        "lr": "0.0005",
        "gnorm": "inf",
        "loss_scale": "0.0001",
    }
    lines = [f"2024-01-01 12:00:00 | INFO | train_inner | {json.dumps(stats)}"]
    # fairseq/optim/dynamic_loss_scaler.py: FloatingPointError("Minimum loss scale reached ({}). Your loss is
    # probably exploding. Try lowering the learning rate, using gradient clipping or increasing the batch size.")
    lines.append(
        "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try lowering the learning rate, using gradient clipping or increasing the batch size."
    )
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    history = read_history([log])
    (row,) = history.rows()
    assert row.step == 100 and row.loss == 4.2 and math.isinf(row.grad_norm) and row.loss_scale == 1e-4
    assert [e.kind for e in history.events] == ["scale-at-minimum"]


def megatron_line(iteration: int, loss: float | None, grad_norm: float, skipped: int = 0, nan: int = 0) -> str:
    # megatron/training/training.py, training_log, call for call (the loss only when avg >= 0.0: never NaN)
    line = f" [2026-01-01 12:00:00.000000] iteration {iteration:8d}/{500000:8d} |"
    line += " consumed samples: {:12d} |".format(iteration * 256)  # noqa: UP032 - Megatron's own call
    line += " elapsed time per iteration (ms): {:.1f} |".format(812.3)  # noqa: UP032 - Megatron's own call
    line += f" learning rate: {3e-4:.6E} |"
    line += f" global batch size: {256:5d} |"
    if loss is not None:
        line += " {}: {:.6E} |".format("lm loss", loss)  # noqa: UP032 - Megatron's own call
    line += f" loss scale: {4096.0:.1f} |"
    line += f" grad norm: {grad_norm:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(skipped)  # noqa: UP032 - Megatron's own call
    line += " number of nan iterations: {:3d} |".format(nan)  # noqa: UP032 - Megatron's own call
    return line


def test_a_megatron_run_whose_gradient_norm_climbs_before_nan_iterations(tmp_path):
    lines = [megatron_line(i, 3.0 - (i - 5000) / 200, 1.2 ** ((i - 5000) / 10)) for i in range(5010, 5310, 10)]
    lines.append(megatron_line(5310, None, float("nan"), skipped=10, nan=10))
    log = tmp_path / "megatron.log"
    log.write_text("\n".join(lines) + "\n")
    history = read_history([log])
    rows = list(history.rows())
    assert history.sources[0].format == "megatron" and rows[0].steps == 10 and rows[-1].loss is None
    assert rows[-1].nonfinite == 10 and history.first_step() == 5010
    (finding,) = classify(history)  # the NaN iterations and their skips are the climb's end
    assert finding.pattern == "grad-norm-growth" and finding.evidence.first_nonfinite_step == 5310


def test_wandb_history_reads_the_trainers_step(tmp_path):
    # what transformers' WandbCallback logs (train/ prefix), with the keys W&B's history adds
    lines = [
        {
            "train/loss": 2.0 - 0.01 * s,
            "train/grad_norm": 1.0,
            "train/learning_rate": 1e-4,
            "train/epoch": s / 100,
            "train/global_step": 10 * s,
            "_step": s,
            "_runtime": 1.0 * s,
            "_timestamp": 1.7e9 + s,
        }
        for s in range(1, 30)
    ]
    path = tmp_path / "wandb-history.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    history = read_history([tmp_path])
    assert history.sources[0].format == "wandb-history" and history.step[0] == 10 and history.span[1] == 10
    assert history.carried() == ["loss", "grad_norm", "lr"] and classify(history) == []


def test_fp16doctor_trains_metrics_csv_is_read_without_micro_steps(tmp_path):
    from fp16doctor.run.train import METRIC_COLUMNS

    assert DOCTOR_COLUMNS == METRIC_COLUMNS
    path = tmp_path / "metrics.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        for step in range(20):
            micro = step % 2 == 0
            writer.writerow(
                {
                    "step": step,
                    "loss": 1.0,
                    "grad_norm": 0.5,
                    "lr": 1e-3,
                    "loss_scale": 65536.0,
                    "skipped": False,
                    "nonfinite": False,
                    "seconds": 0.01,
                    "micro_step": micro,
                }
            )
    history = read_history([path])
    assert history.sources[0].format == "fp16doctor-train" and len(history) == 10
    assert history.carried() == ["loss", "loss_scale", "skipped", "grad_norm", "lr"]


def test_tensorboard_events_written_by_summarywriter(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "runs"))
    for step in range(1, 61):  # transformers' TensorBoardCallback tags
        writer.add_scalar("train/learning_rate", 1e-4 if step <= 30 else 5e-2, step)
        writer.add_scalar("train/loss", 0.7 if step < 33 else 9.0, step)
        writer.add_scalar("train/grad_norm", 1.0, step)
    writer.close()
    history = read_history([tmp_path / "runs"])
    assert history.sources[0].format == "tensorboard" and len(history) == 60
    (finding,) = classify(history)
    assert finding.cause == "lr-schedule-peak" and finding.evidence.event_step == 31


def test_tensorboard_without_its_package_is_one_message_naming_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "events.out.tfevents.1700000000.host.1.0"
    path.write_bytes(b"\x18\x00\x00\x00\x00\x00\x00\x00not an event")
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_file_loader", None)
    with pytest.raises(HistoryError) as raised:
        read_history([path])
    assert "fp16doctor[tensorboard]" in raised.value.hint


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.log", "", "is empty"),
        ("trainer_state.json", '{"log_history": [', "not valid JSON"),
        ("notes.txt", "a line\nanother line\n", "no line in a format"),
        ("wandb-history.jsonl", '{"train/loss": 1.0, "_step": 1}\n{"train/lo', "not valid JSON"),
        ("metrics.csv", "step,epoch\n1,0\n", "logs none of the quantities"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(HistoryError) as raised:
        read_history([path])
    assert message in raised.value.message


def test_every_reader_declares_what_it_carries_and_where_its_format_comes_from():
    from fp16doctor.history.records import QUANTITIES

    for reader in all_readers():
        assert set(reader.carries) == set(QUANTITIES), reader
        assert reader.source and reader.title and reader.steps and reader.__doc__


def test_a_csv_without_a_step_column_is_named_so_alone_or_in_a_folder(tmp_path):
    from fp16doctor.errors import HistoryError

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,train_loss\n0,2.3\n1,2.1\n")
    with pytest.raises(HistoryError, match=r"is a CSV without a `step` column \(columns: epoch, train_loss\)"):
        read_history([run / "metrics.csv"])
    with pytest.raises(HistoryError, match=r"its CSV files have no `step` column: metrics.csv"):
        read_history([run])
    (run / "loss.csv").write_text("Wall time,Step,Value\n1.7e9,1,0.5\n")  # TensorBoard's "Download CSV"
    with pytest.raises(HistoryError, match="without a `step` column") as raised:
        read_history([run / "loss.csv"])
    assert "event files" in raised.value.hint


def test_two_logs_that_disagree_at_the_same_steps_are_said_to_be_of_different_runs(tmp_path):
    def log(name: str, first_overflow: int) -> Path:
        lines, skipped = [], 0
        for step in range(1, 41):
            if step >= first_overflow:
                lines.append(deepspeed_overflow(2**16 >> skipped, 2**15 >> skipped))
                skipped += 1
            if step % 10 == 0:
                lines.append(deepspeed_progress(step, skipped, 1e-4))
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        return path

    a, b = log("a.log", 15), log("b.log", 25)
    history = read_history([a, b])
    assert any("disagree on the loss or the loss scale" in note for note in history.notes)
    resumed = read_history([a, log("a_again.log", 15)])  # the same run's rows twice: no disagreement
    assert not any("disagree" in note for note in resumed.notes)
