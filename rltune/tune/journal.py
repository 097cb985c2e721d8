"""An append-only, fsynced JSON-lines journal, and its replay: what makes ``rltune auto`` resumable after ``kill -9``.

Each event is one line written with a single ``write`` and made durable with ``fsync`` before the
loop moves on. A process killed mid-write leaves at most one torn last line: a last line with no
newline that does not parse. Reading skips it, so the journal always replays to the last event
that was fully written, and the next append cuts it off first. Only such a line is ever removed: a
complete last event with no final newline (as an editor saves a file) is kept, and the next append
adds the newline before its own line. Any other line that cannot be read -- bytes that are not
UTF-8, a line that is not JSON, an event of an unknown kind, a field of the wrong type -- is
refused with the file, the line and the field, before the loop acts on anything.

Each line is validated against its kind's schema (:mod:`rltune.contracts.journal`), and
:func:`replay` turns the events into the loop's state (:class:`JournalState`): the loop, the
report and the reward check read that, never the raw lines.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltune.contracts.journal import (
    EVENT_TYPES,
    JOURNAL_SCHEMA_VERSION,
    BaselineEvent,
    BaselineRunEvent,
    Event,
    FinishEvent,
    ProposedEvent,
    RewardCheckEvent,
    RoundEndEvent,
    RunAbandonedEvent,
    RunStartEvent,
    RunSubmittedEvent,
    StartEvent,
    TrialEvent,
    event_as_data,
)
from rltune.errors import ArtifactError, RltuneError


class JournalError(RltuneError):
    """The journal cannot be read, or belongs to another job or work directory."""


def _parse_line(path: Path, number: int, line: bytes) -> Event:
    """One journal line as its typed event; a line that cannot be one raises :class:`JournalError`."""
    from rltune.contracts.schema import from_data

    where = f"{path}: line {number}"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise JournalError(f"{where}: not text (bytes that are not UTF-8); the file was overwritten? restore the "
                           f"journal, or start a fresh --workdir") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise JournalError(f"{where}: not a JSON object; the journal was edited by hand? restore the line, "
                           f"or start a fresh --workdir") from None
    if not isinstance(data, dict):
        raise JournalError(f"{where}: expected a JSON object (an event), found {type(data).__name__}")
    kind = data.get("event")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise JournalError(f"{where}: event: expected one of {', '.join(EVENT_TYPES)}, found {kind!r}")
    try:
        return from_data(cls, data, str(path), f"line {number} ({kind})")
    except ArtifactError as exc:
        raise JournalError(str(exc)) from None


def _last_line_start(fd: int, size: int) -> int:
    """Offset of the first byte after the last newline of the file (0 when it has none)."""
    end = size
    while end > 0:
        start = max(0, end - 4096)
        chunk = os.pread(fd, end - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


class Journal:
    """Events of one ``auto`` run, in the order they happened."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _repair_tail(self, fd: int) -> None:
        """Before an append: end a complete last event with its newline; cut a torn one (a writer killed mid-write)."""
        size = os.fstat(fd).st_size
        if not size or os.pread(fd, 1, size - 1) == b"\n":
            return
        start = _last_line_start(fd, size)
        tail = os.pread(fd, size - start, start)
        number = os.pread(fd, start, 0).count(b"\n") + 1 if start else 1
        try:
            _parse_line(self.path, number, tail)
        except JournalError:
            if _is_torn(tail):
                os.ftruncate(fd, start)
                return
            raise
        os.write(fd, b"\n")

    def events(self) -> list[Event]:
        """Every fully written event, validated; a torn last line (a kill mid-write) is ignored."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except IsADirectoryError:
            raise JournalError(f"{self.path}: is a directory, not the journal; remove it or use another --workdir") from None
        except OSError as exc:
            raise JournalError(f"{self.path}: cannot be read ({exc.strerror}); check its permissions") from None
        lines = raw.split(b"\n")
        out: list[Event] = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            last_unterminated = number == len(lines)
            try:
                out.append(_parse_line(self.path, number, line))
            except JournalError:
                if last_unterminated and _is_torn(line):
                    break
                raise
        return out

    def append(self, event: Event) -> Event:
        """Write one event durably and return it."""
        line = json.dumps(event_as_data(event), allow_nan=False, default=str).encode() + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._repair_tail(fd)
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return event


def _is_torn(line: bytes) -> bool:
    """A line a writer killed mid-write can leave: the start of a JSON object that does not parse.

    ``json.dumps`` writes an event as one object, so a torn line is a prefix of one: it opens with
    ``{`` and is not itself valid JSON. Anything else at the end (another object, text, bytes that are
    not UTF-8) was not written by the journal and is refused, not cut.
    """
    stripped = line.strip()
    if not stripped.startswith(b"{"):
        return False
    try:
        json.loads(stripped.decode("utf-8", errors="strict"))
    except UnicodeDecodeError:
        return True  # cut inside a multi-byte character
    except ValueError:
        return True
    return False


def make_event(kind: str, time: float, **fields: Any) -> Event:
    """A typed event of ``kind``, validated as the reader would (a bug writing a bad event fails here, not on resume)."""
    from rltune.contracts.schema import from_data

    data = {"event": kind, "time": time, **fields}
    data = {k: v for k, v in data.items() if v is not None or k in _REQUIRED_NULLABLE.get(kind, ())}
    try:
        return from_data(EVENT_TYPES[kind], json.loads(json.dumps(data, allow_nan=False, default=str)),
                         "journal.jsonl", kind)
    except ValueError as exc:  # NaN or infinity: json.dumps refuses them
        raise JournalError(f"journal.jsonl: {kind}: a value is not a finite number ({exc}); nothing was written") from None


# Fields that are required but may hold null: kept when None.
_REQUIRED_NULLABLE = {
    "trial": ("step_s", "baseline_step_s", "gain_pct", "within_forecast_range"),
    "baseline_run": ("step_s",),
}


@dataclass
class JournalState:
    """What the events say, in the terms the loop decides by."""

    events: list[Event]
    start: StartEvent | None = None
    finish: FinishEvent | None = None
    run_starts: list[RunStartEvent] = field(default_factory=list)
    identities: dict[str, dict[str, Any]] = field(default_factory=dict)
    baseline_runs: list[BaselineRunEvent] = field(default_factory=list)
    baselines: list[BaselineEvent] = field(default_factory=list)
    proposed: list[ProposedEvent] = field(default_factory=list)
    trials: list[TrialEvent] = field(default_factory=list)
    abandoned: list[RunAbandonedEvent] = field(default_factory=list)
    round_ends: list[RoundEndEvent] = field(default_factory=list)
    reward_check: RewardCheckEvent | None = None

    @property
    def untuned(self) -> BaselineEvent | None:
        """The round-0 baseline (the untuned runs pooled), once recorded."""
        return next((b for b in self.baselines if b.round == 0), None)

    @property
    def kept_rounds(self) -> list[RoundEndEvent]:
        return [e for e in self.round_ends if e.outcome == "kept"]

    @property
    def made_baseline(self) -> set[str]:
        """Run ids of the kept trials each round went on from."""
        return {e.baseline_run for e in self.kept_rounds if e.baseline_run}

    def trial(self, run_id: str) -> TrialEvent:
        found = next((t for t in self.trials if t.run_id == run_id), None)
        if found is None:
            raise JournalError(f"journal: round_end names baseline_run {run_id!r}, but no trial event has that run id; "
                               f"the journal was edited by hand? restore it, or start a fresh --workdir")
        return found

    def unfinished(self) -> list[RunStartEvent]:
        """run_start events with no outcome in the journal yet."""
        done = {e.run_id for e in self.baseline_runs} | {e.run_id for e in self.trials}
        done |= {e.run_id for e in self.abandoned}
        done |= {rid for b in self.baselines for rid in b.all_run_ids}
        return [e for e in self.run_starts if e.run_id not in done]

    def run_ids(self) -> set[str]:
        return {e.run_id for e in self.run_starts}

    def trials_in(self, round_no: int) -> list[TrialEvent]:
        return [t for t in self.trials if t.round == round_no]

    def attempts_in(self, round_no: int) -> int:
        return sum(1 for p in self.proposed if p.round == round_no)


def check_recorded_runs(state: JournalState, resolve: Callable[[str], Path], *, missing_ok: bool = False) -> None:
    """Read every run the journal says finished: each baseline's stage tables, each measured trial's stage
    tables and (where it is on disk) verdict. A stage table that is missing, or any of these files that
    cannot be read, is refused (its own located line) before anything acts on the journal's numbers;
    ``resolve`` turns a journalled path into a directory.

    ``missing_ok`` passes a run directory that is absent as a whole (a record kept without its runs: the
    report draws from the journal alone), never one whose files are there but damaged.
    """
    from rltune.contracts.rundir import RunDir

    def read(run_dir: str, verdict: bool = False) -> None:
        where = RunDir(resolve(run_dir))
        if missing_ok and not where.path.exists():
            return
        where.table()
        if verdict and where.verdict_path.exists():  # the journal holds its numbers; a damaged copy is still refused
            where.verdict()

    for baseline in state.baselines:
        for run_dir in baseline.all_run_dirs:
            read(run_dir)
    for trial in state.trials:
        if trial.decision == "failed":
            continue  # a crashed run may have left no stage table: its verdict in the journal is all there is
        for number, run_dir in enumerate(trial.run_dirs):
            read(run_dir, verdict=number == 0)


def replay(events: list[Event]) -> JournalState:
    """The loop's state from its events, in order (later events of a kind extend or replace earlier ones)."""
    state = JournalState(events=list(events))
    for event in events:
        if isinstance(event, StartEvent):
            if state.start is None:
                state.start = event
        elif isinstance(event, FinishEvent):
            state.finish = event
        elif isinstance(event, RunStartEvent):
            state.run_starts.append(event)
        elif isinstance(event, RunSubmittedEvent):
            state.identities[event.run_id] = event.identity
        elif isinstance(event, BaselineRunEvent):
            state.baseline_runs.append(event)
        elif isinstance(event, BaselineEvent):
            state.baselines.append(event)
        elif isinstance(event, ProposedEvent):
            state.proposed.append(event)
        elif isinstance(event, TrialEvent):
            state.trials.append(event)
        elif isinstance(event, RunAbandonedEvent):
            state.abandoned.append(event)
        elif isinstance(event, RoundEndEvent):
            state.round_ends.append(event)
        elif isinstance(event, RewardCheckEvent):
            state.reward_check = event
    return state


def read_state(path: str | os.PathLike) -> JournalState:
    """Read and replay the journal at ``path``."""
    return replay(Journal(path).events())


__all__ = ["JOURNAL_SCHEMA_VERSION", "Journal", "JournalError", "JournalState", "check_recorded_runs", "make_event",
           "read_state", "replay"]
