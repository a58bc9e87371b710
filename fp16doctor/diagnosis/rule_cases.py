"""Evidence built by hand: the small cases each rule carries (``fires_on`` / ``quiet_on``).

Built from the evidence types alone (records, never the probe, its instruments or the stages):
importing a rule with its cases loads no engine (``tests/test_layers.py`` checks it in a fresh process).

A rule is tested without a diagnosis: its cases build just the measurements it
reads (a probe record, a precision map, a localisation, a data field) and
everything else stays at a healthy default: a finite FP32 and AMP run of ten
steps whose loss falls smoothly, fp32 parameters, nothing localised.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pandas as pd

from ..config import build_config
from ..engine.records import RECORD_COLUMNS, Column, Inventory
from ..measure.datascan import FieldScan
from ..measure.records import (
    FlushedConstant,
    GradientColumn,
    Localisation,
    OperatorAttribution,
    ScaleWindow,
    SiteShare,
)
from ..measure.symptoms import Symptom
from .findings import (
    BackendTrial,
    CompiledComparison,
    CompiledOutcome,
    CompilerBisection,
    Evidence,
    GapSearch,
    GraphTraceReport,
    LrPause,
    LrPeak,
    LrSchedule,
    ParallelComparison,
    ProbeSummary,
    Repair,
    RepairKind,
)

PRECISION_COLUMNS = [
    Inventory.MODULE,
    Inventory.TYPE,
    Inventory.COMPUTE_DTYPE,
    Inventory.PARAM_DTYPES,
    Inventory.BUFFER_DTYPES,
    Inventory.OPTIMIZER_STATE_DTYPES,
    Inventory.TRAINED_PARAM_DTYPES,
    Inventory.FROZEN,
    Inventory.LIBRARY,
]


def records(
    steps: int = 10,
    skipped: Iterable[int] = (),
    nonfinite_loss: Iterable[int] = (),
    nonfinite_grads: Iterable[int] = (),
    scales: list[float] | None = None,
    exception: dict[str, Any] | None = None,
    losses: list[float] | None = None,
) -> pd.DataFrame:
    """A probe record: a loss falling from 2.0 (else ``losses``), the given steps skipped or non-finite, an
    exception ending it."""
    skipped, bad_loss, bad_grads = set(skipped), set(nonfinite_loss), set(nonfinite_grads)
    exc = exception or {}
    rows = []
    for i in range(steps):
        raised = exception is not None and i == exc[Column.STEP]
        rows.append(
            {
                "step": i,
                "batch_index": i,
                "loss": math.nan if i in bad_loss or raised else (losses[i] if losses else 2.0 - 0.05 * i),
                "grad_norm": math.inf if i in bad_grads or i in skipped else 1.0,
                "lr": 1e-3,
                "loss_scale": scales[i] if scales else 65536.0,
                "skipped": i in skipped or raised,
                "optimizer_stepped": i not in skipped and not raised,
                "micro_step": False,
                "nonfinite_loss": i in bad_loss or raised,
                "nonfinite_grads": i in bad_grads or i in skipped or raised,
                "exception_type": exc["type"] if raised else None,
                "exception": exc["message"] if raised else None,
                "exception_location": exc.get("location", "train.py:1") if raised else None,
                "exception_module": exc.get("module") if raised else None,
            }
        )
        if raised:
            break
    return pd.DataFrame(rows, columns=RECORD_COLUMNS)


LIBRARY_TYPES = {
    "Linear",
    "Conv2d",
    "LayerNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "Embedding",
    "MultiheadAttention",
    "ReLU",
    "GELU",
    "Dropout",
    "Sequential",
    "ModuleList",
}
"""torch.nn classes the fixtures use: their precision rows say ``library`` as the instruments' would."""


def precision(*rows: tuple[Any, ...]) -> pd.DataFrame:
    """(module, type, param dtypes, buffer dtypes, optimizer-state dtypes[, frozen]) per module; a module's
    parameters are trained unless ``frozen`` is true."""
    table = rows or (("0", "Linear", "float32", None, "float32"),)
    return pd.DataFrame(
        [
            {
                Inventory.MODULE: m,
                Inventory.TYPE: t,
                Inventory.COMPUTE_DTYPE: None,
                Inventory.PARAM_DTYPES: p,
                Inventory.BUFFER_DTYPES: b,
                Inventory.OPTIMIZER_STATE_DTYPES: o,
                Inventory.TRAINED_PARAM_DTYPES: None if frozen else p,
                Inventory.FROZEN: bool(frozen and p),
                Inventory.LIBRARY: t in LIBRARY_TYPES,
            }
            for m, t, p, b, o, *rest in table
            for frozen in [rest[0] if rest else False]
        ],
        columns=PRECISION_COLUMNS,
    )


def probe(mode: str = "amp", record: pd.DataFrame | None = None, **fields: Any) -> ProbeSummary:
    """A probe summary; ``fields`` set any other :class:`ProbeSummary` field."""
    values: dict[str, Any] = {
        "tables": {},
        "precision": precision(),
        "clip_calls": [],
        "loss_dtypes": ["float32"],
        "first_nonfinite_forward": None,
        "scaler_enabled": mode == "amp",
    }
    values.update(fields)
    return ProbeSummary(mode=mode, records=record if record is not None else records(), **values)


def evidence(
    amp: ProbeSummary | None = None,
    fp32: ProbeSummary | None = None,
    config: dict[str, Any] | None = None,
    **fields: Any,
) -> Evidence:
    """Evidence of a healthy ten-step diagnosis, with ``amp``/``fp32``/``fields`` replacing what a case measures."""
    amp = amp or probe("amp")
    ev = Evidence(
        config=build_config(config or {}),
        device="cpu",
        steps=len(amp.records),
        has_scheduler=fields.pop("has_scheduler", False),
        has_train_step=fields.pop("has_train_step", False),
        fp32=fp32 or probe("fp32"),
        amp=amp,
    )
    for name, value in fields.items():
        setattr(ev, name, value)
    return ev


def compiled_comparison(
    outcome: CompiledOutcome = CompiledOutcome.COMPILED_ONLY,
    backends: list[BackendTrial] | None = None,
    bisection: CompilerBisection | None = None,
    compiled_with: str = "inductor",
    graph_trace: GraphTraceReport | None = None,
) -> CompiledComparison:
    """A compiled-stage comparison: eager healthy, the compiled probe non-finite (unless ``outcome`` says else),
    the model compiled with the backend ``compiled_with``."""
    nonfinite = Symptom("nonfinite", "AMP's loss is non-finite from step 0", step=0)
    return CompiledComparison(
        compiled_with={"backend": compiled_with, "mode": None, "dynamic": None, "fullgraph": False, "options": {}},
        outcome=outcome,
        eager_symptoms=[nonfinite] if outcome == CompiledOutcome.EAGER_ONLY else [],
        compiled_symptoms=[nonfinite] if outcome == CompiledOutcome.COMPILED_ONLY else [],
        compiled=probe("amp", record=records(skipped=range(10), nonfinite_loss=range(10))),
        probe_seconds=5.0,
        compile_seconds=4.0,
        backends=backends or [],
        bisection=bisection,
        graph_trace=graph_trace,
    )


def localisation(
    phase: str = "forward",
    module: str | None = "layer",
    operator: str = "aten::mm",
    input_ranges: list[tuple[float, float]] | None = None,
    output: str = "+inf (float16)",
    step: int = 0,
    scalars: list[float] | None = None,
    input_spreads: list[int] | None = None,
    input_constants: list[bool | None] | None = None,
    parameter: str | None = None,
    peak: float | None = None,
    loss_scale: float | None = None,
    flushed_constant: FlushedConstant | None = None,
) -> Localisation:
    return Localisation(
        step=step,
        batch_index=step,
        phase=phase,
        module=module,
        operator=operator,
        peak=peak,
        loss_scale=loss_scale,
        input_ranges=input_ranges or [(-300.0, 300.0)],
        output=output,
        scalars=scalars or [],
        input_spreads=input_spreads or [],
        input_constants=input_constants or [],
        parameter=parameter,
        flushed_constant=flushed_constant,
    )


def unheld(
    value: float = 1e-10, operator: str = "aten::clamp", input: int = 0, location: str | None = "train.py:36"
) -> FlushedConstant:
    """A Python number fp16 cannot hold (0 there), given to ``operator``, which made the culprit's input ``input``."""
    return FlushedConstant(value, 0.0, "float16", operator, input, location)


def repair(
    kind: str,
    modules: list[str] | None = None,
    config_patch: dict[str, Any] | None = None,
    forward_overflow: bool = False,
    symptoms: tuple[str, ...] = ("nonfinite",),
    **fields: Any,
) -> Repair:
    """An intervention the search found to repair the training, as the rules read it to name the cause."""
    return Repair(
        kind=RepairKind(kind),
        description=f"the {kind} intervention",
        config_patch=config_patch or {},
        modules=modules or [],
        symptoms=list(symptoms),
        forward_overflow=forward_overflow,
        **fields,
    )


def field(name: str = "0", floating: bool = True, **values: Any) -> FieldScan:
    """One data field's scan (ten batches of 100 values unless ``values`` say otherwise)."""
    scan = FieldScan(name, "float32" if floating else "int64", floating, numel=1000)
    for key, value in values.items():
        setattr(scan, key, value)
    return scan


def window(low: float, high: float) -> ScaleWindow:
    return ScaleWindow(pd.DataFrame(), low, high)


def underflow(*rows: tuple[str, float, float, bool]) -> pd.DataFrame:
    """(tensor name, element share, mass share, negligible) per parameter gradient."""
    return pd.DataFrame(
        [
            {
                GradientColumn.KIND: "param",
                GradientColumn.NAME: n,
                GradientColumn.SCALE: 1.0,
                GradientColumn.OBSERVED_UNDERFLOW: e,
                GradientColumn.OBSERVED_UNDERFLOW_MASS: m,
                GradientColumn.RMS: 1e-6,
                GradientColumn.NEGLIGIBLE: neg,
            }
            for n, e, m, neg in rows
        ]
    )


def lr_peak(
    lrs: list[float],
    peak_step: int,
    jump_step: int | None = None,
    jump_ratio: float = 1.0,
    pause: LrPause | None = None,
) -> LrPeak:
    """The LR-peak stage's record: a schedule with its peak and jump, and the pause when one was taken."""
    return LrPeak(
        LrSchedule(
            lrs=lrs,
            peak_step=peak_step,
            peak_lr=lrs[peak_step],
            jump_step=peak_step if jump_step is None else jump_step,
            jump_ratio=jump_ratio,
        ),
        pause,
    )


def gap(value: float, tolerance: float = 1e-3, step: int = 0, **found: Any) -> GapSearch:
    """The precision-gap stage's record: a same-state deviation of ``value`` at ``step`` (the only state
    compared); ``found`` sets what the later parts of the stage found (the scale-leak check, the search)."""
    return GapSearch(same_state_rel_dev={step: value}, worst_step=step, gap=value, tolerance=tolerance, **found)


def site(
    line: str,
    share: float,
    module: str = "<root>",
    operators: tuple[str, ...] = ("mul", "add"),
    code: str | None = "y = h * std + mean",
    lower_precision: bool = False,
) -> SiteShare:
    """One line of the user's code with its operators' share of a same-state gap (the attribution's record)."""
    return SiteShare(
        site=line,
        module=module,
        operators=list(operators),
        share=share,
        own_share=share,
        inside=[],
        weighted_error=share,
        first_order=share / 4,
        code=code,
        lower_precision=lower_precision,
    )


def attribution(*sites: SiteShare, unmatched: int = 0) -> OperatorAttribution:
    """The operator-level attribution of a gap: the lines ranked by their share (given the largest first)."""
    return OperatorAttribution(
        loss_amp=2.0,
        loss_fp32=1.0,
        explained=sum(s.share for s in sites),
        operators=4 * len(sites),
        unmatched=unmatched,
        sites=list(sites),
    )


FSDP2_POLICY = {
    "param_dtype": "bfloat16",
    "reduce_dtype": "float32",
    "output_dtype": "float32",
    "cast_forward_inputs": True,
}
"""A healthy FSDP2 policy: bf16 compute, an fp32 reduction, fp32 outputs, the inputs cast (FSDP2's default)."""


def parallel(
    policy: dict[str, Any] | None = None,
    scaler_enabled: bool = True,
    micro_steps: int = 1,
    world: int = 2,
    hooks: list[str] | None = None,
    loss_dtypes: list[str] | None = None,
) -> ParallelComparison:
    """A healthy parallel stage under FSDP2 (``FSDP2_POLICY`` with ``policy``'s entries on top): its fp32-close
    reduction, the ranks agreeing, ``micro_steps`` backward passes per optimizer step; ``loss_dtypes``: what the
    loss came out in (by default the outputs' dtype under the policy: a loss that does not cast them)."""
    rows = []
    for i in range(10 * micro_steps):
        micro = (i + 1) % micro_steps != 0
        rows.append({Column.MICRO_STEP: micro, Column.OPTIMIZER_STEPPED: not micro})
    as_run = records(steps=10 * micro_steps)
    as_run[Column.MICRO_STEP] = [r[Column.MICRO_STEP] for r in rows]
    as_run[Column.OPTIMIZER_STEPPED] = [r[Column.OPTIMIZER_STEPPED] for r in rows]
    table = pd.DataFrame(
        [("0.weight", "0", 256, 1e-7, 0, 0.5, None)],
        columns=["name", "module", "numel", "relative_error", "nonfinite_steps", "local_max", "first_nonfinite_step"],
    )
    return ParallelComparison(
        world=world,
        topology="FSDPSequential",
        parallelized_by="parallelize()",
        hooks=hooks or [],
        policy={**FSDP2_POLICY, **(policy or {})},
        symptoms=[],
        repaired_symptoms=[],
        single_process_symptoms=[],
        reduction=table,
        ranks_agree=True,
        records={"as_run": as_run},
        scaler_enabled=scaler_enabled,
        loss_dtypes=loss_dtypes if loss_dtypes is not None else [_outputs_dtype({**FSDP2_POLICY, **(policy or {})})],
    )


def _outputs_dtype(policy: dict[str, Any]) -> str:
    return policy.get("output_dtype") or policy.get("param_dtype") or "float32"
