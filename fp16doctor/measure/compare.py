"""``compare``: the same training in several precisions, side by side.

All modes start from identical weights and replay identical batches. Steps
that a settling GradScaler skips would shift AMP's trajectory by one step
each, so every probe runs *aligned*: a skipped step retries the same batch
with the scheduler held, and trajectories are compared on optimizer steps
actually taken. The skips are reported, not hidden.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from ..config import DoctorConfig
from ..engine.instruments import InstrumentOptions
from ..engine.parallel import ParallelRequest, fingerprints_agree, run_parallel
from ..engine.probe import DEFAULT_INSTRUMENTS, Workbench
from ..engine.records import Column
from ..errors import MemoryLimitError, one_line, smaller_run_hint
from ..tensors import OUT_OF_MEMORY
from .records import ExceptionInfo
from .symptoms import Symptom, measure
from .thresholds import BF16_FACTOR, GAP_ERROR, GAP_TOLERANCE

DEFAULT_TOLERANCE = GAP_TOLERANCE
"""Healthy when every aligned loss is within 0.1% of fp32 (the practitioners' rule of thumb)."""
DEFAULT_DIVERGENCE = GAP_ERROR
"""A deviation past 1% is worth a look: its first step is reported."""
VERDICTS = ("healthy", "drift", "unstable", "diverged")
"""Per mode, worst last: ``unstable`` is a trajectory that agrees with fp32 on the steps taken while the
GradScaler skips beyond its calibration or updates are lost (see :mod:`fp16doctor.measure.symptoms`)."""
UNSTABLE_SYMPTOMS = ("skips", "lost-updates")


@dataclass
class ModeTrajectory:
    """One mode's record, grouped by aligned step (optimizer steps taken before it)."""

    mode: str
    records: pd.DataFrame
    aligned: list[dict[str, Any]]
    skipped: int
    exception: ExceptionInfo | None
    """The first exception, its ``step`` counted in aligned steps (optimizer steps taken before it)."""
    first_nonfinite_module: str | None = None
    """From the probe's instruments: the first module whose output turned non-finite from finite inputs."""
    updates: pd.DataFrame | None = None
    """The instruments' per-parameter update health (lost updates), when instrumented."""
    symptoms: list[Symptom] = field(default_factory=list)
    """The measured symptoms against fp32 (:mod:`fp16doctor.measure.symptoms`), the same as ``diagnose`` uses."""
    skipped_by_optimizer: dict[str, int] = field(default_factory=dict)
    """Steps the scaler skipped, per optimizer (each is skipped on its own gradients)."""


@dataclass
class Comparison:
    """What ``compare`` measured; the CLI renders it, ``to_json`` serialises it."""

    JSON_KEY_DOCS: ClassVar[dict[str, str]] = {
        "steps": "One row per aligned step (optimizer steps taken before it): ``step``, and per mode its ``loss``, "
        "``grad_norm``, ``loss_scale``, ``skipped_before`` and ``finite``, with ``rel_dev`` (relative loss deviation "
        "from fp32) for modes other than fp32; null for a mode without that step.",
        "skipped_steps": "Per mode, the optimizer steps the GradScaler skipped.",
        "symptoms": "Per mode other than fp32, the measured symptoms against fp32.",
        "divergence_tolerance": "Per mode, the divergence tolerance (x8 for bf16).",
    }
    """What the keys ``to_json`` computes (rather than copies from a field) hold: the JSON reference reads them."""

    modes: list[str]
    """The modes run, ``fp32`` (the reference) first."""
    steps: int
    trajectories: dict[str, ModeTrajectory]
    rel_dev: dict[str, list[float | None]]
    max_rel_dev: dict[str, float | None]
    """Per mode, the largest relative loss deviation from fp32."""
    max_rel_dev_step: dict[str, int | None]
    first_divergent_step: dict[str, int | None]
    """Per mode, the first step past the divergence tolerance; null when none."""
    first_nonfinite_step: dict[str, int | None]
    tolerance: dict[str, float]
    """Per mode, the healthy tolerance (x8 for bf16)."""
    divergence: dict[str, float]
    verdict: str
    """The worst mode's verdict: ``healthy`` < ``drift`` < ``unstable`` < ``diverged``."""
    verdict_by_mode: dict[str, str] = field(default_factory=dict)
    """Per mode other than fp32, its verdict."""
    ranks: RanksComparison | None = None
    """With ``--nproc N``: the same modes run as the training's ranks run them, compared with each other; then
    ``verdict`` is the worse of the single process's and the ranks' (``unstable`` at least where the ranks
    disagree)."""

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy" and (self.ranks is None or self.ranks.ranks_agree)

    def with_ranks(self, ranks: RanksComparison) -> Comparison:
        """This single-process comparison with the ranks' beside it, the verdict the worse of the two."""
        disagreeing = "healthy" if ranks.ranks_agree else "unstable"  # ranks that drift apart train no one model
        worst = max(self.verdict, ranks.comparison.verdict, disagreeing, key=VERDICTS.index)
        return dataclasses.replace(self, ranks=ranks, verdict=worst)

    def to_json(self) -> dict[str, Any]:
        rows = []
        for k in range(self.steps):
            row: dict[str, Any] = {"step": k}
            for mode in self.modes:
                entries = self.trajectories[mode].aligned
                if k < len(entries):
                    entry = entries[k]
                    row[mode] = {
                        "loss": json_number(entry[Column.LOSS]),
                        "grad_norm": json_number(entry[Column.GRAD_NORM]),
                        "loss_scale": entry[Column.LOSS_SCALE],
                        "skipped_before": entry["skipped_before"],
                        "finite": entry["finite"],
                    }
                    if mode != "fp32":
                        row[mode]["rel_dev"] = (
                            json_number(self.rel_dev[mode][k]) if k < len(self.rel_dev[mode]) else None
                        )
                else:
                    row[mode] = None
            rows.append(row)
        out = {
            "modes": self.modes,
            "steps": rows,
            "max_rel_dev": {m: json_number(v) for m, v in self.max_rel_dev.items()},
            "first_divergent_step": self.first_divergent_step,
            "verdict": self.verdict,
            "verdict_by_mode": self.verdict_by_mode,
            "skipped_steps": {m: t.skipped for m, t in self.trajectories.items()},
            "skipped_by_optimizer": {m: t.skipped_by_optimizer for m, t in self.trajectories.items()},
            "exceptions": {m: t.exception.to_json() for m, t in self.trajectories.items() if t.exception},
            "first_nonfinite_module": {
                m: t.first_nonfinite_module for m, t in self.trajectories.items() if t.first_nonfinite_module
            },
            "symptoms": {m: [s.to_json() for s in t.symptoms] for m, t in self.trajectories.items() if m != "fp32"},
            "tolerance": self.tolerance,
            "divergence_tolerance": self.divergence,
        }
        if self.ranks is not None:
            out["ranks"] = self.ranks.to_json()
        return out


def wrapping_words(topology: str, parallelized_by: str) -> str:
    """How the ranks' model was wrapped, in words: ``DistributedDataParallel (the doctor's default)`` where the
    training file has no ``parallelize()``, else ``FSDPModule by parallelize()``."""
    if parallelized_by == topology:
        return f"{topology} (the doctor's default)"
    return f"{topology} by {parallelized_by}"


@dataclass
class RanksComparison:
    """``compare --nproc N``: every mode run under torchrun as the training's ranks run it (its ``parallelize()``,
    DDP by default), each rank taking every N-th batch, the loss the mean over the ranks; the modes compared with
    the same topology's FP32 run, step by step, as a single process's are."""

    JSON_KEY_DOCS: ClassVar[dict[str, str]] = {
        "comparison": "The ranks' comparison, in the shape of the single process's (its ``steps``, ``verdict``, ...).",
    }

    world: int
    """The ranks run (``--nproc``)."""
    topology: str
    """The class of what ``parallelize()`` returned (``DistributedDataParallel`` by default)."""
    parallelized_by: str
    """``parallelize()`` (the training file's) or ``DistributedDataParallel`` (the doctor's default)."""
    hooks: list[str]
    """The communication hooks the training registers (empty: DDP's default all-reduce)."""
    policy: dict[str, Any] | None
    """FSDP's mixed-precision policy, its dtypes as strings; None for DDP."""
    comparison: Comparison
    ranks_agree: bool
    """Whether every rank ended every mode with the same weights, loss scale and skipped steps."""
    seconds: float
    """The torchrun run's wall time."""

    def only_parallel(self, single: Comparison) -> list[str]:
        """The modes that fail or drift on the ranks but are healthy in one process."""
        return [
            mode
            for mode, verdict in self.comparison.verdict_by_mode.items()
            if mode != "fp32" and verdict != "healthy" and single.verdict_by_mode.get(mode) == "healthy"
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "world": self.world,
            "topology": self.topology,
            "parallelized_by": self.parallelized_by,
            "hooks": self.hooks,
            "policy": self.policy,
            "ranks_agree": self.ranks_agree,
            "seconds": self.seconds,
            "comparison": self.comparison.to_json(),
        }


def compare_ranks(
    request: ParallelRequest,
    world: int,
    workdir: Path,
    rank_timeout: float,
    config: DoctorConfig,
    tolerance: float = DEFAULT_TOLERANCE,
    divergence: float = DEFAULT_DIVERGENCE,
) -> RanksComparison:
    """Run ``request``'s passes (``compare``'s modes, aligned) on ``world`` ranks and compare them with their fp32."""
    result = run_parallel(request, world, workdir, rank_timeout)
    modes = list(request.passes)
    trajectories = {mode: aligned_trajectory(mode, result.passes[mode].records) for mode in modes}
    comparison = compare_trajectories(trajectories, modes, request.steps, config, tolerance, divergence)
    agree = all(fingerprints_agree(p.fingerprints) for p in result.passes.values())
    return RanksComparison(
        world, result.topology, result.parallelized_by, result.hooks, result.policy, comparison, agree, result.seconds
    )


def json_number(value: Any) -> float | None:
    """JSON has no NaN or inf: non-finite numbers become null (the row's ``finite`` says so)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def aligned_trajectory(mode: str, frame: pd.DataFrame) -> ModeTrajectory:
    """Group attempts by aligned step: the entry of step k is its taken attempt, else its last one."""
    aligned: list[dict[str, Any]] = []
    pending_skips = 0
    exception: ExceptionInfo | None = None
    for row in frame.to_dict("records"):
        if row[Column.EXCEPTION_TYPE]:
            exception = ExceptionInfo(
                step=len(aligned),
                type=row[Column.EXCEPTION_TYPE],
                message=row[Column.EXCEPTION],
                location=row[Column.EXCEPTION_LOCATION],
            )
        finite = math.isfinite(row[Column.LOSS]) and not row[Column.EXCEPTION_TYPE]
        entry = {**row, "skipped_before": pending_skips, "finite": finite}
        if not row[Column.SKIPPED] or row[Column.EXCEPTION_TYPE]:
            aligned.append(entry)
            pending_skips = 0
        else:
            pending_skips += 1
            if not finite:  # a non-finite loss is the divergence itself: show it at this step
                aligned.append(entry)
                break
    else:
        if pending_skips:  # ran out of iterations while skipping: the mode stalled here
            aligned.append({**frame.iloc[-1].to_dict(), "skipped_before": pending_skips, "finite": False})
    return ModeTrajectory(mode, frame, aligned, int(frame[Column.SKIPPED].sum()), exception)


def compare(
    bench: Workbench,
    modes: list[str],
    steps: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    divergence: float = DEFAULT_DIVERGENCE,
    config: DoctorConfig | None = None,
    on_mode: Callable[[str], None] | None = None,
    reference: ModeTrajectory | None = None,
    instruments: InstrumentOptions | None = DEFAULT_INSTRUMENTS,
    max_iterations: int | None = None,
) -> Comparison:
    """Run ``modes`` (fp32 is always the reference) and compare them on aligned optimizer steps.

    ``reference``: an fp32 trajectory of the same bench and steps already run (a sweep compares
    many settings against one baseline instead of recomputing it per setting).
    """
    config = config or bench.config
    steps = steps or config.steps
    modes = compared_modes(modes)
    trajectories = {"fp32": reference} if reference is not None else {}
    for mode in modes:
        if mode in trajectories:
            continue
        if on_mode is not None:
            on_mode(mode)
        trajectories[mode] = run_aligned(bench, mode, config, steps, instruments, max_iterations)
    return compare_trajectories(trajectories, modes, steps, config, tolerance, divergence)


def compared_modes(modes: Sequence[str]) -> list[str]:
    """The modes as a comparison runs them: ``fp32`` (the reference) first, each mode once."""
    return ["fp32"] + [m for m in dict.fromkeys(modes) if m != "fp32"]


def compare_trajectories(
    trajectories: dict[str, ModeTrajectory],
    modes: list[str],
    steps: int,
    config: DoctorConfig,
    tolerance: float = DEFAULT_TOLERANCE,
    divergence: float = DEFAULT_DIVERGENCE,
) -> Comparison:
    """Score trajectories already run (``fp32``, the reference, first in ``modes``) against fp32's."""
    reference_steps = trajectories["fp32"].aligned
    ref_nonfinite = next((k for k, e in enumerate(reference_steps) if not e["finite"]), None)
    result = Comparison(
        modes=modes,
        steps=steps,
        trajectories=trajectories,
        rel_dev={},
        max_rel_dev={},
        max_rel_dev_step={},
        first_divergent_step={},
        first_nonfinite_step={"fp32": ref_nonfinite},
        tolerance={},
        divergence={},
        verdict="healthy",
    )
    for mode in modes[1:]:
        factor = BF16_FACTOR if _is_bf16(mode, config) else 1.0
        theirs, ours = trajectories["fp32"], trajectories[mode]
        ours.symptoms = measure(ours.records, theirs.records, ours.updates, theirs.updates, bf16=_is_bf16(mode, config))
        result.tolerance[mode] = tolerance * factor
        result.divergence[mode] = divergence * factor
        _score(result, mode, reference_steps, ref_nonfinite, steps)
    if ref_nonfinite is not None:
        result.verdict_by_mode["fp32"] = "diverged"
        result.first_divergent_step["fp32"] = ref_nonfinite
    result.verdict = max(result.verdict_by_mode.values(), key=VERDICTS.index, default="healthy")
    return result


def run_aligned(
    bench: Workbench,
    mode: str,
    config: DoctorConfig,
    steps: int,
    instruments: InstrumentOptions | None = DEFAULT_INSTRUMENTS,
    max_iterations: int | None = None,
) -> ModeTrajectory:
    """One mode's probe run aligned on optimizer steps taken, with what its instruments saw (``None``: uninstrumented)."""
    probe = bench.probe(mode, config, align_on_taken_steps=True, instruments=instruments)
    try:
        try:
            # at least ``steps`` (a skipped step is taken again), at most ``max_iterations``
            with bench.progress.planned(max_iterations or steps):
                records = probe.run(steps, max_iterations=max_iterations, stop_on_nonfinite_loss=True)
        except OUT_OF_MEMORY as exc:  # a comparison missing a precision would be no comparison
            raise MemoryLimitError(
                f"the {mode} run ran out of memory ({one_line(exc)}).", hint=smaller_run_hint("Compare")
            ) from exc
        trajectory = aligned_trajectory(mode, records)
        trajectory.skipped_by_optimizer = probe.skips_by_optimizer()
        if probe.instruments is not None:
            first = probe.instruments.first_nonfinite_forward()
            trajectory.first_nonfinite_module = first["module"] if first else None
            trajectory.updates = probe.instruments.frames().get("updates")
        return trajectory
    finally:
        probe.close()


def _is_bf16(mode: str, config: DoctorConfig) -> bool:
    return mode == "bf16" or (mode == "amp" and config.dtype == "bfloat16")


def _score(result: Comparison, mode: str, reference: list[dict], ref_nonfinite: int | None, steps: int) -> None:
    """Deviation per aligned step, the first step past the divergence tolerance, and the verdict."""
    entries = result.trajectories[mode].aligned
    devs: list[float | None] = []
    first_nonfinite = None
    limit = min(len(entries), len(reference), ref_nonfinite if ref_nonfinite is not None else steps)
    for k in range(limit):
        mine, ref = entries[k], reference[k]
        if not mine["finite"]:
            first_nonfinite = k
            devs.append(None)
            break
        devs.append(abs(mine[Column.LOSS] - ref[Column.LOSS]) / max(abs(ref[Column.LOSS]), 1e-12))
    if first_nonfinite is None and len(entries) < min(steps, ref_nonfinite or steps):
        first_nonfinite = len(entries)  # a run that stopped early has failed from there on
    result.rel_dev[mode] = devs
    finite_devs = [d for d in devs if d is not None]
    if finite_devs:
        worst = max(range(len(finite_devs)), key=finite_devs.__getitem__)
        result.max_rel_dev[mode], result.max_rel_dev_step[mode] = finite_devs[worst], worst
    else:
        result.max_rel_dev[mode], result.max_rel_dev_step[mode] = None, None
    past = next((k for k, d in enumerate(devs) if d is not None and d > result.divergence[mode]), None)
    result.first_nonfinite_step[mode] = first_nonfinite
    if first_nonfinite is not None:
        result.verdict_by_mode[mode] = "diverged"
        result.first_divergent_step[mode] = first_nonfinite if past is None else min(past, first_nonfinite)
    else:
        result.first_divergent_step[mode] = past
        worst_dev = result.max_rel_dev[mode] or 0.0
        unstable = any(s.code in UNSTABLE_SYMPTOMS for s in result.trajectories[mode].symptoms)
        result.verdict_by_mode[mode] = (
            "unstable" if unstable else ("healthy" if worst_dev <= result.tolerance[mode] else "drift")
        )
