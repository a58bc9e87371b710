"""``FP16DoctorCallback`` for the Hugging Face ``Trainer``: the live watch inside ``trainer.train()``.

    from fp16doctor.live.integrations.hf import FP16DoctorCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FP16DoctorCallback()])
    trainer.train()   # on an alarm: a capsule under args.output_dir, a pointer to `fp16doctor diagnose --capsule ...`, a stop

The GradScaler lives on the accelerator (the optimizer the Trainer hands callbacks is accelerate's wrapper,
whose ``scaler`` it is). Each optimizer step is checked in ``on_pre_optimizer_step`` (after every
accumulation micro-batch): the gradients are unscaled there if the Trainer's clipping has not done so
already (what the scaler's ``step`` does first anyway) and the skip is the scaler's own found-inf
decision. The loss is the one the Trainer optimised: the tensor its backward runs on (``training_step``'s
loss, whatever ``compute_loss`` made of it: label smoothing, a custom loss), never a model output that
may carry none; a step with no loss seen is not an alarm. Batches come from a hook on the model's forward.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("fp16doctor.live.integrations.hf needs transformers: pip install 'fp16doctor[hf]'") from exc

from ..observe import TrainingObserver, scaler_decision, watching_steps
from ..watch import Watch, WatchOptions, watch_step

CAPSULE_FOLDER = "fp16doctor_capsules"


class FP16DoctorCallback(TrainerCallback):
    """Watches every optimizer step; on an alarm writes a replay capsule and (by default) stops training."""

    def __init__(self, options: WatchOptions | None = None, **settings: Any) -> None:
        self.options = options or WatchOptions(**settings)
        self._capsule_dir_given = options is not None or "capsule_dir" in settings
        self.watch: Watch | None = None
        self._losses: TrainingObserver | None = None
        self._handles: list[Any] = []
        self._stop = False

    # --- wiring -------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if watching_steps():  # run under `fp16doctor watch`, which checks every step already
            return
        dtype = "bfloat16" if getattr(args, "bf16", False) else ("float16" if getattr(args, "fp16", False) else None)
        options = (
            self.options
            if self._capsule_dir_given
            else replace(self.options, capsule_dir=Path(args.output_dir) / CAPSULE_FOLDER)
        )
        self.watch = Watch(model, options, framework="hf", dtype=dtype)
        self._handles = [model.register_forward_pre_hook(self._capture_inputs, with_kwargs=True)]
        self._losses = TrainingObserver(observe_steps=False)
        try:
            self._losses.__enter__()
        except RuntimeError:  # another callback's observer holds the patches: no loss from this one
            self._losses = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._losses is not None:
            self._losses.__exit__(None, None, None)
            self._losses = None

    def _capture_inputs(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training and self.watch is not None:
            self.watch.begin_step()  # the state the forward writes to, as the step found it
            self.watch.capture_batch(dict(kwargs) if kwargs else (args[0] if len(args) == 1 else args))

    # --- the check ------------------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.watch is None or optimizer is None:
            return
        scaler = getattr(optimizer, "scaler", None)
        found_inf = scaler_decision(scaler, getattr(optimizer, "optimizer", optimizer))
        for loss in self._losses.take_losses() if self._losses is not None else []:
            self.watch.record_loss(loss)
        alarm = self.watch.before_optimizer_step(
            state.global_step, optimizer, scaler, grads_scaled=False, found_inf=found_inf
        )
        watch_step(self.watch, lambda: setattr(self, "_stop", True))(alarm)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._stop:
            control.should_training_stop = True
        return control
