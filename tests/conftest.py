"""Shared helpers: sample paths, throw-away training files, running the CLI."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import prewarmed
import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"

# CI has 2 cores: one thread per xdist worker (two workers share them), two in a single process
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # ...and one in every fresh process a worker starts (the CLI, scripts, torchrun's ranks inherit it): each would
    # otherwise take a thread per core, and OpenMP threads spinning on cores the other worker's process holds make
    # two diagnoses side by side on 2 cores take 7 times as long as one alone.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def training_file(tmp_path):
    """Write a training file from source text and return its path."""

    def write(source: str, name: str = "train_me.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 300, env: dict[str, str] | None = None, cold: bool = False
) -> subprocess.CompletedProcess:
    """Run ``python -m fp16doctor`` in a fresh process, as a user would, capturing stdout and stderr apart.

    The process is forked from this worker's pre-importing server (:mod:`prewarmed`: torch and dynamo imported
    once), unless ``cold`` or the environment changes how torch imports: then it is a cold ``python`` process."""
    full_env = {**os.environ, "COLUMNS": "160", **(env or {})}
    if cold or prewarmed.SERVER.differs_at_import(full_env):
        return subprocess.run(
            [sys.executable, "-m", "fp16doctor", *map(str, args)],
            capture_output=True,
            text=True,
            cwd=cwd or ROOT,
            timeout=timeout,
            env=full_env,
        )
    return prewarmed.SERVER.run([str(a) for a in args], cwd or ROOT, full_env, timeout)


@dataclass(frozen=True)
class CiDiagnosis:
    """What ``diagnose PATH --ci --json --fix-config F`` did in a fresh process."""

    returncode: int
    stdout: str
    stderr: str
    fix_config: str | None
    """The corrected config it wrote, when it wrote one."""

    def report(self) -> dict:
        return json.loads(self.stdout)


SHARED_RUNS = "FP16DOCTOR_TEST_SHARED_RUNS"
"""The environment variable naming the folder where the session's workers share the fresh-process diagnoses they
ran: the controller makes it before the workers start (they inherit it) and removes it when the session ends."""


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        os.environ[SHARED_RUNS] = tempfile.mkdtemp(prefix="fp16doctor-tests-")


def pytest_unconfigure(config):
    prewarmed.SERVER.close()
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(SHARED_RUNS, ""), ignore_errors=True)


COLD_SAMPLES = frozenset(sorted(SAMPLES.glob("*.py"))[::3])
"""The sample models whose diagnoses run in a cold process (one in three, causes and healthy ones alike): a fresh
interpreter that imports torch and dynamo itself, as a user's first run does. The others fork from the pre-importing
server, which has imported nothing of fp16doctor's either (:mod:`prewarmed`)."""


def diagnose_ci(path: Path, *extra: str, env: dict[str, str] | None = None) -> CiDiagnosis:
    """``diagnose PATH --ci --json`` in a fresh process, as a user runs it, once per test session.

    The suite checks many files from several angles (the right cause, no error without a symptom, the corrected
    config healthy): every test that asks for the same file and arguments reads the one run, whichever xdist worker
    made it; a worker asking while another runs it waits for that run."""
    if "--fix-config" in extra:
        raise ValueError("diagnose_ci writes the corrected config itself: read CiDiagnosis.fix_config")
    key = json.dumps([str(Path(path).resolve()), extra, sorted((env or {}).items())])
    folder = Path(os.environ[SHARED_RUNS]) / hashlib.sha256(key.encode()).hexdigest()[:20]
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "run.json"
    with FileLock(str(folder / "lock")):
        if not done.exists():
            fixed = folder / "fixed.yaml"
            cold = Path(path).resolve() in COLD_SAMPLES
            proc = run_cli("diagnose", path, "--ci", "--json", *extra, "--fix-config", fixed, env=env, cold=cold)
            text = fixed.read_text() if fixed.exists() else None
            record = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "fix_config": text}
            done.write_text(json.dumps(record))
        return CiDiagnosis(**json.loads(done.read_text()))


MLP_FILE = """
import torch
from torch import nn

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(6)]
"""


@functools.cache
def diagnosed(sample: str, patch: str = "{}", ci: bool = False):
    """(the user's config layers, the diagnosis) of a sample model, cached for the whole session."""
    from fp16doctor.config import build_config
    from fp16doctor.diagnosis import DiagnoseOptions, diagnose
    from fp16doctor.userfile.spec import load_training_file

    spec = load_training_file(SAMPLES / sample)
    layers = {**spec.config, **json.loads(patch)}
    config = build_config(layers, {"device": "cpu"})
    return layers, diagnose(spec, config, DiagnoseOptions(ci=ci))


END_TO_END_CALLS = (
    # a fresh Python process: what only it shows (imports, sys.modules, exit codes, the CLI as a user runs it)
    "run_cli(",
    "diagnose_ci(",
    "subprocess.",
    "sys.executable",
    # a whole diagnosis, training run or watched training of a training file, in this process
    "diagnosed(",
    "diagnose(",
    "Trainer(",
    "run_target(",
    ".fit(",
    "trainer.train(",
)
"""What a test that runs the product end to end calls: such a test is ``e2e``; the fast tier leaves it out."""


def _calls_end_to_end(function: object, module: object, seen: set[int], depth: int = 3) -> bool:
    """Whether ``function``'s source, or that of a module-level helper it calls (three calls deep), runs the
    product end to end."""
    if id(function) in seen or depth < 0:
        return False
    seen.add(id(function))
    try:
        source = inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    if any(call in source for call in END_TO_END_CALLS):
        return True
    code = getattr(function, "__code__", None)
    helpers = [getattr(module, name, None) for name in (code.co_names if code is not None else ())]
    return any(
        inspect.isfunction(h)
        and h.__module__ == getattr(module, "__name__", None)
        and _calls_end_to_end(h, module, seen, depth - 1)
        for h in helpers
    )


def runs_end_to_end(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    module = getattr(item, "module", None)
    if function is None:
        return False
    seen: set[int] = set()
    if _calls_end_to_end(function, module, seen):
        return True
    fixtures = getattr(item, "_fixtureinfo", None)
    definitions = fixtures.name2fixturedefs.values() if fixtures is not None else ()
    return any(_calls_end_to_end(d[-1].func, module, seen) for d in definitions if d and d[-1].func is not None)


SPREAD_OVER_WORKERS = "SPREAD_OVER_WORKERS"
"""A test module that sets this true has its tests spread over the xdist workers one by one; every other module's
tests run on one worker together (``--dist loadgroup``), so that what a module caches in its process (a diagnosis,
a module-scoped fixture) is computed once. Spread the modules of many independent fresh-process runs: a module of 75
runs on one worker would be the suite's critical path."""


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config, items):
    """Tests that run the product end to end are marked ``e2e`` (the fast tier, ``-m "not e2e"``, leaves them out);
    tests marked ``cuda`` need a GPU: skipped where there is none (CI is CPU-only). A module's tests are one xdist
    group unless the module spreads them (:data:`SPREAD_OVER_WORKERS`)."""
    for item in items:
        if "e2e" not in item.keywords and runs_end_to_end(item):
            item.add_marker(pytest.mark.e2e)
        if (
            not getattr(getattr(item, "module", None), SPREAD_OVER_WORKERS, False)
            and item.get_closest_marker("xdist_group") is None
        ):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
