"""A probe's precision session: every interpreter-wide patch its steps need, entered as one.

A probe of one mode changes things that belong to the whole interpreter: the CPU autocast kernels
(CUDA's op lists on CPU, :mod:`.autocast_policy`), ``torch.autocast.__init__`` (the FP32 guards and the
user's CUDA autocast blocks on CPU), the clip functions (the clipping observer, :mod:`.overrides`) and, with
``overrides.fp32_lines``, the torch calls made at given source lines (a torch-function mode).
Each of those patches is reference-counted and locked where it is made, so nested and concurrent
sessions share it and the last one out restores it. The session bundles them for one probe, with the
thread-local torch-function guards of the mode, so that the probe enters it around its own steps and its
construction, and no caller can forget it.

A session is re-entrant per thread: entering it again inside itself (a probe's ``run`` around its
``step``) costs a counter; exceptions unwind every part it entered.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .autocast_policy import Rewrite, cuda_policy_on_cpu, cuda_to_cpu, rewritten_autocast
from .fp32_mode import disable_autocast, half_casts_in_fp32
from .overrides import ClipObserver, Fp32AtLines, watch_clipping


@dataclass
class PrecisionSession:
    """The patches one probe's steps run under (see the module docstring)."""

    cuda_kernels: bool = False
    """CPU autocast follows CUDA's op lists (AMP and bf16 probes on CPU)."""
    autocast_rewrite: Rewrite | None = None
    """How every ``torch.autocast`` opened inside is rewritten (FP32: disabled; CPU: CUDA blocks act on CPU)."""
    neutralise_half_casts: bool = False
    """``.half()`` and fp16 dtype requests become fp32 (the FP32 baseline)."""
    fp32_lines: Fp32AtLines | None = field(default=None, repr=False)
    """The operator-level fallback of ``overrides.fp32_lines``: the torch calls at those source lines in fp32."""
    clipping: ClipObserver | None = field(default=None, repr=False)
    """Set once the probe has its scaler: clip calls are observed during steps."""
    user_module: types.ModuleType | None = field(default=None, repr=False)
    half_casts_rewritten: bool = False
    """A low-precision cast of the user's (``.half()``, ``dtype=torch.float16``) ran in fp32 in this session."""
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    @classmethod
    def for_mode(cls, mode: str, device_type: str) -> PrecisionSession:
        """The session of a probe mode: FP32 guards for ``fp32``; CUDA's policy for low precision on CPU."""
        if mode == "fp32":
            return cls(autocast_rewrite=disable_autocast, neutralise_half_casts=True)
        if device_type == "cpu":
            return cls(cuda_kernels=True, autocast_rewrite=cuda_to_cpu)
        return cls()

    def _rewrote(self) -> None:
        self.half_casts_rewritten = True

    def observe_clipping(self, observer: ClipObserver, user_module: types.ModuleType) -> None:
        """From now on the session's steps record (and with the fix, unscale before) every clip call."""
        self.clipping, self.user_module = observer, user_module

    def keep_lines_in_fp32(self, lines: list[str], device_type: str) -> None:
        """From now on the session's steps run the torch calls at ``lines`` (``file:line``) in fp32."""
        self.fp32_lines = Fp32AtLines(lines, device_type) if lines else None

    @property
    def active(self) -> bool:
        """Whether this thread is inside the session."""
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth:
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with contextlib.ExitStack() as stack:
            for part in self._parts():
                stack.enter_context(part())
            self._local.depth = 1
            try:
                yield
            finally:
                self._local.depth = 0

    def _parts(self) -> list[Callable[[], contextlib.AbstractContextManager[None]]]:
        parts: list[Callable[[], contextlib.AbstractContextManager[None]]] = []
        if self.cuda_kernels:
            parts.append(cuda_policy_on_cpu)
        rewrite = self.autocast_rewrite
        if rewrite is not None:
            parts.append(lambda: rewritten_autocast(rewrite))
        if self.neutralise_half_casts:
            parts.append(lambda: half_casts_in_fp32(on_rewrite=self._rewrote))
        lines = self.fp32_lines
        if lines is not None:
            parts.append(lambda: lines)
        observer, module = self.clipping, self.user_module
        if observer is not None and module is not None:
            parts.append(lambda: watch_clipping(observer, module))
        return parts
