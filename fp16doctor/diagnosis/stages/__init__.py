"""The triage stages, one module each. Each measures, fills :class:`Evidence`, and reports what it found.

The order is the expert's: data, FP32 baseline, AMP as configured,
localisation of the first bad step, the loss-scale sweep, the pause at the LR
schedule's peak, the precision-gap search, the bf16 check, and where the training compiles, its compiled AMP
probe beside the eager one, and with ``--nproc`` the training parallelised under torchrun. A stage that cannot
add anything is skipped with the reason; the FP32 and AMP probes always run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..findings import StageName, StageReport
from .amp import stage_amp
from .bf16 import stage_bf16
from .compiled import stage_compiled
from .context import StageContext, measured_symptoms, run_mode, same_state_gap
from .data import stage_data
from .fp32 import stage_fp32
from .localisation import stage_localise
from .loss_scale import stage_scale
from .lr_peak import stage_lr_peak
from .parallel import stage_parallel
from .precision_gap import stage_precision_gap


@dataclass(frozen=True)
class Stage:
    """One step of the triage: its name (as the report shows it) and what runs it."""

    name: StageName
    run: Callable[[StageContext], StageReport]


STAGES: list[Stage] = [
    Stage(StageName.DATA, stage_data),
    Stage(StageName.FP32, stage_fp32),
    Stage(StageName.AMP, stage_amp),
    Stage(StageName.LOCALISATION, stage_localise),
    Stage(StageName.LOSS_SCALE, stage_scale),
    Stage(StageName.LR_PEAK, stage_lr_peak),
    Stage(StageName.PRECISION_GAP, stage_precision_gap),
    Stage(StageName.BF16, stage_bf16),
    Stage(StageName.COMPILED, stage_compiled),
    Stage(StageName.PARALLEL, stage_parallel),
]

__all__ = ["STAGES", "Stage", "StageContext", "measured_symptoms", "run_mode", "same_state_gap"]
