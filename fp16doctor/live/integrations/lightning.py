"""``FP16DoctorCallback`` for Lightning: the live watch inside ``trainer.fit()``.

    from fp16doctor.live.integrations.lightning import FP16DoctorCallback
    trainer = lightning.Trainer(precision="16-mixed", callbacks=[FP16DoctorCallback()])
    trainer.fit(module, loader)   # on an alarm: a capsule, a pointer to `fp16doctor diagnose --capsule ...`, a stop

With ``precision="16-mixed"`` the GradScaler is the precision plugin's
(``trainer.strategy.precision_plugin.scaler``); ``on_before_optimizer_step`` runs after
``scaler.unscale_``, once per optimizer step, so gradients are read unscaled and the skip is the
scaler's own found-inf decision. Micro-batches come from ``on_train_batch_start``, their losses
(the loss Lightning optimises) from ``on_before_backward``. Capsules go under the trainer's
``default_root_dir`` unless ``capsule_dir`` is given.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]  # the same class under its older package name
    except ImportError as exc:
        raise ImportError(
            "fp16doctor.live.integrations.lightning needs Lightning: pip install 'fp16doctor[lightning]'"
        ) from exc

from ..observe import scaler_decision, watching_steps
from ..watch import Watch, WatchOptions, watch_step

CAPSULE_FOLDER = "fp16doctor_capsules"


def precision_plugin(trainer: Any) -> Any:
    """Where Lightning keeps the precision plugin (and with ``16-mixed`` its GradScaler)."""
    strategy = getattr(trainer, "strategy", None)
    return getattr(strategy, "precision_plugin", None) or getattr(trainer, "precision_plugin", None)


class FP16DoctorCallback(Callback):
    """Watches every optimizer step; on an alarm writes a replay capsule and (by default) stops training."""

    def __init__(self, options: WatchOptions | None = None, **settings: Any) -> None:
        self.options = options or WatchOptions(**settings)
        self._capsule_dir_given = options is not None or "capsule_dir" in settings
        self.watch: Watch | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if watching_steps():  # run under `fp16doctor watch`, which checks every step already
            return
        precision = str(getattr(trainer, "precision", ""))
        dtype = "bfloat16" if precision.startswith("bf16") else ("float16" if precision.startswith("16") else None)
        options = (
            self.options
            if self._capsule_dir_given
            else replace(self.options, capsule_dir=Path(trainer.default_root_dir) / CAPSULE_FOLDER)
        )
        self.watch = Watch(pl_module, options, framework="lightning", dtype=dtype)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is not None:
            self.watch.begin_step()  # the state the forward writes to, as the step found it
            self.watch.capture_batch(batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.watch is not None:
            self.watch.record_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.watch is None:
            return
        scaler = getattr(precision_plugin(trainer), "scaler", None)
        found_inf = scaler_decision(scaler, getattr(optimizer, "_optimizer", optimizer))
        alarm = self.watch.before_optimizer_step(
            trainer.global_step, optimizer, scaler, grads_scaled=False, found_inf=found_inf
        )
        watch_step(self.watch, lambda: setattr(trainer, "should_stop", True))(alarm)
