"""Each pattern of `fp16doctor logs` on histories built here, row by row: where it must fire and the near misses
where it must stay quiet."""

from __future__ import annotations

import math

import pytest

from fp16doctor.history import classify
from fp16doctor.history.patterns.fp32_reference import BehindFp32
from fp16doctor.history.patterns.grad_norm_growth import GradNormGrowth
from fp16doctor.history.patterns.lr_peak import LrPeakTrouble
from fp16doctor.history.patterns.nonfinite_loss import NonfiniteLoss
from fp16doctor.history.patterns.pinned_stall import PinnedStall
from fp16doctor.history.patterns.recurring_overflow import RecurringOverflow
from fp16doctor.history.patterns.scale_collapse import ScaleCollapse
from fp16doctor.history.patterns.skip_streak import SkipStreak
from fp16doctor.history.records import SCALE_AT_MINIMUM, HistoryBuilder, HistoryRow, LogEvent

NAN = math.nan


def history(n, events=(), **columns):
    """A per-step history of ``n`` rows; each column a list (None: absent) or a function of the step."""
    builder = HistoryBuilder()
    for step in range(n):
        values = {k: (v(step) if callable(v) else v[step]) for k, v in columns.items()}
        builder.add(HistoryRow(step=step, **values))
    return builder.build([], list(events), [])


def gradscaler(n, overflow_at, growth_interval=2000, scale=2.0**16):
    """Loss scale and skips of PyTorch's GradScaler: halve on overflow, double after growth_interval clean steps."""
    scales, skips, clean = [], [], 0
    for step in range(n):
        scales.append(scale)
        bad = overflow_at(step, scale)
        skips.append(int(bad))
        if bad:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == growth_interval:
                scale, clean = scale * 2, 0
    return scales, skips


def test_a_scale_halving_to_the_floor_mid_run_is_a_collapse_and_no_scale_too_high():
    scales, skips = gradscaler(60, lambda step, scale: step >= 20)  # every step from 20 overflows at any scale
    found = ScaleCollapse().check(history(60, loss_scale=scales, skipped=skips, loss=lambda s: 1.0))
    assert len(found) == 1 and found[0].cause is None and found[0].certainty == "shown"
    assert found[0].first_step == 20 and found[0].evidence.lowest_scale <= 1.0


def test_a_scale_settling_from_far_too_high_is_scale_overflow():
    scales, skips = gradscaler(80, lambda step, scale: scale > 8.0)  # gradients allow a scale of 8 at most
    (found,) = ScaleCollapse().check(history(80, loss_scale=scales, skipped=skips, loss=lambda s: 1.0))
    assert found.cause == "scale-overflow" and found.evidence.settled and found.evidence.skipped_in_fall == 13


def test_a_default_scaler_settling_in_a_few_skips_is_no_collapse():
    scales, skips = gradscaler(80, lambda step, scale: scale > 2.0**12)  # 4 settling skips
    assert ScaleCollapse().check(history(80, loss_scale=scales, skipped=skips, loss=lambda s: 1.0)) == []


def test_the_frameworks_minimum_scale_message_alone_is_a_collapse():
    event = LogEvent(SCALE_AT_MINIMUM, 12, "Current loss scale already at minimum - cannot decrease scale anymore.")
    (found,) = ScaleCollapse().check(history(12, events=[event], skipped=[0] * 6 + [1] * 6))
    assert found.evidence.at_minimum_message.startswith("Current loss scale") and "nonfinite" in found.symptoms


def test_skips_right_after_each_growth_at_a_regular_interval_are_scale_growth():
    # the gradients allow 2^10; a growth_interval of 20 grows past it every 20 clean steps
    scales, skips = gradscaler(200, lambda step, scale: scale > 2.0**10, growth_interval=20)
    (found,) = RecurringOverflow().check(history(200, loss_scale=scales, skipped=skips, loss=lambda s: 1.0))
    assert found.cause == "scale-growth" and found.evidence.regular and found.evidence.median_gap == 21


def test_skips_once_per_default_growth_interval_are_healthy():
    scales, skips = gradscaler(5000, lambda step, scale: scale > 2.0**16, growth_interval=2000)
    assert sum(skips) == 2 and RecurringOverflow().check(history(5000, loss_scale=scales, skipped=skips)) == []


def test_a_third_of_the_steps_overflowing_irregularly_is_a_scale_too_high():
    irregular = {3, 4, 5, 7, 20, 21, 22, 23, 25, 26, 40, 41, 43, 44, 45, 58, 59}
    skips = [int(s in irregular) for s in range(60)]
    (found,) = RecurringOverflow().check(history(60, skipped=skips, loss=lambda s: 1.0))
    assert found.cause == "scale-overflow" and found.evidence.share >= 0.25 and not found.evidence.regular


def test_a_streak_of_skips_after_settling_is_found_and_a_short_one_is_not():
    streak = [int(30 <= s < 36) for s in range(80)]
    (found,) = SkipStreak().check(history(80, skipped=streak))
    assert found.evidence.longest == 6 and (found.first_step, found.last_step) == (30, 35)
    assert SkipStreak().check(history(80, skipped=[int(30 <= s < 34) for s in range(80)])) == []


def test_megatron_intervals_wholly_skipped_make_a_streak():
    builder = HistoryBuilder()
    for i, skipped in enumerate([0, 0, 10, 10, 0]):
        builder.add(HistoryRow(step=10 * (i + 1), steps=10, skipped=skipped, loss_scale=1.0))
    (found,) = SkipStreak().check(builder.build([], [], []))
    assert found.evidence.longest == 20 and found.evidence.counted_in_intervals


def test_a_loss_spike_right_after_an_lr_jump_is_the_schedule():
    lr = lambda s: 1e-4 if s < 30 else 1e-1  # noqa: E731
    loss = lambda s: 0.5 if s < 33 else 8.0  # noqa: E731
    (found,) = LrPeakTrouble().check(history(60, lr=lr, loss=loss))
    assert found.cause == "lr-schedule-peak" and found.evidence.event == "jump" and found.evidence.trouble_step == 33
    assert found.certainty == "likely"  # a 1000x jump


def test_a_nan_long_after_the_warmup_peak_is_not_the_schedule():
    lr = lambda s: 1e-3 * min(1.0, (s + 1) / 10)  # noqa: E731
    loss = lambda s: NAN if s >= 50 else 1.0  # noqa: E731
    assert LrPeakTrouble().check(history(60, lr=lr, loss=loss)) == []
    near = lambda s: NAN if s >= 12 else 1.0  # noqa: E731
    (found,) = LrPeakTrouble().check(history(60, lr=lr, loss=near))
    assert found.evidence.event == "peak" and found.evidence.event_step == 9 and found.certainty == "possible"


def test_a_rate_still_rising_at_the_last_logged_row_is_no_peak():
    """A warm-up cut short by the trouble: the last rate logged is the highest, but nothing shows it stopped there."""
    lr = lambda s: 1e-5 * (s + 1)  # noqa: E731
    loss = lambda s: NAN if s >= 19 else 1.0  # noqa: E731
    assert LrPeakTrouble().check(history(20, lr=lr, loss=loss)) == []


def test_a_gradient_norm_climbing_before_the_first_nan_is_growth():
    norm = lambda s: 1.0 * 1.1**s if s < 60 else NAN  # noqa: E731
    loss = lambda s: 1.0 if s < 60 else NAN  # noqa: E731
    (found,) = GradNormGrowth().check(history(70, grad_norm=norm, loss=loss))
    assert found.evidence.first_nonfinite_step == 60 and found.evidence.growth > 10
    flat = lambda s: 1.0 + 0.1 * (s % 3) if s < 60 else NAN  # noqa: E731
    assert GradNormGrowth().check(history(70, grad_norm=flat, loss=loss)) == []


def test_a_loss_that_never_falls_under_a_pinned_scale_stalls():
    (found,) = PinnedStall().check(history(100, loss=lambda s: 2.3 + 0.01 * (s % 2), loss_scale=lambda s: 0.5))
    assert found.cause == "grad-underflow" and found.certainty == "possible"
    (bf16,) = PinnedStall().check(history(100, loss=lambda s: 2.3, loss_scale=lambda s: 1.0))
    assert bf16.cause is None  # 1.0 is how a run without a scaler logs its scale
    learning = history(100, loss=lambda s: 2.3 * 0.99**s, loss_scale=lambda s: 0.5)
    assert PinnedStall().check(learning) == []


def test_a_loss_ending_above_the_fp32_run_is_drift_and_a_matching_one_is_not():
    fp32 = history(100, loss=lambda s: 2.0 * 0.97**s)
    stuck = history(100, loss=lambda s: max(2.0 * 0.97**s, 1.0))
    (found,) = BehindFp32().compare(stuck, fp32)
    assert found.symptoms == ["trajectory-drift"] and found.evidence.plateau
    close = history(100, loss=lambda s: 2.0 * 0.97**s * 1.01)
    assert BehindFp32().compare(close, fp32) == []


def test_a_nan_loss_alone_is_the_nonfinite_symptom_and_a_collapse_takes_it_over():
    (found,) = NonfiniteLoss().check(history(20, loss=lambda s: NAN if s == 12 else 1.0))
    assert found.symptoms == ["nonfinite"] and found.first_step == 12
    scales, skips = gradscaler(60, lambda step, scale: step >= 20)
    collapsed = history(60, loss_scale=scales, skipped=skips, loss=lambda s: NAN if s >= 20 else 1.0)
    assert [f.pattern for f in classify(collapsed)] == ["scale-collapse"]


@pytest.mark.parametrize("steps", [10, 3000])
def test_a_healthy_history_has_no_finding(steps):
    scales, skips = gradscaler(steps, lambda step, scale: step < 3)  # three settling skips
    healthy = history(
        steps,
        loss=lambda s: 2.0 * 0.999**s,
        loss_scale=scales,
        skipped=skips,
        grad_norm=lambda s: 1.0 + 0.01 * (s % 5),
        lr=lambda s: 1e-3 * min(1.0, (s + 1) / 100),
    )
    assert classify(healthy) == []


@pytest.mark.parametrize(
    ("kind", "name", "command"),
    [
        ("hf", "checkpoint-8", "fp16doctor diagnose YOUR_TRAINING_FILE.py --from-checkpoint"),
        ("fp16doctor", "step_8.pt", "fp16doctor diagnose YOUR_TRAINING_FILE.py --from-checkpoint"),
        ("deepspeed", "global_step8", "fp16doctor watch"),  # a layout diagnose does not read: the watch, from it
    ],
)
def test_the_next_command_starts_the_diagnosis_from_a_checkpoint_it_can_read(tmp_path, kind, name, command):
    import dataclasses

    from fp16doctor.history.records import Checkpoint
    from fp16doctor.history.report import next_step

    run = dataclasses.replace(
        history(20, loss=lambda s: NAN if s == 12 else 1.0), checkpoints=[Checkpoint(tmp_path / name, 8, kind)]
    )
    (found,) = NonfiniteLoss().check(run)
    told = next_step(found, run)
    assert told.next_command.startswith(command) and str(tmp_path / name) in told.next_command + told.next_reason


def _interval_rows(every: int, last: int, bad_from: int, bad_per_row: int, counted: bool = True):
    """Rows every ``every`` steps, ``bad_per_row`` of each non-finite from ``bad_from``: counted (Megatron-LM's NaN
    iterations), or only a NaN mean loss."""
    builder = HistoryBuilder()
    for step in range(every, last + 1, every):
        bad = bad_per_row if step >= bad_from else 0
        loss = math.nan if bad else 2.0
        count = bad if counted else None
        builder.add(HistoryRow(step=step, steps=every, loss=loss, loss_scale=1.0, skipped=bad, nonfinite=count))
    return builder.build([], [], [])


def test_a_run_that_stays_non_finite_is_one_finding_from_the_first_step_its_counts_place():
    """Megatron-LM in bf16 counts its NaN iterations (all 10 of each interval from step 241 on) and skips them: the
    steps the counts place, 241 on; the skips are those same steps, not a streak or a recurrence of their own."""
    (finding,) = classify(_interval_rows(10, 300, 250, 10))
    assert finding.pattern == "nonfinite-loss" and finding.first_step == 241
    assert finding.title.startswith("The loss is non-finite at 60 steps, from step 241 to 300")


def test_a_run_with_nans_far_apart_keeps_the_overflows_between_them():
    """NaN losses logged at steps 10 and 900, and skips every 20 steps between them at finite losses: the NaNs do
    not explain those skips, which are findings of their own."""
    overflows = lambda s, scale: 100 <= s <= 800 and s % 20 == 0  # noqa: E731
    scales, skips = gradscaler(1000, overflows, growth_interval=19)  # the scale climbs back between them
    clean = history(1000, loss=lambda s: 1.0, skipped=skips, loss_scale=scales)
    assert "recurring-overflow" in {f.pattern for f in classify(clean)}
    loss = lambda s: NAN if s in (10, 900) else 1.0  # noqa: E731
    patterns = {f.pattern for f in classify(history(1000, loss=loss, skipped=skips, loss_scale=scales))}
    assert {"nonfinite-loss", "recurring-overflow"} <= patterns, patterns


def test_a_count_of_nan_iterations_names_its_intervals_last_steps():
    (finding,) = NonfiniteLoss().check(_interval_rows(10, 100, 100, 3))
    assert finding.title.startswith("The loss is non-finite at 3 steps, from step 98 to 100")


def test_a_non_finite_mean_over_several_steps_names_rows_not_steps():
    """Hugging Face logs the mean loss of logging_steps steps: a NaN row says some step in it was, not which."""
    (finding,) = NonfiniteLoss().check(_interval_rows(2, 40, 30, 1, counted=False))
    assert "in 6 logged row(s), from the row ending at step 30 to the one ending at step 40" in finding.title
