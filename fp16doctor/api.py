"""The public API: what the command line does, callable from Python, returning typed records.

    import fp16doctor

    diagnosis = fp16doctor.diagnose("train.py", steps=30, device="cpu")
    if not diagnosis.healthy:
        print(diagnosis.findings[0].title, diagnosis.findings[0].fix.config_patch)
    json.dumps(diagnosis.to_json())

    comparison = fp16doctor.compare("train.py", modes=("fp32", "amp", "bf16"), steps=20)

    with fp16doctor.watch(capsule_dir="capsules") as watching:
        train()                      # your loop, unchanged
    watching.alarms                  # what it saw; a capsule per alarm

Config keys are keyword arguments, nested sections as dicts (``scaler={"init_scale": 1024}``), over the training
file's ``CONFIG`` and a ``config_file``, as the CLI's flags are. Bad input raises a
:class:`~fp16doctor.errors.DoctorError` (the CLI turns it into exit code 2); nothing here prints.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import DoctorConfig, build_config, load_yaml, merge
from .diagnosis.findings import CapsuleReplay, Diagnosis, WatchedStep
from .diagnosis.triage import DiagnoseOptions, fixed_config
from .diagnosis.triage import diagnose as run_triage
from .engine.kept import return_large_blocks_on_free
from .engine.parallel import request_for
from .engine.probe import Workbench, load_trained_weights
from .engine.progress import ProbeStepHook
from .engine.rng import seed_everything
from .errors import DoctorError
from .live.capsule import check_capsule, recorded_loss_evidence, replay_note
from .measure.compare import DEFAULT_DIVERGENCE, DEFAULT_TOLERANCE, Comparison, compare_ranks, compared_modes
from .measure.compare import compare as run_compare
from .measure.serving import DEFAULT_TOLERANCE as DEFAULT_SERVING_TOLERANCE
from .measure.serving import OnnxRequest, ServeCheck, fresh_copies
from .measure.serving import serve_check as run_serve_check
from .measure.serving_onnx import missing_extras as missing_onnx_extras
from .measure.speed import TIMED_STEPS, WARMUP_STEPS, SpeedReport, measure_speed
from .userfile.checkpoint import load_checkpoint
from .userfile.loop import default_loss
from .userfile.spec import TrainingSpec, build_model_and_program, draw_batches, load_training_file
from .watch import Watching, watch

__all__ = [
    "Comparison",
    "Diagnosis",
    "ServeCheck",
    "SpeedReport",
    "CheckpointStart",
    "LoadedTraining",
    "Watching",
    "compare",
    "corrected_config",
    "diagnose",
    "load",
    "serve_check",
    "speed",
    "watch",
]

PathLike = str | Path
SPEED_STEPS = WARMUP_STEPS + TIMED_STEPS + 1  # and the counted step


@dataclass(frozen=True)
class LoadedTraining:
    """A training file with its config: what every command starts from."""

    spec: TrainingSpec
    config: DoctorConfig
    """The validated config: defaults, then the file's ``CONFIG``, the YAML file, the caller's keys."""
    user_layers: dict[str, Any]
    """The user's own layers merged (no defaults): what a corrected config is written from."""


def load(training_file: PathLike, config_file: PathLike | None = None, **config: Any) -> LoadedTraining:
    """Load a training file and build its config (a bad file or key raises :class:`DoctorError`)."""
    spec = load_training_file(Path(training_file))
    yaml_layer = load_yaml(config_file) if config_file is not None else {}
    flags = {k: v for k, v in config.items() if v is not None}
    built = build_config(spec.config, yaml_layer, flags)
    return LoadedTraining(spec, built, merge(merge(spec.config, yaml_layer), flags))


@dataclass(frozen=True)
class CapsuleTarget:
    """What a capsule's diagnosis runs: its replay file, and what its watch recorded that the replay cannot run."""

    training_file: Path
    replay_note: str | None = None
    recorded_loss_finding: str | None = None
    replay: CapsuleReplay | None = None
    """What the watch recorded about the state the replayed step starts from."""


def capsule_target(capsule: PathLike | None, training_file: PathLike | None) -> CapsuleTarget:
    """The training file to diagnose: the one given, or a capsule's ``train_capsule.py`` (given as the folder, or
    as that file itself) with the note saying what its replay cannot verify."""
    path = Path(training_file) if training_file is not None else None
    folder = Path(capsule) if capsule is not None else None
    if (
        folder is None
        and path is not None
        and path.name == "train_capsule.py"
        and (path.parent / "manifest.json").is_file()
    ):
        folder, path = path.parent, None  # a capsule's own file: diagnosed as the capsule
    if folder is None:
        if path is None:
            raise DoctorError(
                "no training file given.", hint="fp16doctor diagnose model.py, or --capsule DIR for a watch's capsule."
            )
        return CapsuleTarget(path)
    if path is not None:
        raise DoctorError("give a training file or --capsule, not both.")
    manifest = check_capsule(folder)
    return CapsuleTarget(
        folder / "train_capsule.py", replay_note(manifest), recorded_loss_evidence(manifest), capsule_replay(manifest)
    )


def capsule_replay(manifest: dict[str, Any]) -> CapsuleReplay:
    """The manifest's record of the state the step starts from (a capsule from before it was kept: nothing)."""
    written = manifest.get("step_state") or {}
    return CapsuleReplay(
        step=int(manifest.get("step") or 0),
        history_finite=bool(manifest.get("history_finite")),
        restored=list(written.get("restored") or []),
        uncaptured=list(written.get("uncaptured") or []),
        skipped_before=int(manifest.get("skipped_before") or 0),
        history=[row for row in map(WatchedStep.from_json, manifest.get("history") or []) if row is not None],
    )


@dataclass(frozen=True)
class CheckpointStart:
    """Where the probes start: a checkpoint a run left (``--from-checkpoint``), instead of ``model()``'s
    initialisation."""

    path: PathLike
    """A ``torch.save`` file, a Lightning ``.ckpt`` or a Hugging Face ``checkpoint-N/`` folder."""
    step: int | None = None
    """The optimizer step the data continues from (None: the checkpoint's own)."""
    trust: bool = False
    """Unpickle more than tensors and plain containers (the file runs code when loaded: trusted files only)."""


def start_from_checkpoint(loaded: LoadedTraining, start: CheckpointStart | None) -> LoadedTraining:
    """The training with every probe starting from the checkpoint's state (a note says which)."""
    if start is None:
        return loaded
    trained = load_checkpoint(Path(start.path), start.step, start.trust)
    loaded.spec.start = trained
    loaded.spec.note(f"the probes start from the {trained.describe()}, and the data continues at step {trained.step}")
    return loaded


def load_target(target: CapsuleTarget, config_file: PathLike | None = None, **config: Any) -> LoadedTraining:
    """Load what a diagnosis runs: the training file (a capsule's replay noted on it) with its config."""
    loaded = load(target.training_file, config_file, **config)
    if target.replay_note is not None:
        loaded.spec.note(target.replay_note)
        loaded.spec.replays_capsule = True
    return loaded


def diagnose(
    training_file: PathLike | None = None,
    *,
    capsule: PathLike | None = None,
    config_file: PathLike | None = None,
    ci: bool = False,
    scan_batches: int | None = None,
    max_memory: int | None = None,
    plots: bool = False,
    on_stage: Callable[[str], None] | None = None,
    on_probe_step: ProbeStepHook | None = None,
    own_process: bool = False,
    from_checkpoint: CheckpointStart | None = None,
    **config: Any,
) -> Diagnosis:
    """Run the triage on a training file (or a watch's capsule) and return the ranked diagnosis.

    ``ci``: the smoke check (fewer steps, narrower searches). ``max_memory``: bytes the diagnosis may hold.
    ``plots``: record what the report's plots draw. ``on_stage``/``on_probe_step``: progress callbacks.
    ``own_process``: the process is the diagnosis's alone (the CLI), so it may tune the allocator.
    ``from_checkpoint``: every probe starts from a checkpoint's trained state.
    The diagnosis's :attr:`~fp16doctor.diagnosis.findings.Diagnosis.user_layers` is what
    :func:`corrected_config` starts from.
    """
    if capsule is not None and from_checkpoint is not None:
        raise DoctorError("give a capsule or a checkpoint, not both: each is the state the probes start from.")
    target = capsule_target(capsule, training_file)
    options = DiagnoseOptions(
        ci=ci,
        scan_batches=scan_batches,
        max_memory=max_memory,
        own_process=own_process,
        recorded_loss_finding=target.recorded_loss_finding,
        capsule=target.replay,
        plots=plots,
    )
    loaded = start_from_checkpoint(load_target(target, config_file, **config), from_checkpoint)
    return diagnose_loaded(loaded, options, on_stage, on_probe_step)


def diagnose_loaded(
    loaded: LoadedTraining,
    options: DiagnoseOptions,
    on_stage: Callable[[str], None] | None = None,
    on_probe_step: ProbeStepHook | None = None,
) -> Diagnosis:
    """:func:`diagnose` on a training already loaded (the CLI's, which goes on to train the same spec)."""
    return_large_blocks_on_free()  # probe after probe: a closed probe's memory goes back to the system
    result = run_triage(loaded.spec, loaded.config, options, on_stage=on_stage, on_probe_step=on_probe_step)
    return result.with_user_layers(loaded.user_layers)


def corrected_config(diagnosis: Diagnosis) -> dict[str, Any]:
    """The user's own config with the verified fixes applied: what ``--fix-config`` writes and ``train`` runs."""
    return fixed_config(diagnosis.user_layers, diagnosis)


def compare(
    training_file: PathLike,
    modes: Sequence[str] = ("fp32", "amp"),
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    divergence: float = DEFAULT_DIVERGENCE,
    config_file: PathLike | None = None,
    on_mode: Callable[[str], None] | None = None,
    on_ready: Callable[[LoadedTraining], None] | None = None,
    from_checkpoint: CheckpointStart | None = None,
    nproc: int = 1,
    rank_timeout: float = 300.0,
    **config: Any,
) -> Comparison:
    """Run precisions side by side from identical weights and batches (FP32 is always the reference).

    ``modes``: ``fp32``, ``amp`` (as configured), ``bf16``. Healthy when every aligned loss is within
    ``tolerance`` of FP32's (x8 for bf16); ``divergence`` marks the first step past it. ``on_ready`` is told the
    loaded training before the probes start (the CLI shows its notes). ``nproc`` > 1: then the same modes run on
    that many ranks under torchrun, as the training file's ``parallelize()`` wraps the model, compared with each
    other (``Comparison.ranks``); a rank that does not move for ``rank_timeout`` s stops the run.
    """
    unknown = sorted(set(modes) - {"fp32", "amp", "bf16"})
    if unknown:
        raise DoctorError(f"unknown mode(s) {', '.join(unknown)}.", hint="Modes are fp32, amp and bf16.")
    if nproc > 1 and from_checkpoint is not None:
        raise DoctorError("--from-checkpoint is not run on the ranks yet: give --nproc or --from-checkpoint, not both.")
    return_large_blocks_on_free()  # one probe per mode, one after another
    loaded = start_from_checkpoint(load(training_file, config_file, **config), from_checkpoint)
    if on_ready is not None:
        on_ready(loaded)
    bench = Workbench(loaded.spec, loaded.config)
    modes = compared_modes(modes)
    single = run_compare(bench, modes, tolerance=tolerance, divergence=divergence, on_mode=on_mode)
    if nproc <= 1:
        return single
    if on_mode is not None:
        on_mode(f"{', '.join(modes)} on {nproc} ranks")
    request = request_for(loaded.spec.path, loaded.config, loaded.config.steps, compared=tuple(modes))
    with tempfile.TemporaryDirectory(prefix="fp16doctor-compare-") as folder:
        ranks = compare_ranks(request, nproc, Path(folder), rank_timeout, loaded.config, tolerance, divergence)
    return single.with_ranks(ranks)


def serve_check(
    training_file: PathLike,
    *,
    tolerance: float = DEFAULT_SERVING_TOLERANCE,
    batches: int = 4,
    checkpoint: CheckpointStart | None = None,
    onnx: bool = False,
    onnx_out: PathLike | None = None,
    overwrite: bool = False,
    config_file: PathLike | None = None,
    **config: Any,
) -> ServeCheck:
    """The trained model served in half precision (``model.half()``, fp16 autocast, bf16) against FP32, on the
    file's first ``batches`` batches; where fp16 serving fails, the smallest set of modules to keep in fp32,
    verified. The model is ``model()``'s (in eval mode), with a ``checkpoint``'s weights where one is given.

    With ``onnx`` (or ``onnx_out``), the model is also exported to ONNX, converted to fp16 with the keep-set as the
    converter's block list, and run on onnxruntime; ``onnx_out`` is where that conversion is written (a new file,
    unless ``overwrite``).
    It needs the optional extras: ``pip install 'fp16doctor[onnx]'``."""
    if batches < 1:
        raise DoctorError("--batches must be at least 1.")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise DoctorError(
            f"--tolerance must be a share above 0 (0.01 is 1%), not {tolerance}.",
            hint="It is how far each output may stray from FP32's, relative to its largest value.",
        )
    request = onnx_request(onnx, onnx_out, overwrite)
    loaded = load(training_file, config_file, **config)
    seed_everything(loaded.config.seed)
    model, _ = build_model_and_program(loaded.spec)  # the eager module: serving exports the module, not its graph
    if checkpoint is not None:
        load_trained_weights(model, load_checkpoint(Path(checkpoint.path), checkpoint.step, checkpoint.trust))
    # a short data() is cycled to the count asked for; serving the same batch again measures nothing new
    drawn = list({id(batch): batch for batch in draw_batches(loaded.spec, batches)}.values())
    return run_serve_check(fresh_copies(model), drawn, loaded.spec.loss or default_loss, tolerance, request)


def onnx_request(onnx: bool, onnx_out: PathLike | None, overwrite: bool = False) -> OnnxRequest | None:
    """The ONNX check asked for, once its extras are known to be installed: before any model runs."""
    if not onnx and onnx_out is None:
        return None
    missing = missing_onnx_extras()
    if missing:
        raise DoctorError(
            f"the ONNX check needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed.",
            hint="pip install 'fp16doctor[onnx]' (onnx, onnxruntime, and onnxscript for torch's exporter).",
        )
    if onnx_out is not None:
        writable_file(Path(onnx_out))
        if Path(onnx_out).exists() and not overwrite:
            raise DoctorError(f"'{onnx_out}' already exists; not overwriting it.", hint="Pass overwrite=True.")
    return OnnxRequest(Path(onnx_out) if onnx_out is not None else None)


def writable_file(path: Path) -> None:
    """A file can be written at ``path`` (its folder made where missing): said before any model runs."""
    if path.is_dir():
        raise DoctorError(f"'{path}' is a folder, not a file to write.", hint="Give the path of the file to write.")
    folder = next((p for p in path.absolute().parents if p.exists()), None)
    if folder is None or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise DoctorError(f"'{path}' cannot be written: {folder} is not a folder this process can write to.")


def speed(
    training_file: PathLike,
    *,
    config_file: PathLike | None = None,
    measure_advice: bool | None = None,
    **config: Any,
) -> SpeedReport:
    """The training file's own step timed in FP32 and AMP, one AMP step's operators counted (half-precision FLOP
    share, casts, misaligned matrix products, host synchronisations, element-wise operators, the optimizer's
    kind), and the changes those call for, ranked. ``measure_advice``: each change the doctor can apply (a padded
    layer, a compiled module, a fused optimizer) is applied and the step timed with it, against the step as it is;
    None: on CUDA, not on a CPU (whose times do not predict a GPU's)."""
    loaded = load(training_file, config_file, **config)
    bench = Workbench(loaded.spec, loaded.config, batch_count=SPEED_STEPS)
    return measure_speed(bench, loaded.spec.path, measure_advice)
