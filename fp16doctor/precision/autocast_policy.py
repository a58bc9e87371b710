"""CUDA's autocast policy, applied faithfully on the CPU.

CPU autocast uses shorter op lists than CUDA: under fp16 autocast on CPU,
softmax, layer_norm, exp, sum and pow run in fp16, where CUDA runs them in fp32
(PyTorch's autocast op reference; ``aten/src/ATen/autocast_mode.h``). A CPU
diagnosis that used CPU autocast as-is would report overflows the user's GPU
never sees. So, for the duration of an AMP probe on CPU, fp16doctor replaces
the ``AutocastCPU`` kernels with ones that follow the CUDA lists:

* ``lower``: matrix products and convolutions take low-precision inputs and
  produce a low-precision output. They are *emulated*: inputs are rounded to
  the low dtype, the product is computed in fp32 (fp32 accumulation, as tensor
  cores do) and the result rounded to the low dtype. Same numerics as a GPU,
  at fp32 CPU speed instead of the much slower native CPU fp16 GEMM.
* ``fp32``: low-precision inputs are cast up to fp32.
* ``promote``: all floating inputs are cast to the widest floating input type.
* ``banned``: raise as CUDA autocast does (``binary_cross_entropy``).
* anything else CPU autocast would touch falls through: its inputs stay as they
  are and the ops it calls meet the policy above, as on CUDA.

The casts happen above autograd, like real autocast's, so the backward pass
also sees low-precision tensors between layers (where gradient underflow
happens).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.amp import autocast_mode

LOW_PRECISION = (torch.float16, torch.bfloat16)

# Op base names by CUDA policy (autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE,
# AT_FORALL_PROMOTE, plus the banned binary_cross_entropy).
CUDA_LOWER = frozenset(
    """
_convolution convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul
linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose
""".split()
)
CUDA_FP32 = frozenset(
    """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm
native_layer_norm group_norm rms_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss
mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm
""".split()
)
CUDA_PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
)
CUDA_BANNED = frozenset({"binary_cross_entropy"})

BCE_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast. "
    "Many models use a sigmoid layer right before the binary cross entropy layer. In this case, "
    "combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits or "
    "torch.nn.BCEWithLogitsLoss. (fp16doctor reproduces CUDA autocast, which raises this.)"
)


def cuda_policy(op_name: str) -> str:
    """CUDA autocast's policy for an aten op (``"aten::softmax.int"`` or ``"softmax"``)."""
    base = op_name.split("::")[-1].split(".")[0]
    if base in CUDA_LOWER:
        return "lower"
    if base in CUDA_FP32:
        return "fp32"
    if base in CUDA_PROMOTE:
        return "promote"
    if base in CUDA_BANNED:
        return "banned"
    return "passthrough"


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return value


def _eligible(t: torch.Tensor) -> bool:
    """Autocast casts floating tensors other than fp64 (CUDA's ``is_eligible``)."""
    return t.is_floating_point() and t.dtype != torch.float64


def _widest(args: Any, kwargs: dict) -> torch.dtype | None:
    widest: torch.dtype | None = None

    def visit(t: torch.Tensor) -> torch.Tensor:
        nonlocal widest
        if _eligible(t) and (widest is None or torch.promote_types(widest, t.dtype) != widest):
            widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
        return t

    _map(list(args) + list(kwargs.values()), visit)
    return widest


_EXCLUDE_AUTOCAST_CPU = DispatchKeySet(DispatchKey.AutocastCPU)


class RoundedInputs:
    """The inputs of one emulated low-precision product: each rounded to the low dtype, then computed on as
    an exact fp32 copy. Autograd saves the copies for the backward; :meth:`saved_in_low_precision` keeps
    the low-precision values instead and widens them again when the backward reads them (exactly: every
    fp16 and bf16 value is an fp32 value), so an AMP probe holds its activations in half precision, as the
    GPU training does, not in fp32 (otherwise the AMP probe of a CPU transformer saved twice the user's
    activation memory). The backward computes on the very same numbers."""

    def __init__(self, low: torch.dtype):
        self.low = low
        self.sources: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(fp32 copy, its low-precision source) of every rounded input."""

    def round(self, t: torch.Tensor) -> torch.Tensor:
        if not _eligible(t):
            return t
        source = stored_as(t, self.low)
        copy = source.float()
        self.sources.append((copy, source))
        return copy

    def release(self) -> None:
        """Let go of the fp32 copies and their sources once the product is recorded: autograd holds the
        saved-tensor hooks, and with them this object, for as long as the graph stands."""
        self.sources.clear()

    def saved_in_low_precision(self) -> contextlib.AbstractContextManager[Any]:
        """Saved-tensor hooks for the product's call, where hooks are allowed (not while a compiler traces)
        and nobody else's are active: activation checkpointing and offloading bring their own, and theirs
        must see every saved tensor as it is. The one exception is a hook that asks to see what is really
        kept (:data:`SEES_LOW_PRECISION_SAVES`: the doctor's own measurement of saved activation bytes)."""
        if not self.sources or not torch.is_grad_enabled() or not _saved_tensor_hooks_allowed():
            return contextlib.nullcontext()
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        if getattr(outer[0], SEES_LOW_PRECISION_SAVES, False):
            outer_pack, outer_unpack = outer
            return torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, outer_pack), lambda saved: _unpack(saved, outer_unpack)
            )
        return contextlib.nullcontext()

    def _pack(self, t: torch.Tensor, outer: Callable[[torch.Tensor], Any] | None = None) -> Any:
        base = t if t._base is None else t._base
        for copy, source in self.sources:
            if base is copy and source.stride() == copy.stride():
                kept = outer(source) if outer is not None else source
                return _Widened(kept, source, t.size(), t.stride(), t.storage_offset(), source._version)
        return outer(t) if outer is not None else t


def _saved_tensor_hooks_allowed() -> bool:
    """False while a compiler traces (it disables saved-tensor hooks; pushing one then raises)."""
    allowed = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return bool(allowed()) if allowed is not None else True


SEES_LOW_PRECISION_SAVES = "fp16doctor_sees_low_precision_saves"
"""An attribute that, set true on a saved-tensor pack hook, has the emulated products hand it the
low-precision tensors they really keep instead of their fp32 copies."""


class _Widened:
    """A saved fp32 view of a widened low-precision tensor, kept as the low-precision tensor (``kept``: that
    tensor, or what an outer hook made of it)."""

    __slots__ = ("kept", "size", "stride", "offset", "version", "source")

    def __init__(self, kept: Any, source: torch.Tensor, size: Any, stride: Any, offset: Any, version: int):
        self.kept, self.size, self.stride, self.offset, self.version = kept, size, stride, offset, version
        self.source = source  # for the in-place check only: the same tensor as ``kept`` without an outer hook


def _unpack(saved: Any, outer: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    if not isinstance(saved, _Widened):
        return outer(saved) if outer is not None else saved
    if saved.source._version != saved.version:
        # What autograd says when a GPU autocast saved this low-precision tensor itself and it changed.
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{saved.source.dtype} {list(saved.source.shape)}] is at version {saved.source._version}; expected "
            f"version {saved.version} instead."
        )
    low = outer(saved.kept) if outer is not None else saved.kept
    return low.float().as_strided(saved.size, saved.stride, saved.offset)


_EMULATING = threading.local()


def emulated_low_dtype() -> torch.dtype | None:
    """Inside an emulated low-precision product on this thread (its rounding casts and its fp32 product): the
    low dtype it stands for; else None. What counts a step's operators tells the emulation's work from the
    training's by it."""
    return getattr(_EMULATING, "dtype", None)


def _make_kernel(op: Any, policy: str) -> Callable[..., Any]:
    """A Python kernel for the AutocastCPU key implementing ``policy`` for ``op``."""

    def cast_args(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
        return _map(args, fn), {k: _map(v, fn) for k, v in kwargs.items()}

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST_CPU):
            if policy == "banned":
                raise RuntimeError(BCE_BANNED_MESSAGE)
            if policy == "fp32":
                args, kwargs = cast_args(args, kwargs, lambda t: t.float() if _eligible(t) else t)
                return op(*args, **kwargs)
            if policy == "promote":
                widest = _widest(args, kwargs)
                if widest is not None:
                    args, kwargs = cast_args(args, kwargs, lambda t: t.to(widest) if _eligible(t) else t)
                return op(*args, **kwargs)
            low = torch.get_autocast_dtype("cpu")
            # Round inputs to the low dtype, compute with fp32 accumulation, round the result:
            # the numerics of a tensor-core GEMM/convolution, at fp32 CPU speed.
            rounded = RoundedInputs(low)
            outer, _EMULATING.dtype = emulated_low_dtype(), low
            try:
                args, kwargs = cast_args(args, kwargs, rounded.round)
                with rounded.saved_in_low_precision():
                    out = op(*args, **kwargs)
            finally:
                rounded.release()  # the graph keeps the hooks (and so this object) as long as it stands
                _EMULATING.dtype = outer
            return _map(out, lambda t: stored_as(t, low) if _eligible(t) else t)

    return kernel


def stored_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``dtype`` as a GPU kernel stores it: a GEMM writes its half-precision output to memory, and
    autocast's cast of an fp32 input to half is a kernel of its own. Where a compiler traces the product, the cast
    is an operator it cannot fuse (:func:`_stored_as_op`): inductor computes element-wise chains in fp32 registers
    and drops a cast to half and back, so an emulated product's overflow past 65504 would vanish from the compiled
    program, where the GPU's cuBLAS output holds it."""
    if t.dtype == dtype or not torch.compiler.is_compiling():
        return t.to(dtype)
    return _stored_as_op()(t, dtype)


@functools.lru_cache(maxsize=1)
def _stored_as_op() -> Any:
    """``fp16doctor::stored_as``: a cast as an opaque custom operator (defined once, on first use), whose
    backward casts the gradient back as autograd's own cast does."""

    @torch.library.custom_op("fp16doctor::stored_as", mutates_args=())
    def stored_as_op(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype, copy=True)

    @stored_as_op.register_fake
    def _(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_like(t, dtype=dtype)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.input_dtype = inputs[0].dtype

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.input_dtype), None

    stored_as_op.register_autograd(backward, setup_context=setup_context)
    return stored_as_op


def _resolve(registration: str) -> Any | None:
    """``"aten::softmax.int"`` -> ``torch.ops.aten.softmax.int`` (None when unavailable)."""
    name = registration.split("::", 1)[1]
    base, _, overload = name.partition(".")
    try:
        packet = getattr(torch.ops.aten, base)
        return getattr(packet, overload or "default")
    except (AttributeError, RuntimeError):
        return None


def overridden_ops() -> dict[str, str]:
    """Every op either autocast backend handles, with the CUDA policy the emulation applies."""
    names = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    names |= set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    return {name: cuda_policy(name) for name in sorted(names) if name.startswith("aten::")}


@functools.lru_cache(maxsize=1)
def _policy_kernels() -> tuple[tuple[str, Any], ...]:
    """(op name, kernel) for every op the replacement registers: resolved once, so entering a probe's
    session again (every step) costs only the registration."""
    kernels = []
    for registration, policy in overridden_ops().items():
        name = registration.split("::", 1)[1]
        if policy == "passthrough":
            # Skip the key for this op only: ops it calls still meet autocast, as on CUDA
            # (cross_entropy_loss -> log_softmax, which CUDA runs in fp32).
            kernels.append((name, torch.library.fallthrough_kernel))
        else:
            op = _resolve(registration)
            if op is not None:
                kernels.append((name, _make_kernel(op, policy)))
    return tuple(kernels)


class _Installation:
    """Reference-counted registration of the CUDA-policy kernels: the first user installs them, the last
    removes them, whichever thread either is (nested and concurrent probes share one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._library: torch.library.Library | None = None

    @property
    def active(self) -> bool:
        return self._library is not None

    def acquire(self) -> None:
        with self._lock:
            if self._count == 0:
                library = torch.library.Library("aten", "IMPL")
                try:
                    with warnings.catch_warnings():
                        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
                        warnings.filterwarnings("ignore", message=".*Warning only once for all operators.*")
                        for name, kernel in _policy_kernels():
                            library.impl(name, kernel, "AutocastCPU")
                except BaseException:
                    library._destroy()  # a half-installed policy must not stay behind
                    raise
                self._library = library
            self._count += 1

    def release(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._library is not None:
                self._library._destroy()
                self._library = None


_INSTALLATION = _Installation()


@contextlib.contextmanager
def cuda_policy_on_cpu() -> Iterator[None]:
    """While active, CPU autocast follows CUDA's op lists (see module docstring)."""
    _INSTALLATION.acquire()
    try:
        yield
    finally:
        _INSTALLATION.release()


Rewrite = Callable[[str, Any, bool], tuple[str, Any, bool]]
"""``(device_type, dtype, enabled) -> (device_type, dtype, enabled)`` for a ``torch.autocast`` being created."""


class _AutocastConstructor:
    """The one patch of ``torch.autocast.__init__``, reference-counted and locked like :class:`_Installation`.

    The constructor is replaced while any thread holds a rewrite and put back when the last one leaves.
    The rewrites themselves are kept per thread (autocast state is per thread too): a DataLoader thread
    or a callback's thread creating an autocast while a probe steps elsewhere gets it unchanged.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._original: Callable[..., None] | None = None
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return self._original is not None

    def _rewrites(self) -> list[Rewrite]:
        if not hasattr(self._local, "rewrites"):
            self._local.rewrites = []
        return self._local.rewrites

    def _install(self) -> None:
        original = autocast_mode.autocast.__init__
        constructor = self

        def init(
            self: Any, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None
        ) -> None:
            for rewrite in reversed(constructor._rewrites()):  # innermost first, as nested blocks would apply them
                device_type, dtype, enabled = rewrite(device_type, dtype, enabled)
            original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        self._original = original
        autocast_mode.autocast.__init__ = init  # type: ignore[method-assign]

    @contextlib.contextmanager
    def rewriting(self, rewrite: Rewrite) -> Iterator[None]:
        with self._lock:
            if self._count == 0:
                self._install()
            self._count += 1
        rewrites = self._rewrites()
        rewrites.append(rewrite)
        try:
            yield
        finally:
            rewrites.remove(rewrite)
            with self._lock:
                self._count -= 1
                if self._count == 0 and self._original is not None:
                    autocast_mode.autocast.__init__ = self._original  # type: ignore[method-assign]
                    self._original = None


_AUTOCAST_CONSTRUCTOR = _AutocastConstructor()


def rewritten_autocast(rewrite: Rewrite) -> contextlib.AbstractContextManager[None]:
    """Every ``torch.autocast(...)`` (also ``torch.cuda.amp.autocast``) this thread opens inside is created with
    its ``(device_type, dtype, enabled)`` rewritten. Scoped to the probe's session and restored after it: the
    one way to reach the user's own autocast blocks, which no dispatch mode sees."""
    return _AUTOCAST_CONSTRUCTOR.rewriting(rewrite)


def cuda_to_cpu(device_type: str, dtype: Any, enabled: bool) -> tuple[str, Any, bool]:
    """CUDA autocast becomes CPU autocast (fp16 where no dtype is given, as CUDA means)."""
    if device_type == "cuda":
        return "cpu", dtype if dtype is not None else torch.float16, enabled
    return device_type, dtype, enabled


def cuda_autocast_on_cpu() -> contextlib.AbstractContextManager[None]:
    """The user's ``torch.autocast("cuda", ...)`` blocks act on CPU autocast, as they would on the GPU they
    were written for: ``autocast("cuda", enabled=False)`` around a sensitive block keeps it in fp32 in a CPU
    probe too, instead of being a no-op (CUDA is absent) under the probe's CPU autocast. Without a dtype,
    CUDA autocast means fp16."""
    return rewritten_autocast(cuda_to_cpu)


def autocast_factory(device_type: str, dtype: torch.dtype | None, enabled: bool = True) -> Callable[[], Any]:
    """A zero-argument callable returning a fresh autocast context, as ``train_step`` receives it.

    The CPU variant needs :func:`cuda_policy_on_cpu` to be active (a probe's
    :class:`~.session.PrecisionSession` holds it during every step) to reproduce CUDA's policy.
    """
    if not enabled or dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)
