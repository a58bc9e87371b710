"""The command line. The only module that catches :class:`DoctorError` and sets exit codes.

Options are ``Annotated`` aliases defined once and shared by the commands.
"""

from __future__ import annotations

import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core
from rich.markup import escape

from . import __version__
from .config import parse_memory_size
from .errors import EXIT_FINDINGS, EXIT_OK, DoctorError
from .files import atomic_write_text
from .output.progress import DiagnosisProgress, TrainingProgress
from .output.streams import (
    PipedConsole,
    print_json,
    print_json_error,
    stdout_for_json_only,
    whole_line_to_stderr,
)

if TYPE_CHECKING:  # the commands import what they run on first use: --help and --version stay light
    import pandas as pd

    from .api import LoadedTraining
    from .live.watch import Alarm
    from .run.train import TrainOptions


class FlagsWithoutPlaceholder(typer.core.TyperGroup):
    """The command group, with help that shows on/off flags as flags: typer's help prints a ``<bool>`` type
    after ``--json`` or ``--force``, as if they took a value. Applied to every command the group hands out, so a
    command added later gets it too."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _hide_flag_types([*command.params, command.get_help_option(ctx)])
        return command

    def get_params(self, ctx: Any) -> list[Any]:
        return _hide_flag_types(super().get_params(ctx))


def _hide_flag_types(params: list[Any]) -> list[Any]:
    """An empty metavar on every flag: the help shows no value placeholder for it."""
    for param in params:
        if isinstance(param, typer.core.TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return [p for p in params if p is not None]


app = typer.Typer(
    cls=FlagsWithoutPlaceholder,
    name="fp16doctor",
    help="A doctor for mixed-precision (fp16/bf16 AMP) training in PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = PipedConsole()
err = PipedConsole(stderr=True)

EXIT_INTERNAL = 3
"""A bug of fp16doctor's (never the user's input)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C, as a shell reports SIGINT."""

TrainingFile = Annotated[
    Path,
    typer.Argument(
        help="The training file: defines model() and data(); see docs/training-file.md.", show_default=False
    ),
]
ConfigFile = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config; overrides the file's CONFIG dict.")
]
Steps = Annotated[
    int | None, typer.Option("--steps", help="Training steps: per probe, or of the run for train (config key: steps).")
]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed (config key: seed).")]
Device = Annotated[str | None, typer.Option("--device", help="auto | cpu | cuda (config key: device).")]
Dtype = Annotated[str | None, typer.Option("--dtype", help="float16 | bfloat16 (config key: dtype).")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object to stdout and nothing else.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show Python tracebacks for errors.")]
RunDir = Annotated[
    Path | None,
    typer.Option(
        "--run-dir",
        help="Where the run keeps metrics.csv, checkpoints/ and summary.json (default: runs/<training file name>).",
    ),
]
CheckpointEvery = Annotated[int, typer.Option("--checkpoint-every", min=1, help="K: a checkpoint every K steps.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in the run directory.")]
OnNonfinite = Annotated[
    str, typer.Option("--on-nonfinite", help="skip (like the GradScaler; stop after --max-nonfinite in a row) or stop.")
]
MaxNonfinite = Annotated[
    int, typer.Option("--max-nonfinite", min=1, help="Consecutive non-finite steps after which a skipping run stops.")
]
Nproc = Annotated[
    int,
    typer.Option(
        "--nproc",
        min=1,
        help="Processes under torchrun (gloo on CPU, nccl on CUDA), the model wrapped by the file's parallelize() "
        "or DistributedDataParallel: diagnose's parallel stage, and the corrected training.",
    ),
]
RankTimeout = Annotated[
    float,
    typer.Option("--rank-timeout", min=1, help="Seconds with no rank moving after which a parallel run is stopped."),
]
HtmlFile = Annotated[
    Path | None, typer.Option("--html", help="Write a self-contained HTML report with plots (inline SVG, no network).")
]
Wide = Annotated[bool, typer.Option("--wide", help="Every column at full precision, however wide the terminal.")]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        metavar="SIZE",
        show_default=False,
        help="Memory the diagnosis may hold: 2GB, 512MiB, or 0.5 for half the machine's. States kept for later "
        "stages stay in memory up to it and go to a temporary folder past it (default: one probe in memory, "
        "every kept state in the folder).",
    ),
]
FromCheckpoint = Annotated[
    Path | None,
    typer.Option(
        "--from-checkpoint",
        help="Start every probe from a checkpoint's trained state: a torch.save dict, a Lightning .ckpt or a "
        "Hugging Face checkpoint-N folder (model, optimizer, scaler, scheduler); the data continues from its step.",
    ),
]
FromStep = Annotated[
    int | None,
    typer.Option(
        "--from-step",
        min=0,
        help="With --from-checkpoint: the step the data continues from (default: the checkpoint's).",
    ),
]
TrustCheckpoint = Annotated[
    bool,
    typer.Option(
        "--trust-checkpoint",
        help="Load a checkpoint that pickles more than tensors (it runs code when loaded: trusted files only).",
    ),
]
Force = Annotated[
    bool,
    typer.Option(
        "--force", help="Overwrite output files that already exist (otherwise: ask, or refuse without a terminal)."
    ),
]


def flags(**values: Any) -> dict[str, Any]:
    """The command-line flags as config keys (only those given)."""
    return {k: v for k, v in values.items() if v is not None}


def guarded(debug: bool, job: Callable[[], int], json_errors: bool = False) -> None:
    """Run ``job``; map bad input to one red message and its exit code, never a traceback unless --debug. With
    ``json_errors`` (``--json``) stdout still carries one object: ``{"error": {...}}`` (message, hint, location,
    exit code), so a CI script that parses stdout reads why instead of failing on an empty document."""
    try:
        code = job()
    except DoctorError as exc:
        if debug:
            traceback.print_exc()
        # the messages name the user's paths, code and pip extras ("fp16doctor[onnx]"): text, not markup
        err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False)
        if exc.location:
            err.print(f"  [red]at[/] {escape(exc.location)}", highlight=False)
        if exc.hint:
            err.print(f"  {escape(exc.hint)}", highlight=False)
        if json_errors:
            print_json_error(exc.message, exc.hint, exc.location, exc.exit_code)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as exc:  # noqa: BLE001 - a bug of ours: say so plainly
        if debug:
            traceback.print_exc()
        err.print(f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))}", highlight=False)
        err.print("  This is a bug in fp16doctor; run again with --debug for the traceback and report it.")
        if json_errors:
            print_json_error(f"internal error: {type(exc).__name__}: {exc}", None, None, EXIT_INTERNAL)
        raise typer.Exit(EXIT_INTERNAL) from None
    raise typer.Exit(code)


def checkpoint_start(path: Path | None, step: int | None, trust: bool) -> Any:
    """The API's :class:`~fp16doctor.api.CheckpointStart` of the --from-checkpoint flags (None without one)."""
    from .api import CheckpointStart

    if path is None:
        if step is not None or trust:
            raise DoctorError("--from-step and --trust-checkpoint go with --from-checkpoint.")
        return None
    return CheckpointStart(path, step, trust)


def check_writable(path: Path, force: bool) -> None:
    """Nothing the user has is overwritten without asking: confirm on a terminal, else require --force."""
    if not path.exists() or force:
        return
    if sys.stdin.isatty() and typer.confirm(f"{path} exists. Overwrite it?", default=False, err=True):
        return
    raise DoctorError(
        f"'{path}' already exists; not overwriting it.", hint="Choose another path, or pass --force to overwrite."
    )


def figures_folder(report: Path) -> Path:
    """Where ``--report FILE.md`` puts its figures: ``FILE_figures/`` beside it."""
    return report.with_name(report.stem + "_figures")


def show_notes(notes: list[str]) -> None:
    """What the user should know about how their file was run (stderr: --json output stays one object)."""
    for note in notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)


@app.callback(invoke_without_command=True)
def main(version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False) -> None:
    if version:
        out.print(f"fp16doctor {__version__}")
        raise typer.Exit(0)


@app.command()
def compare(
    training_file: TrainingFile,
    fp32: Annotated[
        bool, typer.Option("--fp32", help="Run the FP32 baseline (always run: it is the reference).")
    ] = False,
    amp: Annotated[bool, typer.Option("--amp", help="Run AMP as configured (dtype, scaler).")] = False,
    bf16: Annotated[bool, typer.Option("--bf16", help="Run AMP in bfloat16 without a scaler.")] = False,
    steps: Steps = None,
    config: ConfigFile = None,
    seed: Seed = None,
    device: Device = None,
    dtype: Dtype = None,
    tol: Annotated[
        float,
        typer.Option("--tol", help="Healthy when every loss is within this relative deviation of fp32 (x8 for bf16)."),
    ] = 1e-3,
    divergence_tol: Annotated[
        float, typer.Option("--divergence-tol", help="Report the first step past this deviation (x8 for bf16).")
    ] = 1e-2,
    json_: Json = False,
    csv: Annotated[
        Path | None, typer.Option("--csv", help="Write every mode's per-step record to this CSV file.")
    ] = None,
    html: HtmlFile = None,
    wide: Wide = False,
    from_checkpoint: FromCheckpoint = None,
    from_step: FromStep = None,
    trust_checkpoint: TrustCheckpoint = False,
    nproc: Nproc = 1,
    rank_timeout: RankTimeout = 300.0,
    force: Force = False,
    debug: Debug = False,
) -> None:
    """Run precisions side by side from identical weights and batches. Exit 0 healthy, 1 drift/diverged, 2 bad input.

    With --nproc N: then the same modes on N ranks under torchrun, as the file's parallelize() wraps the model.
    """

    def job() -> int:
        from . import api
        from .output.terminal import render_comparison

        for path in (csv, html):
            if path is not None:
                check_writable(path, force)
        if html is not None and nproc > 1:
            raise DoctorError(
                "--html draws one process's comparison, not the ranks'.", hint="With --nproc, use --json (its ranks)."
            )
        modes = [m for m, on in (("fp32", fp32), ("amp", amp), ("bf16", bf16)) if on] or ["fp32", "amp"]
        from .userfile.spec import notes_under

        notes: list[str] = []
        with err.status("preparing: drawing batches, building the model") as status:
            result = api.compare(
                training_file,
                modes,
                tolerance=tol,
                divergence=divergence_tol,
                config_file=config,
                on_ready=lambda loaded: notes.extend(notes_under(loaded.spec.notes, loaded.config.compile.enabled)),
                on_mode=lambda m: status.update(f"running the {m} probe"),
                from_checkpoint=checkpoint_start(from_checkpoint, from_step, trust_checkpoint),
                nproc=nproc,
                rank_timeout=rank_timeout,
                **flags(steps=steps, seed=seed, device=device, dtype=dtype),
            )
        show_notes(notes)
        if csv is not None:
            frames = {m: t.records for m, t in result.trajectories.items()}
            if result.ranks is not None:  # the ranks' modes beside the single process's
                world = result.ranks.world
                frames |= {f"{m} on {world} ranks": t.records for m, t in result.ranks.comparison.trajectories.items()}
            write_csv(csv, frames)
        if html is not None:
            from .output.html import comparison_html

            atomic_write_text(html, comparison_html(result, str(training_file)))
        if json_:
            print_json(result.to_json())
        else:
            render_comparison(result, out, wide=wide)
            if html is not None:
                out.print(f"[dim]HTML report written to {html}[/]")
        return EXIT_OK if result.healthy else EXIT_FINDINGS

    with stdout_for_json_only(json_):
        guarded(debug, job, json_errors=json_)


@app.command()
def diagnose(
    training_file: Annotated[
        Path | None,
        typer.Argument(
            help="The training file: defines model() and data(); see docs/training-file.md.", show_default=False
        ),
    ] = None,
    capsule: Annotated[
        Path | None,
        typer.Option(
            "--capsule",
            help="Diagnose a replay capsule written by fp16doctor's watch (a folder with train_capsule.py).",
        ),
    ] = None,
    config: ConfigFile = None,
    steps: Steps = None,
    seed: Seed = None,
    device: Device = None,
    dtype: Dtype = None,
    json_: Json = False,
    report: Annotated[Path | None, typer.Option("--report", help="Write a Markdown report of the diagnosis.")] = None,
    fix_config: Annotated[
        Path | None,
        typer.Option("--fix-config", help="Write your config with every fix's config patch applied (YAML)."),
    ] = None,
    ci: Annotated[
        bool, typer.Option("--ci", help="CI smoke check: fewer steps, only the stages the evidence calls for.")
    ] = False,
    junit: Annotated[
        Path | None, typer.Option("--junit", help="Write a JUnit XML report (one test case per cause).")
    ] = None,
    html: HtmlFile = None,
    scan_batches: Annotated[
        int | None,
        typer.Option("--scan-batches", help="Scan this many batches in the data scan (default: those the probes use)."),
    ] = None,
    train_: Annotated[
        bool, typer.Option("--train", help="Then run the corrected training (see `train`); the exit code is the run's.")
    ] = False,
    train_steps: Annotated[
        int | None, typer.Option("--train-steps", help="Steps of the corrected run (default: the config's steps).")
    ] = None,
    run_dir: RunDir = None,
    checkpoint_every: CheckpointEvery = 50,
    on_nonfinite: OnNonfinite = "skip",
    max_nonfinite: MaxNonfinite = 20,
    nproc: Nproc = 1,
    rank_timeout: RankTimeout = 300.0,
    max_memory: MaxMemory = None,
    from_checkpoint: FromCheckpoint = None,
    from_step: FromStep = None,
    trust_checkpoint: TrustCheckpoint = False,
    force: Force = False,
    debug: Debug = False,
) -> None:
    """Run the triage and print a ranked diagnosis. Exit 0 healthy, 1 any error finding, 2 bad input.

    With --train: then run the corrected training; exit 0 when it reaches its last step, 1 when it stops.
    With --capsule DIR: diagnose the saved state and batch of a watched run (see docs/watch.md).
    With --from-checkpoint PATH: every probe starts from a checkpoint's trained state.
    """
    given = training_file

    def job() -> int:
        from . import api
        from .api import LoadedTraining
        from .config import build_config
        from .diagnosis.rules import all_rules
        from .diagnosis.triage import UNEXPLAINED, DiagnoseOptions, stage_names
        from .output.markdown import fixed_config_yaml, junit_xml, markdown
        from .output.terminal import render_diagnosis

        memory_limit = parse_memory_size(max_memory) if max_memory is not None else None
        target = api.capsule_target(capsule, given)
        for path in (report, fix_config, junit, html, figures_folder(report) if report is not None else None):
            if path is not None:
                check_writable(path, force)
        start = checkpoint_start(from_checkpoint, from_step, trust_checkpoint)
        if start is not None and capsule is not None:
            raise DoctorError("give --capsule or --from-checkpoint, not both: each is the state the probes start from.")
        loaded = api.load_target(target, config, **flags(steps=steps, seed=seed, device=device, dtype=dtype))
        loaded = api.start_from_checkpoint(loaded, start)
        options = DiagnoseOptions(
            ci=ci,
            scan_batches=scan_batches,
            max_memory=memory_limit,
            own_process=True,
            recorded_loss_finding=target.recorded_loss_finding,
            capsule=target.replay,
            plots=report is not None or html is not None,
            nproc=nproc,
            rank_timeout=rank_timeout,
        )
        with DiagnosisProgress(err, stage_names()) as progress:
            result = api.diagnose_loaded(loaded, options, on_stage=progress.stage, on_probe_step=progress.probe_step)
        show_notes(result.notes)
        name = str(target.training_file)
        if report is not None:
            from .output.html import write_figures
            from .output.plots import diagnosis_figures

            folder = figures_folder(report)
            figures = write_figures(diagnosis_figures(result), folder)
            atomic_write_text(report, markdown(result, name, [(f, f"{folder.name}/{file}") for f, file in figures]))
        if html is not None:
            from .output.html import diagnosis_html

            atomic_write_text(html, diagnosis_html(result, name))
        if fix_config is not None:
            atomic_write_text(fix_config, fixed_config_yaml(api.corrected_config(result), result, name))
        if junit is not None:
            atomic_write_text(junit, junit_xml(result, name, [r.code for r in all_rules()] + [UNEXPLAINED]))
        if json_:
            print_json(result.to_json())
        else:
            render_diagnosis(result, out, name)
            written = (
                ("report", report),
                ("HTML report", html),
                ("corrected config", fix_config),
                ("JUnit report", junit),
            )
            for label, path in written:
                if path is not None:
                    out.print(f"[dim]{label} written to {path}[/]")
        if not train_:
            return EXIT_OK if result.healthy else EXIT_FINDINGS
        corrected = api.corrected_config(result)
        if train_steps is not None:
            corrected["steps"] = train_steps
        # the spec just diagnosed trains: the user's file is not imported (and its top level run) a second time
        fixed = LoadedTraining(loaded.spec, build_config(corrected, flags(device=device)), corrected)
        run_options = train_options(
            target.training_file, run_dir, checkpoint_every, False, on_nonfinite, max_nonfinite, force
        )
        return run_training(fixed, run_options, nproc, target.training_file, quiet=json_)

    with stdout_for_json_only(json_):
        guarded(debug, job, json_errors=json_)


@app.command()
def train(
    training_file: TrainingFile,
    config: ConfigFile = None,
    steps: Steps = None,
    seed: Seed = None,
    device: Device = None,
    dtype: Dtype = None,
    run_dir: RunDir = None,
    checkpoint_every: CheckpointEvery = 50,
    resume: Resume = False,
    on_nonfinite: OnNonfinite = "skip",
    max_nonfinite: MaxNonfinite = 20,
    nproc: Nproc = 1,
    force: Force = False,
    debug: Debug = False,
) -> None:
    """Run the (corrected) training: every fix of the config applied, checkpoints that survive a crash.

    Exit 0 when it reaches its last step, 1 when it stops on non-finite steps or an exception, 2 bad input, 130 on Ctrl-C.
    """

    def job() -> int:
        from . import api
        from .userfile.spec import notes_under

        loaded = api.load(training_file, config, **flags(steps=steps, seed=seed, device=device, dtype=dtype))
        options = train_options(training_file, run_dir, checkpoint_every, resume, on_nonfinite, max_nonfinite, force)
        code = run_training(loaded, options, nproc, training_file)
        show_notes(notes_under(loaded.spec.notes, loaded.config.compile.enabled))
        return code

    guarded(debug, job)


def train_options(
    training_file: Path,
    run_dir: Path | None,
    checkpoint_every: int,
    resume: bool,
    on_nonfinite: str,
    max_nonfinite: int,
    force: bool,
) -> TrainOptions:
    """Validate the run options; never start a fresh run over an earlier one without asking."""
    from .run.train import TrainOptions, checkpoint_paths

    if on_nonfinite not in ("skip", "stop"):
        raise DoctorError(f"--on-nonfinite must be skip or stop, got '{on_nonfinite}'.")
    directory = run_dir or Path("runs") / training_file.stem
    earlier = checkpoint_paths(directory) + [p for p in (directory / "metrics.csv",) if p.exists()]
    if earlier and not resume:
        if not force and not (
            sys.stdin.isatty()
            and typer.confirm(f"{directory} holds an earlier run. Start over and replace it?", default=False, err=True)
        ):
            raise DoctorError(
                f"'{directory}' holds an earlier run (checkpoints, metrics).",
                hint="Pass --resume to continue it, --run-dir for a new one, or --force to replace it.",
            )
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)
    return TrainOptions(
        run_dir=directory,
        checkpoint_every=checkpoint_every,
        resume=resume,
        on_nonfinite=on_nonfinite,
        max_nonfinite=max_nonfinite,
    )


def run_training(
    loaded: LoadedTraining, options: TrainOptions, nproc: int, training_file: Path, quiet: bool = False
) -> int:
    """The run, its summary, and the exit code."""
    from .output.terminal import render_training
    from .run.launch import run_training as launch

    if nproc == 1:
        with TrainingProgress(err, loaded.config.steps) as progress:
            result = launch(loaded.spec, loaded.config, options, nproc, training_file, on_step=progress.step)
    else:
        result = launch(loaded.spec, loaded.config, options, nproc, training_file)
    render_training(result, options.run_dir, err if quiet else out)
    if result.status == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_OK if result.ok else EXIT_FINDINGS


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def watch(
    command: Annotated[
        list[str] | None,
        typer.Argument(
            help="SCRIPT [ARGS...] (with -m: MODULE [ARGS...]), as you would give them to python.", show_default=False
        ),
    ] = None,
    module: Annotated[bool, typer.Option("-m", help="Run a module, as python -m MODULE does.")] = False,
    capsule_dir: Annotated[
        Path, typer.Option("--capsule-dir", help="Where a replay capsule is written on an alarm.")
    ] = Path("fp16doctor_capsules"),
    skip_streak: Annotated[
        int,
        typer.Option(
            "--skip-streak",
            min=1,
            help="Optimizer steps skipped in a row that raise an alarm (a fresh GradScaler settling from its initial scale may skip up to 10 first).",
        ),
    ] = 5,
    spike_factor: Annotated[
        float,
        typer.Option("--spike-factor", min=1.0, help="A loss above this multiple of the recent median is a spike."),
    ] = 10.0,
    keep_going: Annotated[
        bool,
        typer.Option(
            "--keep-going", help="Go on after an alarm (the capsule is still written; the exit code is still 1)."
        ),
    ] = False,
    checksum_every: Annotated[
        int,
        typer.Option(
            "--checksum-every",
            min=1,
            help="Under torchrun: compare a checksum of the ranks' replicated (DDP) parameters every this many steps.",
        ),
    ] = 100,
    norms_every: Annotated[
        int,
        typer.Option(
            "--norms-every",
            min=1,
            help="With a GradScaler: read the per-layer gradient norms every this many steps (and on every skipped "
            "or non-finite step); 1: every step, for a grad_norm at each step of a capsule's history.",
        ),
    ] = 5,
    rank_timeout: Annotated[
        float | None,
        typer.Option(
            "--rank-timeout",
            min=0.001,
            help="Under torchrun: seconds a rank waits for the others in the watch's own all-gather before it stops "
            "naming it (default: the process group's timeout).",
            show_default=False,
        ),
    ] = None,
    gather_limit_mb: Annotated[
        float,
        typer.Option(
            "--gather-limit-mb",
            min=0.0,
            help="Under torchrun, where the ranks capture a step together (FSDP; DDP with a compression hook): the "
            "largest whole model and optimizer state (MiB) gathered onto rank 0's CPU; past it, each rank saves its "
            "own shards into the capsule (torch.distributed.checkpoint).",
        ),
    ] = 4096.0,
    debug: Debug = False,
) -> None:
    """Run an unmodified training script as python would, watching every optimizer step.

    Healthy: the script's own output and exit code, no file written. On an alarm: a replay capsule, one line
    pointing at it, the run stopped (unless --keep-going), exit 1. Watch options go before SCRIPT.
    """
    words = list(command or [])

    def job() -> int:
        from .live.script import Target, check_target, watch_script
        from .live.watch import WatchOptions

        if not words:
            raise DoctorError(
                "no script given.", hint="fp16doctor watch train.py ARGS, or fp16doctor watch -m package.train ARGS."
            )
        target = Target(words[0], tuple(words[1:]), module=module)
        check_target(target)
        options = WatchOptions(
            capsule_dir=capsule_dir,
            stop_on_alarm=not keep_going,
            skip_streak=skip_streak,
            spike_factor=spike_factor,
            checksum_every=checksum_every,
            norms_every=norms_every,
            rank_timeout=rank_timeout,
            gather_limit_mb=gather_limit_mb,
        )

        def tell(alarm: Alarm) -> None:
            whole_line_to_stderr(alarm.pointer())

        def note(text: str) -> None:
            whole_line_to_stderr(f"fp16doctor: warning: {text}.")

        return watch_script(target, options, on_alarm=tell, on_note=note)

    guarded(debug, job)


# --- logs: a failed run's history, read and classified (nothing is run) ----------------------------------------------


@app.command()
def logs(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Log files or run folders (trainer_state.json or an HF output_dir, metrics.csv, TensorBoard events, "
            "wandb-history.jsonl, a capsule, DeepSpeed/fairseq/Megatron-LM text logs): one run's history.",
            show_default=False,
        ),
    ],
    reference: Annotated[
        list[Path] | None,
        typer.Option("--reference", help="The history of an FP32 run of the same training, to compare the loss with."),
    ] = None,
    json_: Json = False,
    html: HtmlFile = None,
    force: Force = False,
    debug: Debug = False,
) -> None:
    """Read a run's history and name the patterns of trouble in it; nothing is run.

    Exit 0 when no pattern is found, 1 with findings, 2 for a path or format it cannot read.
    """

    def job() -> int:
        from .history import read_logs
        from .output.history import logs_html, render_logs

        if html is not None:
            check_writable(html, force)
        report = read_logs(list(paths), list(reference) if reference else None)
        if html is not None:
            atomic_write_text(html, logs_html(report, [str(p) for p in paths]))
        if json_:
            print_json(report.to_json())
        else:
            render_logs(report, out)
            if html is not None:
                out.print(f"[dim]HTML report written to {html}[/]")
        return EXIT_OK if report.healthy else EXIT_FINDINGS

    with stdout_for_json_only(json_):
        guarded(debug, job, json_errors=json_)


# --- speed: is AMP faster here -------------------------------------------------------------------------------------


@app.command()
def speed(
    training_file: TrainingFile,
    config: ConfigFile = None,
    seed: Seed = None,
    device: Device = None,
    dtype: Dtype = None,
    json_: Json = False,
    html: HtmlFile = None,
    force: Force = False,
    measure: Annotated[
        bool | None,
        typer.Option(
            "--measure/--no-measure",
            help="Apply each change the doctor can (a padded layer, a compiled module, a fused optimizer) and time "
            "the step with it. Default: on a GPU only (a CPU's times do not predict a GPU's).",
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """The training step timed in FP32 and AMP, one AMP step's operators counted, and what would make AMP faster,
    ranked, each change measured where a GPU is present (or with --measure). Exit 0 (it reports; nothing fails),
    2 bad input."""

    def job() -> int:
        from . import api
        from .output.speed import render_speed

        if html is not None:
            check_writable(html, force)
        with err.status("timing FP32 and AMP, then counting one AMP step's operators"):
            report = api.speed(
                training_file,
                config_file=config,
                measure_advice=measure,
                **flags(seed=seed, device=device, dtype=dtype),
            )
        if html is not None:
            from .output.html import speed_html

            atomic_write_text(html, speed_html(report, str(training_file)))
        if json_:
            print_json(report.to_json())
        else:
            render_speed(report, out)
            if html is not None:
                out.print(f"[dim]HTML report written to {html}[/]")
        return EXIT_OK

    with stdout_for_json_only(json_):
        guarded(debug, job, json_errors=json_)


# --- serve-check: the trained model served in half precision ------------------------------------------------------


@app.command("serve-check")
def serve_check(
    training_file: TrainingFile,
    checkpoint: Annotated[
        Path | None,
        typer.Option("--checkpoint", help="The trained weights to serve (torch.save, Lightning .ckpt, HF folder)."),
    ] = None,
    tolerance: Annotated[
        float,
        typer.Option(
            "--tolerance", help="Safe when every output's deviation from FP32 is within this share of its size."
        ),
    ] = 1e-2,
    batches: Annotated[int, typer.Option("--batches", min=1, help="Batches of data() to serve.")] = 4,
    onnx: Annotated[
        bool,
        typer.Option(
            "--onnx",
            help="Also export to ONNX, convert to fp16 with the keep-set as the block list, and run it on onnxruntime "
            "(pip install 'fp16doctor\\[onnx]').",
        ),
    ] = False,
    onnx_out: Annotated[
        Path | None,
        typer.Option("--onnx-out", help="Write the fp16 ONNX conversion a release would ship here (implies --onnx)."),
    ] = None,
    config: ConfigFile = None,
    seed: Seed = None,
    trust_checkpoint: TrustCheckpoint = False,
    force: Force = False,
    json_: Json = False,
    debug: Debug = False,
) -> None:
    """Serve the trained model in fp16 (model.half()), fp16 autocast and bf16 against FP32; where fp16 fails, the
    modules to keep in fp32, verified. With --onnx, the fp16 ONNX conversion too. Exit 0 safe in fp16, 1 unsafe,
    2 bad input."""

    def job() -> int:
        from . import api
        from .output.serving import render_serve_check

        if onnx_out is not None:
            api.writable_file(onnx_out)  # a folder, or a path under a file, before "already exists"
            check_writable(onnx_out, force)
        start = api.CheckpointStart(checkpoint, trust=trust_checkpoint) if checkpoint is not None else None
        result = api.serve_check(
            training_file,
            tolerance=tolerance,
            batches=batches,
            checkpoint=start,
            onnx=onnx,
            onnx_out=onnx_out,
            overwrite=True,  # check_writable asked, or had --force
            config_file=config,
            **flags(seed=seed),
        )
        if json_:
            print_json(result.to_json())
        else:
            render_serve_check(result, out)
        return EXIT_OK if result.safe else EXIT_FINDINGS

    with stdout_for_json_only(json_):
        guarded(debug, job, json_errors=json_)


@app.command()
def rules() -> None:
    """List the cause codes with what each rule looks for."""
    from rich.table import Table

    from .diagnosis.rules import all_rules

    table = Table(title="Causes fp16doctor diagnoses", title_justify="left", show_lines=True)
    for column in ("code", "severity", "what it means, and the evidence"):
        table.add_column(column, overflow="fold")
    for rule in all_rules():
        table.add_row(rule.code, rule.severity, rule.doc())
    out.print(table)


def write_csv(path: Path, frames: dict[str, pd.DataFrame]) -> None:
    """All modes' records in one CSV with a ``mode`` column, written atomically."""
    import pandas as pd

    table = pd.concat([frame.assign(mode=mode) for mode, frame in frames.items()], ignore_index=True)
    atomic_write_text(path, table.to_csv(index=False))


def run() -> None:  # console-script entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    run()
