"""Small readers over the evidence that several rules share (no rule lives here)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ...engine.records import Column, Inventory, Reading, Table
from ...measure.records import ROOT, FlushedConstant, Localisation
from ...tensors import FP16_MAX
from ..findings import Evidence, ProbeSummary

LOW_DTYPES = ("float16", "bfloat16")
NORM_TYPES = ("BatchNorm", "LayerNorm", "GroupNorm", "InstanceNorm", "RMSNorm", "LocalResponseNorm", "SyncBatchNorm")


def fp32_finite(ev: Evidence) -> bool:
    return ev.fp32 is not None and ev.fp32.finite


def fp32_losses(ev: Evidence, min_steps: int) -> list[float] | None:
    """The FP32 baseline's per-step losses, when it ran without an exception for at least ``min_steps`` steps, all
    finite: the trend the loss warnings read (a non-finite loss is other rules' evidence); else None."""
    fp32 = ev.fp32
    if fp32 is None or fp32.exception is not None:
        return None
    losses = [float(v) for v in fp32.records[Column.LOSS]]
    if len(losses) < min_steps or not all(math.isfinite(v) for v in losses):
        return None
    return losses


def module_abs_max(summary: ProbeSummary | None, module: str) -> float | None:
    """Largest forward output magnitude of ``module`` over the probe (None if not recorded, or non-finite at every
    step: a non-finite output's ``abs_max`` is NaN, not measured)."""
    rows = _forward_rows(summary, module, Reading.ABS_MAX)
    peak = float(rows[Reading.ABS_MAX].max()) if rows is not None and len(rows) else math.nan  # pandas' max skips NaN
    return None if math.isnan(peak) else peak


def _forward_rows(summary: ProbeSummary | None, module: str, column: str) -> pd.DataFrame | None:
    """The probe's forward-table rows of ``module``, or None where the table or its ``column`` was not recorded."""
    if summary is None or Table.FORWARD not in summary.tables or summary.tables[Table.FORWARD].empty:
        return None
    rows = summary.tables[Table.FORWARD]
    return rows[rows[Reading.MODULE] == module] if column in rows else None


def model_input_peak(summary: ProbeSummary | None) -> float | None:
    """The largest magnitude among the floating positional inputs the model's forward was called with (its root
    module's inputs) over the probe; None where not recorded."""
    rows = _forward_rows(summary, ROOT, Reading.INPUT_ABS_MAX)
    if rows is None:
        return None
    peak = float(rows[Reading.INPUT_ABS_MAX].max()) if len(rows) else math.nan
    # 0: no floating input was recorded (a model called with keyword arguments only, whose forward hook sees
    # no positional ones): unknown, not small
    return None if math.isnan(peak) or peak == 0.0 else peak


def enclosing_fp32_safe(ev: Evidence, module: str) -> str:
    """The module itself or its nearest ancestor whose FP32 output stays inside fp16's range (with 2x headroom).

    Keeping only the overflowing op's module in fp32 does not help when its own
    output is beyond 65504: the next fp16 op overflows instead. The block around
    it usually brings the values back (a residual, a projection).
    """
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        candidate = ".".join(parts[:depth])
        peak = module_abs_max(ev.fp32, candidate)
        if peak is not None and peak < FP16_MAX / 2:
            return candidate
    return module


def half_param_modules(summary: ProbeSummary | None) -> pd.DataFrame:
    """The modules whose *trained* parameters are stored in fp16/bf16 (frozen half modules are not the training's weights)."""
    if summary is None:
        return pd.DataFrame()
    table = summary.precision
    mask = table[Inventory.TRAINED_PARAM_DTYPES].fillna("").str.contains("|".join(LOW_DTYPES))
    return table[mask]


def half_optimizer_state_modules(summary: ProbeSummary | None) -> pd.DataFrame:
    """The modules whose optimizer state is stored in fp16/bf16."""
    if summary is None:
        return pd.DataFrame()
    table = summary.precision
    return table[table[Inventory.OPTIMIZER_STATE_DTYPES].fillna("").str.contains("|".join(LOW_DTYPES))]


def stores_half_training_state(ev: Evidence) -> bool:
    """Whether the training keeps its trained weights or its optimizer state in half precision (what fp32
    master weights would change)."""
    return not half_param_modules(ev.amp).empty or not half_optimizer_state_modules(ev.amp).empty


def is_norm(type_name: str) -> bool:
    return any(type_name.startswith(n) or type_name.endswith(n) for n in NORM_TYPES)


def scale_patch(ev: Evidence) -> dict[str, Any]:
    """The scaler settings the sweep (or, without one, the derived window) recommends."""
    rec = ev.recommended_scaler or {}
    init = rec.get("init_scale") or (ev.window.recommended() if ev.window is not None else 2.0**16)
    interval = rec.get("growth_interval") or max(ev.config.scaler.growth_interval, 2000)
    return {
        "scaler": {
            "enabled": True,
            "init_scale": float(init),
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": int(interval),
        }
    }


def fp32_wrapper_code(target: str, per_class: bool = False, library: bool = False) -> str:
    """The permanent edit that keeps a module (or every module of a class) in fp32 under autocast. Only floating
    tensors are cast up: a boolean mask or integer ids passed along stay what they are. A library's class
    (``library``: ``nn.Linear``) is not the user's to edit: its modules are wrapped where they sit. Lines fit a
    terminal's 80 columns inside the report's box."""
    up = (
        "def up(a):  # floating tensors to fp32; masks, ids, the rest as they are\n"
        "    return a.float() if torch.is_tensor(a) and a.is_floating_point() else a\n\n"
    )
    cast = "            args = [up(a) for a in args]\n            kwargs = {k: up(v) for k, v in kwargs.items()}\n"
    if per_class and library:
        return (
            fp32_wrapper_code(f"every {target}") + "\n\n"
            "for parent in list(model.modules()):\n"
            "    for name, child in parent.named_children():\n"
            f"        if type(child).__name__ == '{target}':\n"
            "            setattr(parent, name, Fp32Block(child))"
        )
    if per_class:
        return (
            up + f"class {target}(nn.Module):\n"
            "    def forward(self, *args, **kwargs):  # old forward: _forward\n"
            "        with torch.autocast('cuda', enabled=False):  # fp32 inside\n"
            + cast
            + "            return self._forward(*args, **kwargs)"
        )
    where = target if " " in target else f"model.{target}"  # a module's path, or words ("every Linear")
    return (
        up + f"class Fp32Block(torch.nn.Module):  # wrap {where}\n"
        "    def __init__(self, inner):\n        super().__init__(); self.inner = inner\n"
        "    def forward(self, *args, **kwargs):\n"
        "        with torch.autocast('cuda', enabled=False):  # fp32 inside\n"
        + cast
        + "            return self.inner(*args, **kwargs)"
    )


def _precision_column(ev: Evidence, column: str) -> dict[str, Any]:
    """The AMP probe's precision table's ``column`` by module path (the root as ``""``); empty without the column."""
    amp = ev.amp
    if amp is None or amp.precision is None or amp.precision.empty or column not in amp.precision:
        return {}
    return {
        ("" if m == ROOT else str(m)): value for m, value in zip(amp.precision[Inventory.MODULE], amp.precision[column])
    }


def module_types(ev: Evidence) -> dict[str, str]:
    """Every module of the AMP probe's model by path (the root as ``""``) and its class name."""
    return {path: str(kind) for path, kind in _precision_column(ev, "type").items()}


def class_members(path: str, types: dict[str, str]) -> list[str]:
    """Every module of ``path``'s class, when there are several and they are not most of the model: the modules
    that run the same code as ``path`` (the blocks of a stack), where a fault in that code shows in each."""
    kind = types.get(path)
    members = [name for name, t in types.items() if t == kind and name]
    modules = max(len(types) - 1, 1)
    return members if 1 < len(members) and len(members) <= modules / 2 else []


def library_modules(ev: Evidence) -> set[str]:
    """The paths of the AMP probe's modules whose class comes from a library (``nn.Linear``): not code the user edits."""
    return {path for path, library in _precision_column(ev, Inventory.LIBRARY).items() if bool(library)}


CONTAINERS = ("Sequential", "ModuleList", "ModuleDict")
"""Module classes that only hold others: no code of their own decides what a child in them does."""


@dataclass(frozen=True)
class Role:
    """The modules in one place of every module of a user class: every ``FFN``'s ``wo``."""

    members: list[str]
    owner: str
    """The class whose every instance holds one of them (``FFN``)."""
    place: str
    """Their path inside it (``wo``; ``mlp.2`` through a Sequential)."""

    def description(self) -> str:
        return f"every {self.owner}'s {self.place} ({', '.join(self.members)})"


def role_members(path: str, types: dict[str, str]) -> Role | None:
    """The modules that hold ``path``'s place in every module of its owner's class, when there are several: for
    ``layers.0.ffn.wo``, the ``wo`` of every module of ``layers.0.ffn``'s class (T5's ``_keep_in_fp32_modules =
    ["wo"]``). The owner is the nearest enclosing module that is not a container (a Sequential's index 2 means
    nothing across Sequentials: ``blocks.0.mlp.2`` is in its place in every Block, not in every Sequential).
    Where ``path``'s own class is a library's (every Linear of a model is too broad a set), this is the set the
    same user code puts in the same place."""
    parts = path.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        owner = ".".join(parts[:depth])
        if owner not in types:
            return None
        if types[owner] in CONTAINERS:
            continue
        place = ".".join(parts[depth:])
        members = [
            f"{p}.{place}"
            for p, t in types.items()
            if p and t == types[owner] and types.get(f"{p}.{place}") == types.get(path)
        ]
        return Role(members, types[owner], place) if len(members) > 1 else None
    return None


def localised_inside(ev: Evidence, modules: list[str]) -> bool:
    """The localised fault is in one of ``modules`` or in a module inside one of them."""
    loc = ev.localisation
    return loc is not None and loc.inside(modules)


def quoted(modules: list[str]) -> str:
    """Module names as prose reads them: ``'1', '4'`` (a Sequential's children are numbers: "keep 4, 1" read as counts)."""
    return ", ".join(f"'{m}'" for m in modules)


def unheld_constant(loc: Localisation | None) -> FlushedConstant | None:
    """The Python number in the user's code (a clamp bound, an epsilon added, a fill value) that made the localised
    forward operator's input and that its low-precision dtype cannot hold, where that input reaches what the
    number became there (exactly 0): the tracer saw the op that was given it make the input. None for an input
    some operator computed (a norm's divisor whose squares flushed), however small it got."""
    if loc is None or loc.phase != "forward" or loc.flushed_constant is None:
        return None
    found = loc.flushed_constant
    if not 0 <= found.input < len(loc.input_ranges):
        return None
    low, high = loc.input_ranges[found.input]
    return found if found.in_dtype == 0.0 and 0.0 in (low, high) else None


def highest_lr(probe: ProbeSummary | None) -> float | None:
    """The highest learning rate the probe trained at; None where its record holds none above 0."""
    rates = probe.records[Column.LR].dropna() if probe is not None else None
    if rates is None or rates.empty or not float(rates.max()) > 0:
        return None
    return float(rates.max())
