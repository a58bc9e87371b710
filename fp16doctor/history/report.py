"""``fp16doctor logs``: a run's history read, classified, and each finding given the command to run next."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoints import nearest_before
from .formats.watch_capsule import WatchCapsule
from .patterns import LogFinding, classify, with_next
from .read import read_history
from .records import Checkpoint, History, LogEvent, LogSource

WATCH_RERUN = "fp16doctor watch YOUR_TRAINING_SCRIPT.py ARGS"
"""The placeholder the next command names the training file by: a log does not say which file trained."""
FROM_CHECKPOINT = "fp16doctor diagnose YOUR_TRAINING_FILE.py --from-checkpoint {path} --from-step {step}"
"""The next command where a checkpoint lies before the trouble (the training file: the doctor's contract)."""
STARTS_DIAGNOSIS = ("hf", "lightning", "fp16doctor")
"""The checkpoint layouts ``diagnose --from-checkpoint`` reads (a Hugging Face folder, a Lightning ``.ckpt``, a
``torch.save`` dict such as ``fp16doctor train``'s); DeepSpeed's, Megatron-LM's and fairseq's are not read yet."""


@dataclass(frozen=True)
class LogsReport:
    """What ``fp16doctor logs`` read and found: the sources, the findings in the order the trouble starts, the
    checkpoints beside the logs."""

    sources: list[LogSource]
    """Each file read, its format and what it carried."""
    findings: list[LogFinding]
    """The patterns found, in the order the trouble starts."""
    checkpoints: list[Checkpoint]
    """The checkpoints found beside the logs, by step."""
    events: list[LogEvent]
    """Messages the logs print once (the scale at its minimum)."""
    notes: list[str]
    """What the readers inferred or could not read."""
    history: History = field(repr=False, compare=False)
    reference: History | None = field(default=None, repr=False, compare=False)

    @property
    def healthy(self) -> bool:
        """No finding."""
        return not self.findings

    @property
    def verdict(self) -> str:
        """``healthy`` when no pattern of trouble is in the history; else ``unhealthy``."""
        return "healthy" if self.healthy else "unhealthy"

    def summary(self) -> dict[str, Any]:
        """The history's rows, steps and what it carried."""
        return self.history.summary_json()

    def reference_summary(self) -> dict[str, Any] | None:
        """The FP32 reference's rows, steps and what it carried (``--reference``); null without one."""
        return self.reference.summary_json() if self.reference is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "sources": [s.to_json() for s in self.sources],
            "history": self.summary(),
            "reference": self.reference_summary(),
            "findings": [f.to_json() for f in self.findings],
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "events": [e.to_json() for e in self.events],
            "notes": self.notes,
        }


def next_step(finding: LogFinding, history: History) -> LogFinding:
    """The command that goes on from where the logs stop: the capsule's replay, a diagnosis from the checkpoint
    nearest before the trouble, or a watched rerun."""
    capsule = next((s.path for s in history.sources if s.format == WatchCapsule.name), None)
    if capsule is not None:
        return with_next(
            finding,
            f"fp16doctor diagnose --capsule {_newest_capsule(capsule)}",
            "the capsule holds the state and batch of the step the watch stopped at: its diagnosis replays it",
        )
    checkpoint = nearest_before(history.checkpoints, finding.first_step)
    if checkpoint is not None and checkpoint.kind in STARTS_DIAGNOSIS:
        return with_next(
            finding,
            FROM_CHECKPOINT.format(path=checkpoint.path, step=checkpoint.step),
            f"start the diagnosis from {checkpoint.path} (step {checkpoint.step}, the newest checkpoint before the "
            f"trouble at step {finding.first_step}): its probes take up the trained state, and the data goes on "
            f"from there; or resume the run from it under the watch ({WATCH_RERUN}), which stops at the first bad "
            "step and writes a replay capsule",
        )
    if checkpoint is not None:
        return with_next(
            finding,
            WATCH_RERUN,
            f"resume the run from {checkpoint.path} (step {checkpoint.step}, the newest checkpoint before the trouble "
            f"at step {finding.first_step}) under the watch: it stops at the first bad step and writes a replay "
            f"capsule for diagnose --capsule (diagnose --from-checkpoint does not read {checkpoint.kind} checkpoints)",
        )
    return with_next(
        finding,
        WATCH_RERUN,
        "no checkpoint before the trouble beside the logs: rerun under the watch, which stops at the first bad "
        "step and writes a replay capsule for diagnose --capsule",
    )


def _newest_capsule(path: Path) -> Path:
    from .formats.watch_capsule import capsule_folders

    folders = capsule_folders(path)
    return folders[-1] if folders else path


def read_logs(paths: list[Path], reference: list[Path] | None = None) -> LogsReport:
    """Read and classify: the engine under ``fp16doctor logs`` (nothing is run)."""
    history = read_history(paths)
    fp32 = read_history(reference) if reference else None
    findings = [next_step(f, history) for f in classify(history, fp32)]
    notes = list(history.notes)
    if history.skips_inferred():
        notes.append("no skip is logged: skipped steps are read off the logged scale falling (a scaler halves it)")
    return LogsReport(
        sources=history.sources,
        findings=findings,
        checkpoints=history.checkpoints,
        events=history.events,
        notes=notes,
        history=history,
        reference=fp32,
    )
