"""The training as it runs parallelised: probes under torchrun, for ``diagnose --nproc N``.

Every rank builds the probes from the same seeded weights and takes, of every N consecutive batches, its own one
(as ``train --nproc`` does), wraps the model as the training file's ``parallelize(model)`` does (DDP when the file
defines none) and steps it. Three passes run, each from the initial weights:

* ``fp32``: the FP32 baseline in the same topology, its gradients reduced in fp32;
* ``as_run``: AMP as configured, the reduction as the training makes it (its communication hook), measured
  against the same reduction in fp32 (:mod:`.reduction`);
* ``fp32_reduce``: the same AMP training with its reduction made in fp32: the fix, tried.

Rank 0 writes the passes' records (the loss averaged over the ranks: the global batch's), the reduction tables
and every rank's fingerprint to ``result.pkl``. Each rank writes where it is to ``rank{r}.json`` as it goes: the
launching process stops a run in which no rank moved for ``rank_timeout`` seconds, and says where each was.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pickle
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..config import DoctorConfig, build_config
from ..errors import DoctorError, RankTimeoutError, TrainingFileError
from ..files import atomic_write_bytes, atomic_write_text
from ..tensors import parameter_sums
from ..userfile.modules import PARALLEL_WRAPPERS, fsdp2_param_groups
from ..userfile.spec import load_training_file
from .probe import Probe, Workbench
from .rank_launcher import launch_command, leave_process_group
from .reduction import ReductionMeter

PASSES = (("fp32", "fp32", True), ("as_run", None, False), ("fp32_reduce", None, True))
"""(name, mode (None: the diagnosed AMP mode), the reduction made in fp32): the diagnosis's passes."""
COMPARED_PASSES = (("amp", "amp", False), ("bf16", "bf16", False))
"""``compare --nproc``'s modes beside ``fp32``, each a pass of its own, its reduction as the training makes it."""


@dataclass(frozen=True)
class ParallelRequest:
    """What every rank runs: the training file, the resolved config, the steps and the AMP mode."""

    training_file: str
    config: dict[str, Any]
    steps: int
    mode: str
    """``amp`` (fp16) or ``bf16``: the low-precision mode the diagnosis probes."""
    passes: tuple[str, ...] = tuple(name for name, _, _ in PASSES)
    """The passes to run: all three, only ``as_run`` where a run at another world size measures its reduction, or
    ``compare``'s modes (``fp32``, ``amp``, ``bf16``)."""
    aligned: bool = False
    """Run each pass aligned on optimizer steps taken (a skipped step retries its batch), as ``compare`` does: the
    passes are then compared step by step."""


@dataclass
class ParallelPass:
    """One pass's measurement, on rank 0."""

    records: pd.DataFrame
    """The probe's step records (rank 0's), the loss the mean over the ranks."""
    reduction: pd.DataFrame
    """Per parameter: the reduction against fp32 (:meth:`~.reduction.ReductionMeter.table`); empty where the
    topology's reduction is not measured (FSDP1's flat parameters)."""
    fingerprints: list[dict[str, float]]
    """Per rank, after the pass: the parameters' sum and absolute sum, the loss scale and the skipped steps."""
    loss_dtypes: list[str] = field(default_factory=list)
    """The dtypes the loss came out in (rank 0's, as the scaler was handed it): what the loss was computed in."""


@dataclass
class ParallelResult:
    """The three passes of a parallel run, and its topology."""

    world: int
    topology: str
    """The class of what ``parallelize()`` returned (``DistributedDataParallel`` by default)."""
    parallelized_by: str
    """``parallelize()`` (the training file's) or ``DistributedDataParallel`` (the doctor's default)."""
    hooks: list[str]
    """The communication hooks the training registers (empty: DDP's default all-reduce)."""
    policy: dict[str, Any] | None = None
    """FSDP's mixed-precision policy (``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``
    for FSDP2; FSDP1's ``MixedPrecision`` fields), None for DDP or no policy."""
    scaler_enabled: bool | None = None
    """Whether the AMP pass's GradScaler (the doctor's own, as the probe runs it) scaled the loss."""
    passes: dict[str, ParallelPass] = field(default_factory=dict)
    seconds: float = 0.0


# --- the launching side ----------------------------------------------------------------------------------
def run_parallel(
    request: ParallelRequest, world: int, workdir: Path, rank_timeout: float, poll_seconds: float = 0.5
) -> ParallelResult:
    """torchrun with ``world`` processes of this module; the result rank 0 wrote. A rank's bad input is raised here
    as its :class:`DoctorError`; a run in which no rank moved for ``rank_timeout`` s is stopped."""
    workdir.mkdir(parents=True, exist_ok=True)
    launch = workdir / "launch.json"
    atomic_write_text(launch, json.dumps({**asdict(request), "rank_timeout": rank_timeout}))
    command = launch_command(world, f"{__name__}:main", str(launch))
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output = _wait_moving(proc, workdir, world, rank_timeout, poll_seconds)
    _raise_rank_error(workdir, world, proc.returncode, output)
    with open(workdir / "result.pkl", "rb") as handle:
        result: ParallelResult = pickle.load(handle)
    result.seconds = time.perf_counter() - began
    return result


def _wait_moving(proc: subprocess.Popen[bytes], workdir: Path, world: int, timeout: float, poll: float) -> str:
    """Wait for torchrun, stopping it where no rank moved for ``timeout`` s (each rank's file is its heartbeat)."""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    chunks: list[bytes] = []
    last_move = time.monotonic()
    seen = 0.0
    while proc.poll() is None:
        time.sleep(poll)
        chunks.append(proc.stdout.read() or b"")
        moved = max((_mtime(workdir / f"rank{r}.json") for r in range(world)), default=0.0)
        if moved > seen:
            seen, last_move = moved, time.monotonic()
        if time.monotonic() - last_move > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RankTimeoutError(
                f"the {world}-process run stopped moving: no rank moved for {timeout:.0f} s. "
                + "; ".join(_where(workdir, r) for r in range(world))
                + ".",
                hint="A rank that never reaches a collective the others wait in (a rank-dependent branch, a "
                "rank that stalls) hangs them all; --rank-timeout sets how long the doctor waits.",
            )
    os.set_blocking(proc.stdout.fileno(), True)
    chunks.append(proc.stdout.read() or b"")
    return b"".join(chunks).decode(errors="replace")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _where(workdir: Path, rank: int) -> str:
    try:
        state = json.loads((workdir / f"rank{rank}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return f"rank {rank} never started"
    return f"rank {rank} was in {state['where']}"


def _raise_rank_error(workdir: Path, world: int, returncode: int, output: str) -> None:
    for rank in range(world):
        path = workdir / f"error{rank}.json"
        if path.exists():
            error = json.loads(path.read_text())
            raise TrainingFileError(
                f"rank {rank}: {error['message']}", hint=error.get("hint", ""), location=error.get("location")
            )
    if returncode != 0 or not (workdir / "result.pkl").exists():
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise DoctorError(
            f"the parallel run failed (its launcher's exit code {returncode}):\n{tail}",
            hint="Run the diagnosis without --nproc to see whether the training fails in one process too.",
        )


# --- each rank ---------------------------------------------------------------------------------------------
class Rank:
    """One torchrun process: its place, its heartbeat file and its own groups."""

    def __init__(self, workdir: Path, timeout: float):
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.workdir = workdir
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.distributed.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout)
        )
        self.group = torch.distributed.new_group(backend="gloo")  # the doctor's own collectives, never DDP's

    def at(self, where: str) -> None:
        """Say where this rank is (the launcher's heartbeat)."""
        atomic_write_text(self.workdir / f"rank{self.rank}.json", json.dumps({"where": where}))

    def any(self, flag: bool) -> bool:
        value = torch.tensor([1.0 if flag else 0.0])
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(value.item() > 0)

    def mean(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(tensor, group=self.group)
        return (tensor / self.world).tolist()

    def gather(self, item: dict[str, float]) -> list[dict[str, float]]:
        items: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(items, item, group=self.group)
        return items


def main(argv: list[str]) -> int:
    launch = Path(argv[0])
    request_fields = json.loads(launch.read_text())
    timeout = float(request_fields.pop("rank_timeout"))
    request = ParallelRequest(**{**request_fields, "passes": tuple(request_fields["passes"])})
    rank = Rank(launch.parent, timeout)
    try:
        rank.at("loading the training file")
        result = run_passes(request, rank)
        if rank.rank == 0:
            atomic_write_bytes(launch.parent / "result.pkl", pickle.dumps(result))
        rank.at("done")
        return 0
    except DoctorError as exc:
        error = {"message": exc.message, "hint": exc.hint, "location": exc.location}
        atomic_write_text(launch.parent / f"error{rank.rank}.json", json.dumps(error))
        return 2
    finally:
        leave_process_group()


def run_passes(request: ParallelRequest, rank: Rank) -> ParallelResult:
    spec = load_training_file(request.training_file)
    config = build_config(request.config)
    bench = Workbench(spec, config, batch_count=request.steps * rank.world)
    bench.batches = bench.batches[rank.rank :: rank.world]  # of every N consecutive batches, this rank's own
    result: ParallelResult | None = None
    policies: list[dict[str, Any] | None] = []
    for name, mode, repair in PASSES + COMPARED_PASSES:
        if name not in request.passes:
            continue
        meter = ReductionMeter(repair=repair)

        def wrap(model: torch.nn.Module, meter: ReductionMeter = meter, name: str = name) -> torch.nn.Module:
            wrapped = _parallelize(spec, model, meter, rank, name)
            policies.append(policy_of(wrapped))
            if name == "fp32":
                full_precision_policies(wrapped)
            return wrapped

        probe = bench.probe(
            mode or request.mode, config, instruments=None, parallelize=wrap, align_on_taken_steps=request.aligned
        )
        try:
            result = result or ParallelResult(
                rank.world, type(probe.model).__name__, _by(spec), list(meter.hook_names), policies[0]
            )
            result.passes[name] = _run_pass(probe, meter, rank, name, request.steps)
            if name in ("as_run", "amp"):
                result.scaler_enabled = bool(probe.scaler.is_enabled())
        finally:
            probe.close()
    assert result is not None
    return result


def _by(spec: Any) -> str:
    return "parallelize()" if spec.parallelize is not None else "DistributedDataParallel"


def _parallelize(spec: Any, model: torch.nn.Module, meter: ReductionMeter, rank: Rank, name: str) -> torch.nn.Module:
    """Wrap the probe's model as the training does, before its optimizers are made (FSDP shards the parameters
    they must hold); its DDP's reduction measured (or made in fp32)."""
    rank.at(f"parallelize() ({name} pass)")
    if _already_parallel(model):
        raise TrainingFileError(
            f"model() returns a {type(model).__name__}: under --nproc the doctor wraps the model itself.",
            hint="Return the plain model from model() and wrap it in parallelize(model) -> model, as your "
            "training does (DDP, FSDP); without parallelize() the doctor uses DistributedDataParallel.",
        )
    meter.names = {id(p): n for n, p in model.named_parameters()}
    with meter.around_registration():
        if spec.parallelize is None:
            wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
        else:
            wrapped = spec.parallelized(model)
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        meter.attach(wrapped)
    return wrapped


def _already_parallel(model: torch.nn.Module) -> bool:
    """DDP, DataParallel, FSDP1 or a ``fully_shard``-ed module (FSDP2 swaps the class for an ``FSDP...`` one)."""
    return isinstance(model, PARALLEL_WRAPPERS) or any(
        "FSDP" in cls.__name__ or cls.__name__ == "FullyShardedDataParallel" for cls in type(model).__mro__
    )


def _run_pass(probe: Probe, meter: ReductionMeter, rank: Rank, name: str, steps: int) -> ParallelPass:
    """``steps`` steps; aligned, until that many optimizer steps were taken (at most as many tries as ``compare``'s
    own probes make), stopping at a non-finite loss as they do. Every rank stops where one stopped."""
    limit = 2 * steps + 32 if probe.align else steps
    taken = 0
    with meter.around_registration():  # a hook the training's step registers itself is measured too
        for step in range(limit):
            rank.at(f"step {step} of the {name} pass (its forward, backward and gradient reduction)")
            meter.step = step
            record = probe.step()
            taken += 0 if record.skipped else 1
            stop = probe.failed is not None or (probe.align and (record.nonfinite_loss or taken >= steps))
            if rank.any(stop):
                break
    rank.at(f"comparing the ranks after the {name} pass")
    records = probe.frame()
    if len(records):
        records["loss"] = rank.mean([float(v) for v in records["loss"].fillna(float("nan"))])
    dtypes = sorted({r.trace.loss_dtype for r in probe.records if r.trace and r.trace.loss_dtype})
    return ParallelPass(records, meter.table(), rank.gather(_fingerprint(probe)), dtypes)


def _fingerprint(probe: Probe) -> dict[str, float]:
    """What every rank must agree on: the whole parameters (gathered from FSDP's shards), the scale, the skips."""
    scaler = probe.scaler
    return {
        **parameter_sums(probe.model.parameters()),
        "loss_scale": float(scaler.get_scale()) if scaler.is_enabled() else 1.0,
        "skipped": float(sum(1 for r in probe.records if r.skipped)),
    }


def fingerprints_agree(fingerprints: list[dict[str, float]]) -> bool:
    """Every rank's fingerprint equals rank 0's (NaN equal to NaN: ranks whose weights all went NaN agree)."""
    first = fingerprints[0]
    return all(all(_same(f[key], first[key]) for key in first) for f in fingerprints[1:])


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def policy_of(model: torch.nn.Module) -> dict[str, Any] | None:
    """FSDP2's ``MixedPrecisionPolicy`` or FSDP1's ``MixedPrecision`` of a wrapped model, its dtypes as strings."""
    get_state = getattr(model, "_get_fsdp_state", None)
    policy = (
        getattr(get_state(), "_mp_policy", None) if callable(get_state) else getattr(model, "mixed_precision", None)
    )
    if policy is None:
        return None
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype", "cast_forward_inputs")
    found = {name: getattr(policy, name) for name in fields if hasattr(policy, name)}
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v for k, v in found.items()}


def full_precision_policies(model: torch.nn.Module) -> None:
    """The FP32 baseline in the training's own topology: every ``fully_shard``-ed module's ``MixedPrecisionPolicy``
    made fp32 (parameters, reduction and outputs in the parameters' own dtype). FSDP2 reads the policy into its
    parameters' dtypes lazily, at the first forward, so replacing it before then is as if the user had passed none.
    FSDP1's ``MixedPrecision`` is applied at wrapping and stays (its reduction is not measured either)."""
    fp32 = _fsdp2_default_policy()
    if fp32 is None:
        return
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if not callable(get_state):
            continue
        state = get_state()
        state._mp_policy = fp32
        for group in fsdp2_param_groups(state):
            group.mp_policy = fp32


def _fsdp2_default_policy() -> Any:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    return MixedPrecisionPolicy()


GROWTH_WORLDS = (2, 4)
"""The world sizes at which the reduction's error is measured, beside ``--nproc``'s."""


def growth_worlds(world: int) -> tuple[list[int], dict[int, str]]:
    """The world sizes of :data:`GROWTH_WORLDS` other than ``world`` that this machine runs, and why the others not.

    On CPU every one runs: gloo's processes share the cores (four ranks on two cores are slower, not wrong, and the
    growth run is one pass of a few steps). On CUDA each rank needs a GPU of its own (nccl cannot put two ranks of
    one group on one device), so a world larger than the GPUs is not run."""
    others = [w for w in GROWTH_WORLDS if w != world]
    if not torch.cuda.is_available():
        return others, {}
    gpus = torch.cuda.device_count()
    skipped = {w: f"{w} ranks need {w} GPUs, this machine has {gpus}" for w in others if w > gpus}
    return [w for w in others if w not in skipped], skipped


def request_for(
    training_file: Path, config: DoctorConfig, steps: int, compared: tuple[str, ...] | None = None
) -> ParallelRequest:
    """The diagnosis's passes, or with ``compared`` (``compare``'s modes) those, aligned."""
    mode = "bf16" if config.dtype == "bfloat16" else "amp"
    request = ParallelRequest(str(Path(training_file).resolve()), config.to_dict(), steps, mode)
    return request if compared is None else dataclasses.replace(request, passes=compared, aligned=True)
