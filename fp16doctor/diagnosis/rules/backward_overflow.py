"""A module's backward pass overflows fp16 while its forward stays in range.

Found by intervention, not by a pattern: the localisation puts the first
inf/NaN in the backward pass, inside a module whose forward output is finite
and below 65504, and keeping that module (or every module of its class) in
fp32 repairs the training. The usual culprit is a hand-written
``torch.autograd.Function``: its ``backward`` runs outside autocast, on the
half-precision tensors its forward saved, so a term like ``inv_rms ** 3`` or
``1 / x ** 2`` passes 65504. The fix names what keeps that backward in fp32:
``torch.amp.custom_fwd(cast_inputs=torch.float32)`` with ``custom_bwd`` for a
custom Function, else the module in fp32.
"""

from __future__ import annotations

from typing import ClassVar

from .. import rule_cases as fx
from ..findings import Evidence, EvidenceRecord, Finding, Repair, RepairEvidence, RepairKind
from . import Rule
from ._helpers import localised_inside, quoted


class BackwardOverflow(Rule):
    code = "backward-overflow"
    order = 61
    # named only by the intervention search: its findings' evidence is the measured repair
    evidence_type: ClassVar[type[EvidenceRecord]] = RepairEvidence
    explains = ("nonfinite", "skips", "amp-exception")
    repairs = (RepairKind.FP32_MODULES, RepairKind.BF16)
    triggers = ()
    names_cases = (
        lambda: (
            fx.repair("fp32-modules", ["norm"], symptoms=("skips",)),
            fx.evidence(localisation=fx.localisation("backward", "norm", "aten::mul")),
        ),
        lambda: (fx.repair("bf16", symptoms=("skips",)), fx.evidence(localisation=fx.localisation("backward", "norm"))),
    )
    suppresses = ("scale-overflow", "scheduler-skip-drift")

    def check(self, ev: Evidence) -> list[Finding]:
        return []  # named only by the intervention search: from what, tried, repairs the training

    def names_repair(self, repair: Repair, ev: Evidence) -> bool:
        """The fault starts in backward, the repaired modules' forward stayed in range, and keeping them in fp32
        (or bf16's range) repaired the training."""
        loc = ev.localisation
        if loc is None or loc.phase != "backward":
            return False
        return repair.kind == RepairKind.BF16 or (
            repair.kind == RepairKind.FP32_MODULES
            and localised_inside(ev, repair.modules)
            and not repair.forward_overflow
        )

    def repair_title(self, repair: Repair, ev: Evidence) -> str:
        loc = ev.localisation
        assert loc is not None
        inside = f" in {loc.custom_function}.backward" if loc.custom_function else ""
        fixed = (
            "bf16"
            if repair.kind == RepairKind.BF16
            else "keeping "
            + (f"every {repair.module_class}" if repair.module_class else quoted(repair.modules))
            + " in fp32"
        )
        return (
            f"The backward pass overflows fp16 in module '{loc.module}'{inside} ({loc.operator} at step {loc.step} -> {loc.output}) "
            f"while its forward stays in range; {fixed} repairs the training"
        )

    def repair_fix(self, repair: Repair, ev: Evidence) -> tuple[str, str]:
        loc = ev.localisation
        function = loc.custom_function if loc is not None else None
        if function:
            return (
                f"{function} is a custom autograd Function: its backward runs outside autocast on the half tensors "
                "its forward saved. Decorate its forward with torch.amp.custom_fwd(device_type='cuda', "
                "cast_inputs=torch.float32) and its backward with torch.amp.custom_bwd(device_type='cuda'), so both "
                "run in fp32 (PyTorch's AMP examples, custom autograd Functions).",
                f"class {function}(torch.autograd.Function):\n"
                "    @staticmethod\n"
                "    @torch.amp.custom_fwd(device_type='cuda', cast_inputs=torch.float32)\n"
                "    def forward(ctx, x, *args): ...\n\n"
                "    @staticmethod\n"
                "    @torch.amp.custom_bwd(device_type='cuda')\n"
                "    def backward(ctx, grad): ...",
            )
        if repair.kind == RepairKind.BF16:
            return ("Train in bfloat16 (fp32's range: its backward cannot overflow), or keep the module in fp32.", "")
        keep = f"every {repair.module_class}" if repair.module_class else quoted(repair.modules) or "the module"
        return (
            f"Keep {keep} in fp32 (autocast off inside its forward, inputs cast up), so its backward runs on fp32 "
            "tensors; or train in bf16.",
            "",
        )
