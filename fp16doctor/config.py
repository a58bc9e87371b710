"""The doctor's configuration: dataclasses with one documented field each.

Sources, weakest first: the defaults below, the training file's ``CONFIG``
dict, a YAML file given with ``--config``, command-line flags. Every source is
a plain nested dict until :func:`build_config` validates the merged result, so
an unknown key or a wrong type is reported once, naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float16", "bfloat16")
SOURCE_LINE = re.compile(r".+:[1-9][0-9]*")
"""An entry of ``overrides.fp32_lines``: a file, a colon and a line number."""
CALIBRATION_SKIPS = 10
"""Skips a dynamic scale may take to settle: each halves it, 2^16 down to 2^6 in 10 (``diagnose`` counts up to
this many leading skips as settling, and the live watch's skip-streak allows them to a fresh scaler)."""


def _doc(text: str) -> dict[str, str]:
    """Field metadata holding the field's documentation (:func:`explain` reads it for the config reference)."""
    return {"doc": text}


@dataclass
class ScalerConfig:
    """Settings of ``torch.amp.GradScaler`` (PyTorch's defaults)."""

    enabled: bool = field(default=True, metadata=_doc("Use dynamic loss scaling (fp16 only; bf16 never needs it)."))
    init_scale: float = field(default=65536.0, metadata=_doc("Initial loss scale; 2^16 is PyTorch's default."))
    growth_factor: float = field(
        default=2.0, metadata=_doc("Factor the scale grows by after growth_interval clean steps.")
    )
    backoff_factor: float = field(
        default=0.5, metadata=_doc("Factor the scale shrinks by on a step with inf/NaN gradients.")
    )
    growth_interval: int = field(default=2000, metadata=_doc("Clean steps between two growths of the scale."))

    def validate(self) -> None:
        _require(self.init_scale > 0 and math.isfinite(self.init_scale), "scaler.init_scale", "a finite number > 0")
        _require(self.growth_factor > 1.0, "scaler.growth_factor", "a number > 1")
        _require(0.0 < self.backoff_factor < 1.0, "scaler.backoff_factor", "a number between 0 and 1")
        _require(self.growth_interval >= 1, "scaler.growth_interval", "an integer >= 1")


@dataclass
class OverridesConfig:
    """Runtime fixes the doctor applies in its own loop, without editing the training file.

    A diagnosis writes these into the corrected config (``--fix-config``) so a
    fix can be tried at once; the finding's code snippet shows the permanent edit.
    """

    fp32_modules: list[str] = field(
        default_factory=list, metadata=_doc("Module paths (as in named_modules()) run with autocast off, in fp32.")
    )
    fp32_lines: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "Source lines, as file:line (model.py:42, as the precision-gap finding names them), whose torch "
            "operators run with autocast off, on fp32 inputs: the operators a line of your code calls, the "
            "model's own forward code and the loss included, where no module can be kept in fp32 alone."
        ),
    )
    fp32_weights: bool = field(
        default=False,
        metadata=_doc(
            "fp32 master weights: parameters, buffers and optimizer state stay fp32 (the file's half casts are neutralised) and the forward runs under autocast."
        ),
    )
    loss_in_fp32: bool = field(
        default=False,
        metadata=_doc(
            "Compute the loss in fp32: the model's outputs cast up where they leave it, and outside the model's "
            "modules autocast off and half casts neutralised."
        ),
    )
    loss_in_fp64: bool = field(
        default=False,
        metadata=_doc(
            "Compute the loss in float64, in every probe (FP32 too): the model's floating outputs cast to float64 "
            "where they leave it, so the loss code after it runs in float64 (autocast never casts float64). The "
            "intervention search tries it where FP32's first non-finite value is in the loss."
        ),
    )
    hold_scheduler_on_skip: bool = field(
        default=False, metadata=_doc("Do not step the LR scheduler on steps the GradScaler skipped.")
    )
    unscale_before_clip: bool = field(
        default=False,
        metadata=_doc("Unscale gradients before any clip_grad_norm_/clip_grad_value_ call in the training step."),
    )
    max_lr: float | None = field(
        default=None,
        metadata=_doc(
            "Cap every parameter group's learning rate at this value after each scheduler step (lowers a schedule's peak)."
        ),
    )


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""The backends a diagnosis compiles with: inductor (torch.compile's default), and the two that localise a
compiled-only fault (``aot_eager``: dynamo's graph and AOT autograd's, run eagerly; ``eager``: dynamo's graph)."""


@dataclass
class CompileConfig:
    """How a compiled training is compiled (``torch.compile``). By default, as ``model()`` compiles it: a diagnosis
    then runs its AMP probe compiled too, beside the instrumented eager one, and compares them."""

    enabled: bool | None = field(
        default=None,
        metadata=_doc(
            "Run the AMP probe compiled as well: null (as model() does: compiled when it returns a compiled module), "
            "true (torch.compile the module model() returns), false (eager only)."
        ),
    )
    backend: str | None = field(
        default=None,
        metadata=_doc(
            "The backend: " + " | ".join(COMPILE_BACKENDS) + "; null: the one model() compiles with (else inductor)."
        ),
    )
    mode: str | None = field(
        default=None,
        metadata=_doc("torch.compile's mode (default, max-autotune ...); null: the one model() compiles with."),
    )
    emulate_precision_casts: bool = field(
        default=False,
        metadata=_doc(
            "Inductor rounds every intermediate to the dtype eager would store it in (its emulate_precision_casts "
            "option): the compiled numerics then follow eager's."
        ),
    )

    fallback_ops: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "ATen operators inductor runs as their ATen kernels instead of lowering them (aten.rsqrt, ...): what "
            "keeps a miscompiled lowering out of the compiled program (torch._inductor.lowering.make_fallback)."
        ),
    )

    eager_modules: list[str] = field(
        default_factory=list,
        metadata=_doc(
            "Submodules (as named_modules() names them, from the module model() compiles) that run eagerly inside "
            "the compiled program, the rest compiled as before: torch.compiler.disable on their forward. What keeps "
            "a miscompiled region out of the compiled program."
        ),
    )

    def validate(self) -> None:
        if self.backend is not None:
            _require(self.backend in COMPILE_BACKENDS, "compile.backend", " | ".join(COMPILE_BACKENDS) + " or null")
        for name in self.fallback_ops:
            _require(
                isinstance(name, str) and name.startswith("aten.") and name.count(".") in (1, 2),
                "compile.fallback_ops",
                "a list of ATen operator names such as aten.rsqrt",
            )
        for name in self.eager_modules:
            _require(isinstance(name, str) and name != "", "compile.eager_modules", "a list of submodule names")

    @property
    def compiles_anew(self) -> bool:
        """The compiled program differs from one built without these settings in what dynamo's and inductor's
        caches do not key on (lowerings in place, a submodule's forward disabled): a probe compiles it anew."""
        return bool(self.fallback_ops or self.eager_modules)

    @property
    def as_model_compiles(self) -> bool:
        """Nothing changed from what model() compiles: its own compiled module is the program."""
        return self.backend is None and self.mode is None and not self.emulate_precision_casts


SHARDED_DTYPES = ("float32", "float16", "bfloat16")
SHARDED_WRAPPERS = ("fully_shard", "fsdp1", "ddp")


@dataclass
class ShardingConfig:
    """The ranks of a sharded training (FSDP2's ``fully_shard`` with a ``MixedPrecisionPolicy``, FSDP1's
    ``FullyShardedDataParallel`` with a ``MixedPrecision``, or DDP with a compression hook), emulated in one
    process: what a capsule of a sharded run replays. Each optimizer step takes ``world`` x ``micro_batches``
    batches, rank r the r-th run of ``micro_batches`` of them (see :mod:`fp16doctor.engine.emulated_ranks`)."""

    world: int = field(
        default=1, metadata=_doc("Ranks to emulate in one process; 1: none (the training as one process runs it).")
    )
    micro_batches: int = field(
        default=1, metadata=_doc("Micro-batches each rank accumulates per optimizer step, each its own backward.")
    )
    param_dtype: str | None = field(
        default=None,
        metadata=_doc(
            "The policy's param_dtype: the parameters themselves are cast to it for the forward and backward (every "
            "op runs in it); null: the parameters' own dtype. " + " | ".join(SHARDED_DTYPES) + " or null."
        ),
    )
    reduce_dtype: str | None = field(
        default=None,
        metadata=_doc(
            "The policy's reduce_dtype: the ranks' gradients are divided by the world size and summed in it; null: "
            "in param_dtype (FSDP's default). " + " | ".join(SHARDED_DTYPES) + " or null."
        ),
    )

    wrapper: str = field(
        default="fully_shard",
        metadata=_doc(
            "How the ranks reduce: fully_shard (FSDP2: in fp16 divided by about the square root of the world size "
            "before the sum and the rest after it), fsdp1 (FullyShardedDataParallel: divided so in every dtype) or "
            "ddp (a compression hook: each rank's gradient cast to reduce_dtype, divided by the world size, then "
            "summed)."
        ),
    )
    autocast: bool = field(
        default=True,
        metadata=_doc(
            "The ranks ran their forward under autocast; false: the policy's param_dtype alone set every op's dtype "
            "(an FSDP training without autocast), and the AMP probe's autocast is left off."
        ),
    )
    sync_each_micro_batch: bool = field(
        default=True,
        metadata=_doc(
            "The ranks reduce their gradients after every micro-batch's backward (FSDP2's and DDP's default), each "
            "reduction's result accumulated in the parameters' own dtype; false: gradient sync off until the last "
            "micro-batch (set_requires_gradient_sync(False), no_sync()), the micro-batches accumulated unsharded in "
            "reduce_dtype (in param_dtype where it is null; under DDP in the parameters' dtype) and reduced once. "
            "A watched run's capsule records which its training did."
        ),
    )
    cast_forward_inputs: bool = field(
        default=True,
        metadata=_doc(
            "The policy's cast_forward_inputs (FSDP2's default true): the model's floating-point inputs are cast to "
            "param_dtype, and those of a module kept in fp32 (overrides.fp32_modules) to float32."
        ),
    )
    output_dtype: str | None = field(
        default=None,
        metadata=_doc(
            "The policy's output_dtype: the model's floating-point outputs are cast to it; null: left in the dtype "
            "they were computed in. " + " | ".join(SHARDED_DTYPES) + " or null."
        ),
    )
    module_policies: dict[str, dict[str, Any]] = field(
        default_factory=dict,
        metadata=_doc(
            "Submodules sharded with a policy of their own (fully_shard(block, mp_policy=...)), by path: "
            "param_dtype, reduce_dtype, output_dtype (dtype names or null) and cast_forward_inputs, as they take "
            "effect. Their parameters are cast, their gradients reduced and their inputs and outputs cast as that "
            "policy says; the root's policy covers the rest. A watched run's capsule records them."
        ),
    )

    def validate(self) -> None:
        _require(self.world >= 1, "sharding.world", "an integer >= 1")
        _require(self.micro_batches >= 1, "sharding.micro_batches", "an integer >= 1")
        _require(self.wrapper in SHARDED_WRAPPERS, "sharding.wrapper", " | ".join(SHARDED_WRAPPERS))
        for key in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, key)
            _require(
                value is None or value in SHARDED_DTYPES, f"sharding.{key}", " | ".join(SHARDED_DTYPES) + " or null"
            )
        _require(isinstance(self.module_policies, dict), "sharding.module_policies", "a mapping of module paths")
        for path, policy in self.module_policies.items():
            where = f"sharding.module_policies.{path}"
            _require(isinstance(policy, dict), where, "a mapping of param_dtype, reduce_dtype, output_dtype")
            for key in ("param_dtype", "reduce_dtype", "output_dtype"):
                value = policy.get(key)
                _require(
                    value is None or value in SHARDED_DTYPES, f"{where}.{key}", " | ".join(SHARDED_DTYPES) + " or null"
                )

    @property
    def emulated(self) -> bool:
        return self.world > 1


@dataclass
class DoctorConfig:
    """Everything a probe, a diagnosis or a training run needs to know."""

    steps: int = field(default=50, metadata=_doc("Training steps per probe."))
    seed: int = field(default=0, metadata=_doc("Seed for model initialisation and every probe."))
    device: str = field(default="auto", metadata=_doc("auto (cuda when available), cpu or cuda."))
    dtype: str = field(default="float16", metadata=_doc("The low precision the user trains with: float16 or bfloat16."))
    lr: float = field(
        default=1e-3,
        metadata=_doc("Learning rate of the default optimizer (AdamW); ignored when the file defines optimizer()."),
    )
    max_grad_norm: float | None = field(
        default=None,
        metadata=_doc("Clip the global gradient norm to this (after unscale_) in the default loop; null: no clipping."),
    )
    scaler: ScalerConfig = field(default_factory=ScalerConfig, metadata=_doc("GradScaler settings."))
    overrides: OverridesConfig = field(
        default_factory=OverridesConfig, metadata=_doc("Runtime fixes applied by the doctor's loop.")
    )
    compile: CompileConfig = field(
        default_factory=CompileConfig, metadata=_doc("torch.compile settings of a compiled training.")
    )
    sharding: ShardingConfig = field(
        default_factory=ShardingConfig,
        metadata=_doc("The ranks of a sharded training, emulated in one process (a sharded run's capsule)."),
    )

    def validate(self) -> None:
        _require(self.steps >= 1, "steps", "an integer >= 1")
        _require(self.device in DEVICES, "device", " | ".join(DEVICES))
        _require(self.dtype in DTYPES, "dtype", " | ".join(DTYPES))
        _require(self.lr > 0 and math.isfinite(self.lr), "lr", "a finite number > 0")
        if self.max_grad_norm is not None:
            _require(self.max_grad_norm > 0, "max_grad_norm", "a number > 0 or null")
        for line in self.overrides.fp32_lines:
            _require(SOURCE_LINE.fullmatch(line.strip()) is not None, "overrides.fp32_lines", "a list of file:line")
        if self.overrides.max_lr is not None:
            _require(self.overrides.max_lr > 0, "overrides.max_lr", "a number > 0 or null")
        self.scaler.validate()
        self.compile.validate()
        self.sharding.validate()

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (what YAML and JSON hold)."""
        return dataclasses.asdict(self)


def _require(ok: bool, key: str, expected: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}' must be {expected}.", hint="Fix the value in your config.")


def _type_name(tp: Any) -> str:
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; accept only lossless conversions."""
    for base in (float, str, bool):  # an optional scalar: null, or the scalar
        if tp in (f"{base.__name__} | None", base | None):
            return None if value is None else _coerce(value, base, key)
    if tp in ("list[str]", list[str]):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config key '{key}' must be a list of strings, got {value!r}.")
        return list(value)
    if tp in ("dict[str, dict[str, Any]]",):  # a mapping of mappings, checked field by field by its validate()
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key '{key}' must be a mapping of names to mappings, got {value!r}.")
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in value.items()}
    tp = {"bool": bool, "int": int, "float": float, "str": str}.get(tp, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(
        f"config key '{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}.",
        hint="Fix the value in your config.",
    )


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config key '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {type(data).__name__}."
        )
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.0)
            suggestion = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config key '{prefix}{key}'.{suggestion}",
                hint="Valid keys: " + ", ".join(prefix + k for k in known) + ".",
            )
        f = known[key]
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):  # a nested section
            kwargs[key] = _build(factory, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, f.type, prefix + key)
    return cls(**kwargs)


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``override`` wins, nested mappings merge key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_patch(config: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A fix's ``config_patch`` applied to a config: like :func:`merge`, except that a list adds to the list the
    config has. Every list a fix sets is a set of things kept out of half precision (``fp32_modules``,
    ``fp32_lines``, ``fallback_ops``, ``eager_modules``), so a fix keeps what the user already kept."""
    out = dict(config)
    for key, value in patch.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = apply_patch(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = list(dict.fromkeys(out[key] + value))
        else:
            out[key] = value
    return out


def whole_lists(config: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``patch``'s keys as ``config`` holds them once the patch is applied (:func:`apply_patch`): each list whole,
    the config's own items first. Applied by either rule, adding or replacing (:func:`merge`, or any tool's), it
    sets the same config."""
    return _at_keys(apply_patch(config, patch), patch)


def _at_keys(values: Mapping[str, Any], keys: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` cut down to the (nested) keys of ``keys``."""
    return {
        key: _at_keys(values[key], shape)
        if isinstance(shape, Mapping) and isinstance(values[key], Mapping)
        else values[key]
        for key, shape in keys.items()
    }


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config with ``yaml.safe_load`` (never executes tags)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist.", hint="Check the path given to --config.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(
            f"config file '{path}' is not valid YAML: {getattr(exc, 'problem', exc)}.", location=where
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys, got {type(data).__name__}.")
    return data


def build_config(*layers: Mapping[str, Any] | None) -> DoctorConfig:
    """Merge the layers (weakest first) over the defaults and validate the result."""
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer:
            if not isinstance(layer, Mapping):
                raise ConfigError(f"a config layer must be a mapping, got {type(layer).__name__}.")
            merged = merge(merged, layer)
    config = _build(DoctorConfig, merged, "")
    config.validate()
    return config


def overrides_patch(**values: Any) -> dict[str, Any]:
    """A config patch of the runtime overrides, checked against :class:`OverridesConfig` as it is made: an
    unknown key or a value of the wrong type is a :class:`ConfigError` at once (a fix can only name real keys)."""
    return {"overrides": _checked(OverridesConfig, values, "overrides.")}


def scaler_patch(**values: Any) -> dict[str, Any]:
    """A config patch of the GradScaler's settings, checked against :class:`ScalerConfig`."""
    return {"scaler": _checked(ScalerConfig, values, "scaler.")}


def sharding_patch(**values: Any) -> dict[str, Any]:
    """A config patch of the emulated ranks' policy, checked against :class:`ShardingConfig`."""
    return {"sharding": _checked(ShardingConfig, values, "sharding.")}


def config_patch(*sections: Mapping[str, Any], **values: Any) -> dict[str, Any]:
    """Section patches (:func:`scaler_patch`, :func:`overrides_patch`) and top-level keys of
    :class:`DoctorConfig` (``dtype="bfloat16"``) in one patch, each key checked."""
    top = _checked(DoctorConfig, values, "")
    out: dict[str, Any] = {}
    for section in sections:
        out = merge(out, section)
    return merge(out, top)


def _checked(cls: type, values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    _build(cls, values, prefix)  # raises on an unknown key or a wrong type, naming it
    return dict(values)


def explain() -> list[tuple[str, Any, str]]:
    """(key, default, doc) for every config key, nested keys dotted: the README table's source."""
    rows: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        instance = cls()
        for f in fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                walk(type(value), f"{prefix}{f.name}.")
            else:
                rows.append((prefix + f.name, value, f.metadata.get("doc", "")))

    walk(DoctorConfig, "")
    return rows


MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
"""Decimal units (``GB``) and binary ones (``GiB``, and the bare letter, as ``free -g`` counts)."""


def machine_memory() -> int:
    """The machine's physical memory in bytes (what a share such as ``0.5`` is a share of)."""

    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def parse_memory_size(text: str, flag: str = "--max-memory") -> int:
    """Bytes from ``2GB``, ``512MiB``, ``1500000000`` or a share of the machine's memory (a number in (0, 1]).

    A share keeps one setting meaningful across machines (a CI runner and a workstation); units are
    case-insensitive. Anything else is a :class:`ConfigError` naming ``flag`` and an example.
    """

    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in MEMORY_UNITS:
        raise ConfigError(
            f"{flag} must be a size or a share of the machine's memory, got {text!r}.",
            hint=f"For example {flag} 2GB, {flag} 512MiB or {flag} 0.5 (half of this machine's memory).",
        )
    number = float(match.group(1))
    if not unit and 0 < number <= 1:
        try:
            return int(number * machine_memory())
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name on this system
            raise ConfigError(
                f"{flag} {text!r}: this system does not say how much memory it has.",
                hint=f"Give a size instead, e.g. {flag} 8GB.",
            ) from None
    if number <= 0 or (not unit and number < 1024):
        raise ConfigError(
            f"{flag} {text!r} is not a usable size: give a unit, or a share between 0 and 1.",
            hint=f"For example {flag} 2GB or {flag} 0.5.",
        )
    return int(number * MEMORY_UNITS[unit])
