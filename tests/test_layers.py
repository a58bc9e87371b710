"""The package layout is the architecture: each layer imports only the layers below it.

Read from the source with ``ast`` (nothing is imported), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp16doctor"

CORE_MODULES = {"config", "errors", "files", "tensors", "__init__"}
"""Top-level modules every layer may use: configuration, the exception family, atomic files, tensor helpers."""

ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "userfile": {"core"},
    "precision": {"core", "userfile"},
    "engine": {"core", "userfile", "precision"},
    "measure": {"core", "userfile", "precision", "engine"},
    "diagnosis": {"core", "userfile", "precision", "engine", "measure"},
    "output": {"core", "measure", "diagnosis", "history"},
    "run": {"core", "userfile", "precision", "engine", "measure"},
    "live": {"core", "userfile", "precision", "engine"},
    "history": {"core", "measure"},
    "public": {"live"},
    "api": {"core", "userfile", "engine", "measure", "diagnosis", "run", "live", "public"},
    "cli": {"core", "userfile", "engine", "measure", "diagnosis", "output", "run", "live", "api", "history"},
}
"""What each layer may import. ``output`` renders records and never measures (no engine); ``live`` runs
inside someone else's training and never pulls in the diagnosis; ``public`` are the stable import paths
(``fp16doctor.watch``, ``fp16doctor.integrations.*``) that re-export ``live``; ``api`` (``fp16doctor.diagnose``,
``compare``, ``load``) runs what the commands run and returns records, never rendering them (no ``output``);
``history`` reads what a finished run left behind and runs nothing (the thresholds of ``measure``, no engine)."""


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in CORE_MODULES:
        return "core"
    if parts[1] in ("cli", "__main__"):
        return "cli"
    if parts[1] in ("integrations", "watch"):
        return "public"
    if parts[1] == "api":
        return "api"
    return parts[1]


def package_imports() -> list[tuple[str, str, int]]:
    """(importing module, imported fp16doctor module, line) for every import in the package."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                targets = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp16doctor"):
                targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("fp16doctor")]
            else:
                continue
            found.extend((module, target, node.lineno) for target in targets)
    return found


def test_every_layer_is_known():
    layers = {layer_of(importer) for importer, _, _ in package_imports()}
    assert layers <= set(ALLOWED), f"modules outside the known layers: {layers - set(ALLOWED)}"
    assert {"userfile", "precision", "engine", "measure", "diagnosis", "output", "run", "live"} <= layers


def test_imports_follow_the_layering():
    wrong = []
    for importer, target, line in package_imports():
        # the root package: its __version__ is core to everyone, and what it hands out (the public API) is api's
        source, dest = "api" if importer == "fp16doctor" else layer_of(importer), layer_of(target)
        if source != dest and dest not in ALLOWED[source]:
            wrong.append(f"{importer}:{line} ({source}) imports {target} ({dest})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("importer", "target", "expected"),
    [
        ("fp16doctor.live.watch", "fp16doctor.diagnosis.triage", False),
        ("fp16doctor.measure.compare", "fp16doctor.output.terminal", False),
        ("fp16doctor.engine.probe", "fp16doctor.measure.localise", False),
        ("fp16doctor.output.terminal", "fp16doctor.diagnosis.findings", True),
        ("fp16doctor.api", "fp16doctor.output.terminal", False),
        ("fp16doctor.cli", "fp16doctor.api", True),
    ],
)
def test_the_table_refuses_what_it_should(importer, target, expected):
    """The check itself can fail: a live module importing the diagnosis is against the layering."""
    assert (layer_of(target) in ALLOWED[layer_of(importer)]) is expected


def test_live_watch_loads_no_diagnosis_in_a_fresh_process():
    """Inside someone else's training only the watch is loaded: not the diagnosis, not the renderers."""
    code = (
        "import sys, fp16doctor.watch, fp16doctor.live.watch; "
        "print(sorted(m for m in sys.modules if m.startswith(('fp16doctor.diagnosis', 'fp16doctor.output'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


ENGINE_MODULES = (
    "fp16doctor.engine.probe",
    "fp16doctor.engine.instruments",
    "fp16doctor.diagnosis.stages",
    "fp16doctor.diagnosis.triage",
    "fp16doctor.diagnosis.interventions",
    "fp16doctor.measure.localise",
    "fp16doctor.measure.numerics",
)
"""What runs trainings: the probe and its instruments, the stages, the diagnosis engine and its search, the
measurements that drive a probe. A rule and its hand-built cases read evidence types only."""


def test_a_rule_and_its_cases_load_no_engine_in_a_fresh_process():
    """Importing every rule module and ``diagnosis.rule_cases`` (which builds their cases) loads none of the
    engine; importing the diagnosis engine afterwards does load each of them (so the names checked are real).
    One process for all: what none of them loads together, no single one of them loads alone."""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import fp16doctor.diagnosis.rules as rules\n"
        "names = ['fp16doctor.diagnosis.rules.' + m.name for m in pkgutil.iter_modules(rules.__path__)]\n"
        "for name in names + ['fp16doctor.diagnosis.rule_cases']:\n"
        "    importlib.import_module(name)\n"
        f"watched = {ENGINE_MODULES!r}\n"
        "def loaded(): return sorted(w for w in watched if any(m == w or m.startswith(w + '.') for m in sys.modules))\n"
        "before = loaded()\n"
        "import fp16doctor.diagnosis\n"
        "fp16doctor.diagnosis.diagnose  # the lazy package hands out the engine on first use\n"
        "print(json.dumps({'rules': len(names), 'before': before, 'after': loaded()}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout)
    assert seen["rules"] >= 20  # every rule module was imported, not an empty package
    assert seen["before"] == [], f"a rule or its cases loads the engine: {seen['before']}"
    assert seen["after"] == sorted(ENGINE_MODULES)
