"""``FP16DoctorCallback`` for Lightning: the live watch inside ``trainer.fit()``.

    from fp16doctor.live.integrations.lightning import FP16DoctorCallback
    trainer = lightning.Trainer(precision="16-mixed", callbacks=[FP16DoctorCallback()])
    trainer.fit(module, loader)   # on an alarm: a capsule, a pointer to `fp16doctor diagnose --capsule ...`, a stop

With ``precision="16-mixed"`` the GradScaler is the precision plugin's
(``trainer.strategy.precision_plugin.scaler``); ``on_before_optimizer_step`` runs after
``scaler.unscale_``, once per optimizer step, so gradients are read unscaled.
Micro-batches come from ``on_train_batch_start``, their losses from ``on_before_backward``.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError as exc:
        raise ImportError("fp16doctor.live.integrations.lightning needs Lightning: pip install 'fp16doctor[lightning]'") from exc

from ..watch import Watch, WatchOptions, watch_step


def precision_plugin(trainer: Any) -> Any:
    """Where Lightning keeps the precision plugin (and with ``16-mixed`` its GradScaler)."""
    strategy = getattr(trainer, "strategy", None)
    return getattr(strategy, "precision_plugin", None) or getattr(trainer, "precision_plugin", None)


class FP16DoctorCallback(Callback):
    """Watches every optimizer step; on an alarm writes a replay capsule and (by default) stops training."""

    def __init__(self, options: WatchOptions | None = None, **settings: Any) -> None:
        self.options = options or WatchOptions(**settings)
        self.watch: Watch | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        precision = str(getattr(trainer, "precision", ""))
        dtype = "bfloat16" if precision.startswith("bf16") else ("float16" if precision.startswith("16") else None)
        self.watch = Watch(pl_module, self.options, framework="lightning", dtype=dtype)
        if type(pl_module).__module__ == "__main__":
            print("fp16doctor: the LightningModule is defined in the script that was run; a capsule can rebuild it only "
                  "if its class is importable (define it in a module).", flush=True)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.watch is not None:
            self.watch.capture_batch(batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.watch is not None:
            self.watch.record_loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.watch is None:
            return
        scaler = getattr(precision_plugin(trainer), "scaler", None)
        alarm = self.watch.before_optimizer_step(trainer.global_step, optimizer, scaler, grads_scaled=False)
        watch_step(self.watch, lambda: setattr(trainer, "should_stop", True))(alarm)
