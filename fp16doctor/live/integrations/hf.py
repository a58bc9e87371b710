"""``FP16DoctorCallback`` for the Hugging Face ``Trainer``: the live watch inside ``trainer.train()``.

    from fp16doctor.live.integrations.hf import FP16DoctorCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FP16DoctorCallback()])
    trainer.train()   # on an alarm: a capsule, a pointer to `fp16doctor diagnose --capsule ...`, and a stop

The GradScaler lives on the accelerator (the optimizer the Trainer hands callbacks is
accelerate's wrapper, whose ``scaler`` it is); gradients are read in
``on_pre_optimizer_step``, once per optimizer step (after every accumulation
micro-batch): unscaled there when the Trainer clips (``max_grad_norm > 0``), else
divided by the scale. Losses and batches come from hooks on the model's forward.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("fp16doctor.live.integrations.hf needs transformers: pip install 'fp16doctor[hf]'") from exc

from ...userfile.loop import output_field
from ..watch import Watch, WatchOptions, watch_step


class FP16DoctorCallback(TrainerCallback):
    """Watches every optimizer step; on an alarm writes a replay capsule and (by default) stops training."""

    def __init__(self, options: WatchOptions | None = None, **settings: Any) -> None:
        self.options = options or WatchOptions(**settings)
        self.watch: Watch | None = None
        self._handles: list[Any] = []
        self._stop = False

    # --- wiring -------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        dtype = "bfloat16" if getattr(args, "bf16", False) else ("float16" if getattr(args, "fp16", False) else None)
        self.watch = Watch(model, self.options, framework="hf", dtype=dtype)
        self._handles = [model.register_forward_pre_hook(self._capture_inputs, with_kwargs=True),
                         model.register_forward_hook(self._capture_loss)]

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _capture_inputs(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training and self.watch is not None:
            self.watch.capture_batch(dict(kwargs) if kwargs else (args[0] if len(args) == 1 else args))

    def _capture_loss(self, module: Any, args: Any, output: Any) -> None:
        loss = output_field(output, "loss")
        if module.training and self.watch is not None and loss is not None:
            self.watch.record_loss(loss)

    # --- the check ------------------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.watch is None or optimizer is None:
            return
        scaler = getattr(optimizer, "scaler", None)
        clipped = (getattr(args, "max_grad_norm", 0) or 0) > 0  # clipping unscaled the gradients already
        alarm = self.watch.before_optimizer_step(state.global_step, optimizer, scaler, grads_scaled=not clipped)
        watch_step(self.watch, lambda: setattr(self, "_stop", True))(alarm)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._stop:
            control.should_training_stop = True
        return control
