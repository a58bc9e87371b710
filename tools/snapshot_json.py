"""Snapshot the doctor's JSON for a refactor: every sample's and training file's ``diagnose --json`` and every
rule case's findings, written to a folder; ``--compare A B`` then compares two snapshots key by key.

Timings (``seconds``) differ run to run and are left out of the comparison; everything else must be equal.

    python tools/snapshot_json.py cases OUT        # the rules' own cases (seconds)
    python tools/snapshot_json.py files OUT [--training-files]   # each sample in a fresh CLI process (minutes)
    python tools/snapshot_json.py --compare BEFORE AFTER
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def rule_cases(out: Path) -> None:
    from fp16doctor.diagnosis.rules import all_rules

    out.mkdir(parents=True, exist_ok=True)
    for rule in all_rules():
        for kind, cases in (("fires", rule.fires_on), ("quiet", rule.quiet_on)):
            for i, case in enumerate(cases):
                found = [f.to_json() for f in rule.check(case())]
                (out / f"{rule.code}.{kind}.{i}.json").write_text(json.dumps(found, indent=1, sort_keys=True))
        for i, case in enumerate(rule.names_cases):
            repair, evidence = case()
            found = rule.repair_finding(repair, evidence).to_json()
            (out / f"{rule.code}.names.{i}.json").write_text(json.dumps(found, indent=1, sort_keys=True))


def files(out: Path, training_files: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    paths = sorted((ROOT / "sample_models").glob("*.py"))
    if training_files:
        paths += sorted((ROOT / "tests" / "training_files").glob("*.py"))
    for path in paths:
        proc = subprocess.run(
            [sys.executable, "-m", "fp16doctor", "diagnose", str(path), "--json", "--ci"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        (out / f"{path.parent.name}.{path.stem}.json").write_text(proc.stdout)
        print(path.name, proc.returncode, flush=True)


def without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in {'before' if k in a else 'after'}" for k in sorted(set(a) ^ set(b))]
        for key in sorted(set(a) & set(b)):
            out += differences(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:200]} -> {json.dumps(b)[:200]}"]


def compare(before: Path, after: Path) -> int:
    bad = 0
    for old in sorted(before.glob("*.json")):
        new = after / old.name
        if not new.exists():
            print(f"{old.name}: missing after")
            bad += 1
            continue
        try:
            a, b = (without_timings(json.loads(p.read_text() or "null")) for p in (old, new))
        except json.JSONDecodeError as exc:
            print(f"{old.name}: not JSON ({exc})")
            bad += 1
            continue
        diff = differences(a, b)
        if diff:
            bad += 1
            print(f"{old.name}: {len(diff)} difference(s)")
            for line in diff[:8]:
                print("   ", line)
    print(f"{len(list(before.glob('*.json')))} compared, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "--compare":
        sys.exit(compare(Path(args[1]), Path(args[2])))
    elif args[0] == "cases":
        rule_cases(Path(args[1]))
    else:
        files(Path(args[1]), "--training-files" in args)
