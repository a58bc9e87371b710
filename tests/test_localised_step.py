"""Which step the localisation traces (``diagnosis.stages.context.telling_skip``): the skip that tells a fault
from the GradScaler's calibration, on records built by hand."""

from __future__ import annotations

from fp16doctor.diagnosis import rule_cases as fx
from fp16doctor.diagnosis.stages.context import bad_step, telling_skip


def test_calibration_skips_only_give_the_first():
    records = fx.records(skipped=[0, 1, 2])
    assert telling_skip(records, 0) == 0


def test_a_skip_after_an_applied_step_is_the_fault():
    records = fx.records(skipped=[0, 1, 6, 7])
    assert telling_skip(records, 0) == 6


def test_nothing_applied_gives_the_last_step_at_the_lowest_scale_or_the_first_where_asked():
    records = fx.records(steps=8, skipped=range(8))
    assert telling_skip(records, 0) == 7
    assert telling_skip(records, 0, unsettled="first") == 0
    assert bad_step(fx.probe(record=records), unsettled="first") == 0  # the LR-peak stage's question


def test_under_accumulation_the_micro_batch_that_made_the_inf_is_traced():
    """Rows 0-1 and 3-4 are micro-batches; 2 and 5 the optimizer steps. Step 5 is skipped after 2 was applied;
    the inf was made in micro-batch 4, not in the optimizer row itself."""
    records = fx.records(steps=6, skipped=[5], nonfinite_grads=[4])
    records["micro_step"] = [True, True, False, True, True, False]
    assert telling_skip(records, 4) == 4
    records.loc[4, "nonfinite_grads"] = False
    records.loc[3, "nonfinite_grads"] = True
    assert telling_skip(records, 3) == 3
