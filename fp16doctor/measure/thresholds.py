"""Every number a verdict or a rule depends on, in one place, each with where it comes from.

"notes" marks the practitioners' triage knowledge this product encodes, quoted as
it is usually stated (rules of thumb of mixed-precision training); "PyTorch" is PyTorch's own documentation or source; "measured" names
the measurement that set it. Rules, stages and symptoms import from here and
nowhere else, so a threshold is changed once and stays consistent.
"""

from __future__ import annotations

# --- comparing AMP with FP32 (notes, "Rules of thumb in use") ------------------------------------
GAP_TOLERANCE = 1e-3
"""Same-state loss deviation under 0.1% is healthy (notes: "under 0.1% difference is healthy")."""
GAP_ERROR = 1e-2
"""Over 1% needs a look (notes: "over 1% needs a look"): the ``same-state-gap`` symptom, the precision-gap error."""
BF16_FACTOR = 8.0
"""bf16 keeps 7 mantissa bits against fp16's 10 (notes, "Formats"): about 8x the rounding error, 8x the tolerances."""
LOSS_FLOOR_SHARE = 0.1
"""Loss deviations are relative to at least 10% of the initial FP32 loss (measured: a loss driven to ~0 turns
fp16's absolute rounding noise into deviations of several hundred percent on healthy samples)."""
SITE_SHARE = 0.05
"""A line of the user's code is tried in fp32 when its operators make at least 5% of a same-state gap (the
operator-level attribution): a line below it cannot close a gap past tolerance alone (and the search tries a few)."""
DRIFT_ERROR = 0.1
"""The loss curves ending 10% apart: the ``trajectory-drift`` symptom (measured: two settling skips in a 40-step
probe whose loss falls tenfold put the curves 7% apart, sample_models/scale_grows_fast.py corrected)."""

# --- the loss scale (notes, "How AMP is meant to work" and "Rules of thumb") -----------------------
UNDERFLOW_ALARM = 0.05
"""An underflow rate over 5% calls for a higher scale (notes); applied to a tensor's gradient mass."""
KEEP_MASS = 0.999
"""A loss scale must keep 99.9% of each tensor's gradient mass above fp16's smallest subnormal."""
NEGLIGIBLE_RMS = 1e-4
"""A gradient whose RMS is under 1e-4 of its kind's median is rounding noise of an exact zero (measured: the
key bias of a tiny BERT, zero by softmax's shift invariance, sits 1e-5 below the median)."""
from ..config import CALIBRATION_SKIPS as CALIBRATION_SKIPS  # noqa: E402  (defined with the scaler's settings: the live watch reads it too)

RECURRING_SKIPS = 3
RECURRING_SHARE = 0.1
"""After settling, 3 or more skips making up 10% of the attempted steps: the scale keeps overflowing (a default
scaler grows once per 2000 clean steps, so it skips about once per 2000: PyTorch's GradScaler defaults)."""
PERSISTENT_OVERFLOW_SHARE = 0.25
"""scale-overflow: a quarter of the steps after settling still overflowing is past any settling."""
SCALE_GROWTH_RECURRENCES = 2
"""scale-growth: skips recurring at least twice after growth (notes: "Bursts of NaN that recover")."""

# --- updates ---------------------------------------------------------------------------------------
LOST_UPDATE_EXCESS = 0.25
"""A quarter more of the updates lost than in FP32: the weights' storage precision eats the training (notes,
"Lost updates")."""
HALF_WEIGHTS_LOST_SHARE = 0.05
"""half-weights: bf16 weights are an error once 5% of their updates are lost."""

# --- the schedule ----------------------------------------------------------------------------------
SKIP_DRIFT_RUN_SHARE = 0.05
SKIP_DRIFT_WARMUP_SHARE = 0.25
"""scheduler-skip-drift is an error when skipped steps are 5% of the run and 25% of the warm-up."""
LR_TRAJECTORY_GROWTH = 10.0
"""A gradient norm or loss that grows step after step to ten times its value before the growth, up to the first
non-finite step, ties that trouble to the LR schedule's peak or jump it grew from (notes, triage step 6: "Check the
LR schedule: warm-up ending, a restart, or a jump at the peak"; measured: SGD 300x past its warm-up grows its
gradient norm 1e3x to 1e7x before FP32 goes non-finite, healthy probes' norms stay within 3x of their start)."""

# --- data ------------------------------------------------------------------------------------------
EXTREME_INPUT = 1e3
"""|x| from which a raw input is extreme for fp16 (notes: "magnitudes in the thousands and up")."""
EXTREME_ROWS_SHARE = 0.05
"""A field whose extreme values are at most 5% of its values holds them in a few rows (an outlier, a sentinel for a
missing value): the search first tries the data without those rows, then standardised (measured: one sentinel
row in a batch of 32 with 12 features is 0.3% of the values; raw sensor features are extreme throughout)."""
IGNORE_INDEX = -100
"""PyTorch's default ``ignore_index`` of cross_entropy/nll_loss (and Hugging Face's label padding)."""
CONSTANT_MAGNITUDE = 1e8
"""Values this large in a cast's input are constants (masks, ``finfo`` limits), not activations."""
CONSTANT_SPREAD = 4
"""An input whose values beyond fp16's range take at most this many distinct values holds a constant (a mask's
fill, or two masks' fills added: -1e9 and -2e9; values are told apart at about three significant digits, so -1e9
plus scores of a few hundred is one); more, and it is an activation that grew (``exp(20)`` = 4.9e8 is
large enough to look like a constant by its size alone: a user trial's hand-written softmax)."""

# --- a run's history (fp16doctor logs) -------------------------------------------------------------
COLLAPSE_HALVINGS = 8
"""A loss scale 2^8 = 256x below its highest is collapsing (notes, "What failed runs leave behind": "a halving run
to the minimum hours in means every step overflows at any scale"; eight halvings are eight skips in a row, past the
watch's default streak of 5)."""
COLLAPSED_SCALE = 1.0
"""A scale at or below 1 has collapsed: gradients overflow even unscaled (DeepSpeed's default ``min_loss_scale``
is 1; the watch's ``min_scale``)."""
SKIP_STREAK = 5
"""Skipped steps in a row past the scale's settling that make a streak (the watch's default ``--skip-streak``)."""
LOG_SPIKE_FACTOR = 3.0
"""A logged loss 3x the median of the rows before it is a spike (measured: the tests' healthy Trainer and
Lightning runs stay under 1.5x; a logged row is often an interval's mean, which a single bad step moves less)."""
LOSS_JUMP = 10.0
"""A watched run's loss at least 10x the median of the steps before it, right after an applied update, and as high
on the steps after (the watch's own ``spike_factor``): the update broke the model (a capsule's ``loss-jump``)."""
SPIKE_BASELINE_ROWS = 20
"""The rows before an event whose median loss a spike is compared with (the watch's ``spike_window``)."""
LR_EVENT_STEPS = 10
"""Trouble within 10 optimizer steps (or 3 logged rows, whichever is longer) after the LR's peak or jump is at
it (notes: "the loss spiking three steps after warm-up ends")."""
LR_JUMP_RATIO = 2.0
"""An LR at least twice the logged one before it, to at least half the run's highest, is a jump (a linear
warm-up's own steps exceed 2x only in its first two steps, far below its peak)."""
SCALE_GROWTH_SHARE = 0.01
"""Skips recurring at a regular interval are the scaler's growth overshooting once they cost 1% of the steps (a
growth_interval of about 100; PyTorch's default of 2000 costs 0.05%, DeepSpeed's loss_scale_window of 1000 0.1%)."""
GRAD_GROWTH_FACTOR = 10.0
"""A gradient norm whose last third before the first non-finite step has a median 10x its first third's is
growing (notes: "the gradient norm climbing for 200 steps before the first NaN")."""
GRAD_GROWTH_ROWS = 6
"""The finite gradient norms before the first non-finite step that a growth needs (two per third)."""
STALL_FALL = 0.05
"""A loss whose last tenth of the rows sits within 5% of where it started (its first hundredth) has not learned."""
STALL_ROWS = 10
"""The rows a stall needs (and the steps: ``STALL_STEPS``) before the doctor calls the loss stalled."""
STALL_STEPS = 50
"""The optimizer steps a stall needs to span."""

BF16_SUMMED_TERMS = 4
"""bf16-accumulation: a sum of n bf16-rounded terms is off by up to (n - 1) x 2^-8 of its magnitude (bf16's unit
roundoff, half its spacing 2^-7 above 1.0: notes, "Formats"); from 4 terms on that bound passes the 1e-2 a reduction
must stay within (``REDUCTION_ERROR_WORTH_SAYING``: fp16's own rounding is 5e-4)."""
