"""GradScaler calls in the wrong order or count.

Evidence: the sequence of GradScaler calls of each iteration, as the loop made
them (`scale`, `unscale_`, `step`, `update`), and GradScaler's own refusals:
`unscale_` twice before `update` ("unscale_() has already been called on this
optimizer since the last update()"), e.g. on every accumulation micro-step;
`update()` in an iteration without a `step()`; `step()` without `update()`
(the scale never adapts, and the next `step()` refuses: "unscale_() is being
called after step()"); `step()` on gradients never scaled ("_scale is None"); `update()` more than once in an iteration (one
scaler, two optimizers, `update` between them); a loss that changes with the
loss scale (the precision-gap stage's same-state loss closes with scaling off):
the step returns `scaler.scale(loss)`, or computes from gradients of a scaled
loss (a gradient penalty) without unscaling them; a plain `optimizer.step()` on
an optimizer that `scaler.step()` also steps in the same iteration (it steps
twice, and applies inf gradients on an overflow step); a clip that raises on a
non-finite norm (``clip_grad_norm_(..., error_if_nonfinite=True)``) where FP32
runs finite: it turns every step the scaler exists to skip into a crash, the
calibration's first ones and, later, each growth past the range. Several optimizers, each
stepped with `scaler.step()`, then one `scaler.update()`, is PyTorch's recipe
and healthy. PyTorch's "CUDA Automatic Mixed
Precision examples" give the recipe for each loop shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...measure.records import ExceptionInfo
from ...precision.recording import double_steps
from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Fix
from . import Rule
from ._helpers import fp32_finite

REFUSALS = {
    "has already been called on this optimizer since the last update": "unscale_ called twice before update()",
    "_scale is None": "step()/unscale_() on gradients that scaler.scale() never scaled",
    # PyTorch raises two messages that start alike: update() with no step() since the last update(), and step()
    # whose unscale_ found no gradient in the optimizer's parameters
    "No inf checks were recorded prior to update": "update() without a scaler.step() since the last update()",
    "No inf checks were recorded for this optimizer": "step() found no gradients to check: none of the optimizer's "
    "parameters has a gradient",
    "is being called after step()": "step() without update(): the next iteration's step() finds the last one never closed",
}
CLIP_RAISES = "is non-finite, so it cannot be clipped"
"""Part of PyTorch's message when ``clip_grad_norm_(..., error_if_nonfinite=True)`` meets an inf/NaN norm."""
CLIP_EXCEPTION = {
    "step": 0,
    "type": "RuntimeError",
    "message": "The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be clipped.",
}
"""PyTorch's exception in the rule's own cases: the clip met the calibration's first overflow."""
CLIP_RECIPE = """scaler.scale(loss).backward()
scaler.unscale_(optimizer)
# error_if_nonfinite=False (the default): an inf/NaN norm is a step the scaler skips, not an error
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
scaler.step(optimizer)    # skips the step when the unscaled gradients hold inf/NaN
scaler.update()           # and lowers the scale"""
RECIPE = """# gradient accumulation: scale every micro-batch, unscale/clip/step/update once
scaler.scale(loss / accumulate).backward()
if (micro + 1) % accumulate == 0:
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
# two optimizers: scaler.step(opt1); scaler.step(opt2); then ONE scaler.update()
# every scaler.step(optimizer) is followed by scaler.update() in the same iteration"""
DOUBLE_STEP_RECIPE = """# several optimizers (PyTorch's AMP recipe): every optimizer steps once, through the scaler
scaler.scale(loss_d).backward()
scaler.step(opt_d)            # no opt_d.step() besides: the scaler already steps it (or skips it on inf)
scaler.scale(loss_g).backward()
scaler.step(opt_g)
scaler.update()               # once per iteration, after the last scaler.step()"""


PENALTY_RECIPE = """# gradient penalty under AMP (PyTorch's AMP examples)
grads = torch.autograd.grad(scaler.scale(loss), inputs, create_graph=True)[0]
grads = grads / scaler.get_scale()              # unscale before use
with autocast():
    loss = loss + weight * grads.pow(2).sum(-1).mean()
scaler.scale(loss).backward()"""


@dataclass(frozen=True)
class ScalerCallsEvidence(EvidenceRecord):
    """The GradScaler misuses found, the calls around the first, and GradScaler's (or the clip's) refusal."""

    problems: list[str]
    """Each misuse in words, the first the finding's title names (at most five)."""
    scaler_calls_per_iteration: list[list[str]]
    """The GradScaler calls of each iteration up to the exception's (at most four); the first iteration's alone
    when none was raised."""
    exception: ExceptionInfo | None
    """AMP's exception (a refusal, a clip that raised); None when the loop ran through."""


@dataclass(frozen=True)
class ScaleLeakEvidence(EvidenceRecord):
    """A loss that changes with the loss scale: the precision-gap stage's same-state gap closes with scaling off."""

    problems: list[str]
    same_state_gap: float
    """AMP's loss against FP32's on the same weights and batch, as a relative deviation."""
    gap_without_loss_scaling: float | None
    """The same gap with the GradScaler off; None where it was not measured."""
    step: int
    """The step of the largest gap."""


@dataclass(frozen=True)
class DoubleStepEvidence(EvidenceRecord):
    """Optimizers stepped twice in an iteration: by scaler.step() and by a plain .step()."""

    problems: list[str]
    double_stepped: list[str]
    """The optimizers stepped twice, by name."""
    iterations: int
    """How many iterations stepped one twice."""
    scaler_calls_per_iteration: list[list[str]]
    """The scaler's and optimizers' calls of the first such iteration and the next."""
    exception: ExceptionInfo | None


class ScalerMisuse(Rule):
    code = "scaler-misuse"
    order = 66
    evidence_type: ClassVar[type[EvidenceRecord]] = ScalerCallsEvidence
    verifiable = False
    explains = ("amp-exception", "skips", "nonfinite", "lost-updates", "trajectory-drift", "same-state-gap")
    triggers = ("scaler_misuse.py",)
    fires_on = (
        lambda: fx.evidence(
            amp=fx.probe(
                record=fx.records(
                    exception={
                        "step": 1,
                        "type": "RuntimeError",
                        "message": "unscale_() has already been called on this optimizer since the last update().",
                    }
                ),
                scaler_calls=[["scale", "unscale_"], ["scale", "unscale_"]],
            )
        ),
        lambda: fx.evidence(amp=fx.probe(scaler_calls=[["scale", "update"]] * 10)),
        # update() every micro-batch, step() every fourth: PyTorch refuses the update with no step before it
        lambda: fx.evidence(
            amp=fx.probe(
                record=fx.records(
                    exception={
                        "step": 0,
                        "type": "AssertionError",
                        "message": "No inf checks were recorded prior to update.",
                    }
                ),
                scaler_calls=[["scale", "update"]],
            )
        ),
        lambda: fx.evidence(
            amp=fx.probe(
                record=fx.records(
                    exception={"step": 1, "type": "RuntimeError", "message": "unscale_() is being called after step()."}
                ),
                scaler_calls=[["scale", "step"], ["scale", "step"]],
            )
        ),
        lambda: fx.evidence(amp=fx.probe(), gap=fx.gap(1e7, gap_without_loss_scaling=1e-5, scale_leak=True)),
        # a leak measured at the lower scale a calibration skip of one optimizer led to is still a leak
        lambda: fx.evidence(
            amp=fx.probe(),
            gap=fx.gap(1e7, gap_without_loss_scaling=1e-5, scale_leak=True, compared_loss_scale=32768.0),
        ),
        # clip_grad_norm_(..., error_if_nonfinite=True) on the calibration's first overflow, FP32 finite
        lambda: fx.evidence(
            fp32=fx.probe("fp32"),
            amp=fx.probe(record=fx.records(exception=CLIP_EXCEPTION), scaler_calls=[["scale", "unscale_"]]),
        ),
        lambda: fx.evidence(
            amp=fx.probe(
                scaler_calls=[["scale", "step", "scale", "step", "update"]] * 4,
                optimizer_calls=[["scale", "step(D)", "D.step()", "scale", "step(G)", "update"]] * 4,
            )
        ),
    )
    quiet_on = (
        lambda: fx.evidence(amp=fx.probe(scaler_calls=[["scale", "unscale_", "step", "update"]] * 10)),
        # a GAN's discriminator skipped at every scale tried: the generator's loss saw another discriminator
        lambda: fx.evidence(
            amp=fx.probe(scaler_calls=[["scale", "step", "scale", "step", "update"]] * 4),
            gap=fx.gap(2.5e-3, gap_without_loss_scaling=1e-6, scale_leak=True, skipped_in_comparison=["D"]),
        ),
        # the same raise where FP32's own gradients are non-finite too: not the scaler's to skip
        lambda: fx.evidence(
            fp32=fx.probe("fp32", record=fx.records(exception=CLIP_EXCEPTION)),
            amp=fx.probe(record=fx.records(exception=CLIP_EXCEPTION), scaler_calls=[["scale", "unscale_"]]),
        ),
        lambda: fx.evidence(
            amp=fx.probe(scaler_calls=[["scale"], ["scale"], ["scale"], ["scale", "unscale_", "step", "update"]])
        ),
        lambda: fx.evidence(
            amp=fx.probe(
                scaler_calls=[["scale", "step", "scale", "step", "update"]] * 4,
                optimizer_calls=[["scale", "step(D)", "scale", "step(G)", "update"]] * 4,
            )
        ),
    )
    suppresses = ("scale-overflow", "scale-growth", "scheduler-skip-drift", "bf16-advice", "precision-gap")

    def check(self, ev: Evidence) -> list[Finding]:
        amp = ev.amp
        if amp is None or not amp.scaler_enabled:
            return []
        problems = []
        exc = amp.exception
        if exc is not None:
            problems += [what for text, what in REFUSALS.items() if text in (exc.message or "")]
        clip_raised = exc is not None and CLIP_RAISES in (exc.message or "") and fp32_finite(ev)
        if exc is not None and clip_raised:
            problems.append(
                f"the gradient clip raised on a non-finite norm at step {exc.step} "
                "(error_if_nonfinite=True), where GradScaler would have skipped the step; FP32 ran finite"
            )
        calls = amp.scaler_calls
        for step, sequence in enumerate(calls):
            if "update" in sequence and "step" not in sequence and "scale" in sequence:
                problems.append(
                    f"update() without step() in iteration {step} (the scale changes between micro-batches)"
                )
            if "step" in sequence and "update" not in sequence:
                problems.append(f"step() without update() in iteration {step} (the scale never adapts)")
            if sequence.count("update") > 1:
                problems.append(f"update() {sequence.count('update')} times in iteration {step}")
            if "step" in sequence and not amp.scaler_called:
                problems.append("step() while scaler.scale() is never called: the gradients were never scaled")
        doubled = {step: double_steps(sequence) for step, sequence in enumerate(amp.optimizer_calls)}
        doubled = {step: names for step, names in doubled.items() if names}
        if doubled:
            first_step, names = next(iter(doubled.items()))
            problems.append(
                f"{', '.join(names)} stepped twice in iteration {first_step}: scaler.step() and a plain "
                ".step() (the plain step applies inf/NaN gradients the scaler would have skipped)"
            )
        # a skip that a later optimizer of the iteration saw changes the loss with the scale too: not a leak
        leak = ev.gap if ev.gap is not None and ev.gap.scale_leak and not ev.gap.skipped_in_comparison else None
        if leak is not None:
            problems.append(
                f"the loss changes with the loss scale ({leak.gap:.3g}x off FP32 on the same weights and batch, "
                f"{leak.gap_without_loss_scaling or 0.0:.2%} with scaling off): the step returns scaler.scale(loss), or "
                "computes from gradients of scaler.scale(...) (a gradient penalty) without dividing them by the scale"
            )
        problems = list(dict.fromkeys(problems))
        if not problems:
            return []
        if leak is not None and len(problems) == 1:
            return [
                self.finding(
                    f"GradScaler misuse: {problems[0]}",
                    ScaleLeakEvidence(
                        problems=problems,
                        same_state_gap=leak.gap,
                        gap_without_loss_scaling=leak.gap_without_loss_scaling,
                        step=leak.worst_step,
                    ),
                    Fix(
                        "Gradients of a scaled loss are scaled: divide them by scaler.get_scale() before using them in the "
                        "loss (PyTorch's gradient-penalty recipe), and return the unscaled loss.",
                        code=PENALTY_RECIPE,
                    ),
                )
            ]
        first = exc.step if exc is not None else 0
        window = calls[max(0, first - 3) : first + 1]
        if clip_raised and len(problems) == 1:
            return [
                self.finding(
                    f"GradScaler misuse: {problems[0]}",
                    ScalerCallsEvidence(problems=problems, scaler_calls_per_iteration=window, exception=exc),
                    Fix(
                        "Clip with error_if_nonfinite=False (the default): under a GradScaler an inf/NaN gradient norm is "
                        "expected while the scale settles and after each growth, and scaler.step() skips that step and "
                        "lowers the scale. Raising turns each of those skips into a crash (a lower initial scale only "
                        "postpones it to the first growth past the range). To catch real divergence, watch for "
                        "consecutive skips instead.",
                        code=CLIP_RECIPE,
                    ),
                )
            ]
        if doubled and len(problems) == 1:
            first = next(iter(doubled))
            return [
                self.finding(
                    f"GradScaler misuse: {problems[0]}",
                    DoubleStepEvidence(
                        problems=problems,
                        double_stepped=sorted({n for names in doubled.values() for n in names}),
                        iterations=len(doubled),
                        scaler_calls_per_iteration=amp.optimizer_calls[first : first + 2],
                        exception=exc,
                    ),
                    Fix(
                        "Step every optimizer once per iteration, through scaler.step() only, then call scaler.update() "
                        "once (PyTorch's recipe for several optimizers).",
                        code=DOUBLE_STEP_RECIPE,
                    ),
                )
            ]
        return [
            self.finding(
                f"GradScaler misuse: {problems[0]}",
                ScalerCallsEvidence(problems=problems[:5], scaler_calls_per_iteration=window, exception=exc),
                Fix(
                    "Call the GradScaler once per optimizer step in PyTorch's order: scale every backward; "
                    "unscale_, clip, step and update once, after the last micro-batch.",
                    code=RECIPE,
                ),
            )
        ]
