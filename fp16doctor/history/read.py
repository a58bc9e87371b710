"""From paths to a run's history: which format each file is, read as a stream, merged by step."""

from __future__ import annotations

from pathlib import Path

from ..errors import HistoryError
from .checkpoints import find_checkpoints
from .formats import LOG_SUFFIXES, Reader, Reading, csv_rows, files_under, structured_readers
from .formats.text import read_text
from .records import History, HistoryBuilder, LogEvent, LogSource, Quantity

TEXT_SNIFF = 8192
"""Bytes looked at to tell a text log from a binary file (a NUL byte in them: not text)."""


def reader_for(path: Path) -> type[Reader] | None:
    """The structured format of ``path``, None for a file to read as a text log."""
    for reader in structured_readers():
        if reader.recognises(path):
            return reader
    return None


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return b"\0" not in handle.read(TEXT_SNIFF)
    except OSError:
        return False


def expand(path: Path) -> list[Path]:
    """The files to read for one path: itself, or for a folder the logs found in it."""
    if not path.exists():
        raise HistoryError(f"'{path}' does not exist.", hint="Pass a log file or the folder of a run.")
    if path.is_file():
        return [path]
    if reader_for(path) is not None:  # a folder that is one history (an HF output_dir, a capsule)
        return [path]
    found: list[Path] = []
    for file in files_under(path):
        if any(part.startswith("checkpoint-") for part in file.relative_to(path).parts[:-1]):
            continue  # its output_dir's newest trainer_state.json is read instead
        if reader_for(file) is not None or (file.suffix.lower() in LOG_SUFFIXES and _is_text(file)):
            found.append(file)
    for folder in sorted(p for p in path.rglob("*") if p.is_dir() and reader_for(p) is not None):
        if not any(f.is_relative_to(folder) for f in found):
            found.append(folder)
    if not found:
        headless = [f for f in files_under(path) if _csv_columns(f) is not None]
        where = f" (its CSV files have no `step` column: {', '.join(f.name for f in headless[:3])})" if headless else ""
        raise HistoryError(f"no log the doctor reads in '{path}'{where}.", hint=_FORMATS_HINT)
    return found


def _csv_columns(path: Path) -> list[str] | None:
    """The header of a CSV file the CSV readers pass over for want of a ``step`` column; None for any other file."""
    if path.suffix.lower() != ".csv" or not path.is_file():
        return None
    header = [c.strip() for c in csv_rows.header(path)]
    return header if any(header) and "step" not in header else None


_FORMATS_HINT = (
    "fp16doctor logs reads trainer_state.json (or an HF output_dir), metrics.csv, TensorBoard events, "
    "wandb-history.jsonl, replay capsules, and DeepSpeed, fairseq and Megatron-LM text logs; see docs/logs.md."
)


def read_file(path: Path, builder: HistoryBuilder) -> tuple[LogSource, Reading]:
    """One file (or one-history folder) into ``builder``."""
    before = len(builder)
    reader = reader_for(path)
    if reader is None:
        if path.is_file() and path.stat().st_size == 0:
            raise HistoryError(f"'{path}' is empty.", hint="Pass the log of a run that ran at least one step.")
        if not _is_text(path):
            raise HistoryError(f"'{path}' is not in a format the doctor reads.", hint=_FORMATS_HINT)
        columns = _csv_columns(path)
        if columns is not None:
            export = any(c.lower() == "step" for c in columns)  # TensorBoard's "Download CSV": Wall time,Step,Value
            raise HistoryError(
                f"'{path}' is a CSV without a `step` column (columns: {', '.join(columns[:12])}).",
                hint="A TensorBoard CSV export holds one metric: pass the run's event files instead."
                if export
                else "fp16doctor logs reads a CSV with a step column per row (Lightning's CSVLogger metrics.csv, "
                "fp16doctor train's); add the step each row was logged at.",
            )
        reading = read_text(path, builder)
        name = reading.format or "text"
    else:
        if path.is_file() and path.stat().st_size == 0:
            raise HistoryError(f"'{path}' is empty.", hint="Pass the log of a run that ran at least one step.")
        reading = reader().read(path, builder)
        name = reader.name
    rows = len(builder) - before
    carried = [q.value for q in Quantity if any(builder.columns[q.value].present[before:])]
    return LogSource(path, name, rows, carried, reading.notes), reading


def read_history(paths: list[Path]) -> History:
    """Every path's rows, merged into one history by step, with the checkpoints found beside them."""
    if not paths:
        raise HistoryError("no log given.", hint="fp16doctor logs PATH [PATH...]: a log file or a run's folder.")
    builder = HistoryBuilder()
    sources: list[LogSource] = []
    events: list[LogEvent] = []
    notes: list[str] = []
    for given in paths:
        for path in expand(given):
            source, reading = read_file(path, builder)
            if source.rows == 0 and given.is_dir() and not given.samefile(path):
                notes.append(f"{path}: no rows ({'; '.join(reading.notes) or 'nothing the doctor reads'})")
                continue
            sources.append(source)
            events += reading.events
    if len(builder) == 0:
        where = ", ".join(str(p) for p in paths)
        raise HistoryError(
            f"no step could be read from {where}.",
            hint="The file is in a known format but holds no training step yet; " + _FORMATS_HINT,
        )
    history = builder.build(sources, events, notes)
    history = merged_by_step(history) if len(sources) > 1 else history
    history.checkpoints = find_checkpoints([(s.path, s.format) for s in sources])
    return history


def merged_by_step(history: History) -> History:
    """Rows of several files at the same step made one: each quantity from the first file that holds it there."""
    import numpy as np

    if len(history) < 2 or len(np.unique(history.step)) == len(history):
        return history
    steps, first = np.unique(history.step, return_index=True)
    groups = np.split(np.arange(len(history)), first[1:])
    values = {k: np.full(len(steps), np.nan) for k in history.values}
    present = {k: np.zeros(len(steps), dtype=bool) for k in history.values}
    span = np.ones(len(steps), dtype=np.int64)
    disagree: list[int] = []
    for i, rows in enumerate(groups):
        span[i] = int(history.span[rows].max())
        for key in history.values:
            holding = rows[history.present[key][rows]]
            if len(holding):
                values[key][i] = history.values[key][holding[0]]
                present[key][i] = True
            if key in DISAGREEING and len(np.unique(history.values[key][holding])) > 1:
                disagree.append(int(steps[i]))
    notes = list(history.notes)
    if disagree:
        notes.append(
            f"the files disagree on the loss or the loss scale at {len(set(disagree))} step(s), from step "
            f"{min(disagree)}: the first file's values are taken; several paths are read as one run's history, so "
            "pass one run's logs at a time"
        )
    return History(steps, span, values, present, history.sources, history.events, notes)


DISAGREEING = ("loss", "loss_scale")
"""Quantities two logs of one run agree on at a step (a resumed run's logs overlap where it was resumed): values
that differ say the files are of different runs."""
