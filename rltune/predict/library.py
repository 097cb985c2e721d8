"""The case library: every real run's setup, measured stage medians and pre-run forecast.

Public API::

    lib = CaseLibrary("cases/")
    lib.append(record)            # atomic; the same run twice is a no-op, a different one is refused
    lib.has(run_id) -> bool
    lib.load(before=None) -> list[CaseRecord]   # ok and failed runs, oldest first
    lib.skipped -> list[(path, reason)]         # unusable files seen by the last load
    case_from_run(job, knobs, table, run_id, started_at, finished_at, status, forecast, warmup_steps)

Layout: one Parquet file per run, ``cases/<run-id>-<hash>.parquet`` (format in
:mod:`rltune.contracts.cases`). Appending writes a temp file, fsyncs it and links it into place
with ``os.link``, which fails if the name exists -- so a crash leaves the run either fully in or
out, and two writers of the same run cannot both win. Files whose names start with ``.`` (temp
files of an interrupted append) or ``_`` are never read as cases.

Loading 1,000 small files costs about a second, so the library keeps ``cases/_index.parquet``,
a derived cache of every valid case keyed by (file name, size, mtime). A load reads the index,
reads only files the index does not know, and rewrites the index atomically when anything
changed. The index is never the truth: delete it and it is rebuilt; if it is corrupt it is
ignored with a warning. A case file cannot be torn by rltune (it is written under a temporary
name and linked into place whole), so one that cannot be read, or that was copied or renamed by
hand, was damaged outside rltune: the library refuses to load (:class:`CorruptCaseError`, naming
the file and the fix) rather than forecast or decide from a library missing a run.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import statistics
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.contracts.cases import (
    STATUSES,
    CaseRecord,
    read_case_file,
    record_to_row,
    record_to_table,
    row_to_record,
    rows_to_table,
    validate_table,
)
from rltune.contracts.schema import make_temp_file
from rltune.errors import ArtifactError, RltuneError
from rltune.profile.stats import generation_cycle, rounds_problem, whole_rounds

if TYPE_CHECKING:
    import pyarrow as pa

    from rltune.contracts.forecast import CandidateForecast
    from rltune.contracts.job import JobSpec

INDEX_NAME = "_index.parquet"


class CorruptCaseError(ArtifactError):
    """A case file in the library cannot be read, or is not where its run id puts it."""


class CorruptCaseWarning(UserWarning):
    """A case file could not be read or validated; it was skipped."""


class DuplicateCaseError(RltuneError):
    """A run id is already in the library with a different record."""


class CaseDataError(RltuneError):
    """A run's metrics cannot make a case (no measured steps, missing stage column)."""


class LibraryMissingError(RltuneError):
    """A case library named on the command line does not exist (a typo would forecast from theory alone)."""


def case_file_name(run_id: str) -> str:
    """File name of a run: readable prefix plus a hash, so any run id maps to one safe name."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id).lstrip("._")[:80] or "run"
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:10]
    return f"{safe}-{digest}.parquet"


class CaseLibrary:
    """A directory of case files; see the module docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.skipped: list[tuple[str, str]] = []

    def __repr__(self) -> str:
        return f"CaseLibrary({str(self.path)!r})"

    def has(self, run_id: str) -> bool:
        return (self.path / case_file_name(run_id)).exists()

    def append(self, record: CaseRecord) -> bool:
        """Add one run atomically. Returns True if written, False if the identical run was already there.

        Raises DuplicateCaseError if the run id is present with different content.
        """

        table = record_to_table(record)
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / case_file_name(record.run_id)
        if final.exists():
            return self._same_or_refuse(final, record)
        tmp = _write_synced_temp(table, self.path, final.name)
        try:
            try:
                os.link(tmp, final)  # atomic, and refuses to replace: one writer of a run id wins
            except FileExistsError:
                return self._same_or_refuse(final, record)
            except OSError:  # file systems without hard links: rename after the existence check
                os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(self.path)
        return True

    def _same_or_refuse(self, existing: Path, record: CaseRecord) -> bool:
        try:
            stored = read_case_file(existing)
        except ArtifactError as exc:
            raise DuplicateCaseError(f"{existing}: run {record.run_id!r} already has a file, and it is unreadable ({exc.problem}); remove it and append again") from None
        if record_to_row(stored) == record_to_row(record):
            return False
        raise DuplicateCaseError(f"{existing}: run {record.run_id!r} is already in the library with different content; give the new run its own run id")

    def load(self, before: float | None = None, *, statuses: tuple[str, ...] = STATUSES) -> list[CaseRecord]:
        """Every valid case (optionally only those finished at or before ``before``), oldest first."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.skipped = []
        if not self.path.exists():
            return []
        if not self.path.is_dir():
            raise ArtifactError(str(self.path), "", "the case library must be a directory; pass --library cases/")
        entries = {}
        for entry in os.scandir(self.path):
            if entry.name.endswith(".parquet") and not entry.name.startswith((".", "_")) and entry.is_file():
                st = entry.stat()
                entries[entry.name] = f"{entry.name}:{st.st_size}:{st.st_mtime_ns}"
        index = self._read_index()
        by_key: dict[str, dict[str, Any]] = {}
        records: list[CaseRecord] = []
        changed = len(index) != len(entries)
        json_memo: dict[str, Any] = {}
        base = str(self.path)
        for name in sorted(entries):
            key = entries[name]
            row = index.get(key)
            where = os.path.join(base, name)
            if row is None:
                changed = True
                try:
                    record = read_case_file(where)
                except ArtifactError as exc:
                    self._skip(where, str(exc))
                    continue
                if case_file_name(record.run_id) != name:
                    self._skip(where, f"holds run {record.run_id!r}, whose file would be {case_file_name(record.run_id)}; it was copied or renamed by hand")
                    continue
                row = record_to_row(record)
            else:
                try:
                    record = row_to_record(row, where, json_memo=json_memo)
                except ArtifactError as exc:
                    self._skip(where, str(exc))
                    continue
            by_key[key] = row
            records.append(record)
        if changed:
            self._write_index(by_key, pa, pq)
        records = [r for r in records if r.status in statuses and (before is None or r.finished_at <= before)]
        records.sort(key=lambda r: (r.finished_at, r.run_id))
        return records

    def _skip(self, where: str, reason: str) -> None:
        self.skipped.append((where, reason))
        problem = reason[len(where) + 2:] if reason.startswith(f"{where}: ") else reason
        raise CorruptCaseError(where, "", f"{problem}; this case file is damaged or was put here by hand: move it out "
                                          f"of the library ({self.path}) and run again")

    def _read_index(self) -> dict[str, dict[str, Any]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.path / INDEX_NAME
        if not path.exists():
            return {}
        try:
            with pq.ParquetFile(path) as handle:  # not pq.read_table: that imports pyarrow.dataset and pandas (~1 s)
                table = handle.read()
            keys = table.column("_key").to_pylist()
            table = table.drop_columns(["_key"])
            validate_table(table, str(path), one_row=False)
        except (pa.ArrowException, OSError, KeyError, ArtifactError) as exc:
            warnings.warn(CorruptCaseWarning(f"{path}: ignored the library index ({exc}); it will be rebuilt"), stacklevel=3)
            return {}
        return dict(zip(keys, table.to_pylist(), strict=True))

    def _write_index(self, rows_by_key: dict[str, dict[str, Any]], pa: Any, pq: Any) -> None:
        if not os.access(self.path, os.W_OK):
            return  # a read-only library is still readable, just slower
        keys = list(rows_by_key)
        table = rows_to_table([rows_by_key[k] for k in keys])
        table = table.append_column("_key", pa.array(keys, type=pa.string()))
        tmp = _write_synced_temp(table, self.path, INDEX_NAME)
        try:
            os.replace(tmp, self.path / INDEX_NAME)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _write_synced_temp(table: pa.Table, directory: Path, name: str) -> str:
    """Write ``table`` to a temporary file beside ``name`` in ``directory``, fsync'd; return its path.

    The caller moves it into place (link or rename) and removes it if that fails.
    """
    import pyarrow.parquet as pq

    fd, tmp = make_temp_file(directory, name)
    try:
        with os.fdopen(fd, "wb") as handle:
            pq.write_table(table, handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def job_facts(job: JobSpec) -> dict[str, Any]:
    """The model and workload facts a case stores (``fact.*`` columns)."""
    return {
        "total_params": float(job.model.total_params),
        "active_params": float(job.model.active_params),
        "layers": float(job.model.layers),
        "hidden": float(job.model.hidden),
        "kv_heads": float(job.model.kv_heads),
        "head_dim": float(job.model.head_dim),
        "model_dtype": job.model.dtype,
        "moe": 1.0 if job.model.moe else 0.0,
        "tasks_per_batch": float(job.workload.tasks_per_batch),
        "trials_per_task": float(job.workload.trials_per_task),
        "answer_cap_tokens": float(job.workload.answer_cap_tokens),
        "context_limit_tokens": float(job.workload.context_limit_tokens),
        "trainer_gpus": float(job.gpus.trainer),
        "rollout_gpus": float(job.gpus.rollout),
    }


def case_from_run(job: JobSpec, knobs: dict[str, Any], table: pa.Table, run_id: str, started_at: float,
                  finished_at: float, status: str, forecast: CandidateForecast | None, warmup_steps: int) -> CaseRecord:
    """Make a case from a run's stage table: means over the same non-warm-up steps of every column.

    Rows of ``run_id`` are used when the table holds several runs; a row counts as warm-up if its
    ``warmup`` flag is set or it is among the first ``warmup_steps`` steps. For an 'ok' run every
    stage column must have a value on each measured step, so all means cover the same steps. The
    mean step is the wall time a step costs (fully async steps alternate, and their median
    misstates it); ``measured.step_median_s`` keeps the median beside it.
    """
    rows = table.to_pylist()
    if "run_id" in table.column_names and any(r.get("run_id") == run_id for r in rows):
        rows = [r for r in rows if r.get("run_id") == run_id]
    rows.sort(key=lambda r: r.get("step", 0))
    measured_rows = [r for i, r in enumerate(rows) if i >= warmup_steps and not r.get("warmup")]
    # where a generation round feeds several steps, whole rounds only (rltune.profile.stats)
    rounds = set(whole_rounds(rows, steps=[int(r["step"]) for r in measured_rows if "step" in r]))
    if generation_cycle(rows) != 1:
        if status == "ok" and not rounds:
            raise CaseDataError(f"run {run_id}: {rounds_problem(rows) or 'no whole generation round measured'}")
        measured_rows = [r for r in measured_rows if int(r["step"]) in rounds]
    required = ("step_s", "rollout_s", "training_s", "weight_sync_s")
    if status == "ok":
        if not measured_rows:
            raise CaseDataError(f"run {run_id}: no measured steps after {warmup_steps} warm-up steps ({len(rows)} rows); run more steps")
        for name in required:
            missing = [r.get("step") for r in measured_rows if r.get(name) is None]
            if missing:
                raise CaseDataError(f"run {run_id}: column {name} has no value on steps {missing[:5]}; the log format must report every stage")
    skip = {"run_id", "step", "warmup"}
    columns = [c for c in table.column_names if c not in skip]
    measured: dict[str, float] = {}
    for name in columns:
        values = [r[name] for r in measured_rows if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool)
                  and math.isfinite(r[name])]
        if values and len(values) == len(measured_rows):
            measured[name] = float(statistics.fmean(values))
            if name == "step_s":
                measured["step_median_s"] = float(statistics.median(values))
    noise = None
    steps = [r["step_s"] for r in measured_rows if r.get("step_s") is not None]
    if len(steps) >= 2 and statistics.median(steps) > 0:
        med = statistics.median(steps)
        noise = 1.4826 * statistics.median(abs(s - med) for s in steps) / med
    stored_forecast = None
    if forecast is not None:
        stored_forecast = {
            "step_s": float(forecast.step_s), "low_s": float(forecast.range_s[0]), "high_s": float(forecast.range_s[1]),
            "rollout_s": forecast.stages_s.get("rollout"), "training_s": forecast.stages_s.get("training"),
            "weight_sync_s": forecast.stages_s.get("weight_sync"), "method": forecast.method,
            "limiting_stage": forecast.limiting_stage,
        }
        stored_forecast = {k: v for k, v in stored_forecast.items() if v is not None}
    merged_knobs = {**job.knobs, **knobs}
    record = CaseRecord(
        run_id=run_id, job=job.name, model=job.model.name, workload=job.workload.kind,
        rl_mode=str(merged_knobs.get("rl_mode", "sync")), gpus=job.gpus.count, device=job.gpus.device,
        status=status, started_at=float(started_at), finished_at=float(finished_at), warmup_steps=int(warmup_steps),
        measured_steps=len(measured_rows), facts=job_facts(job), knobs=merged_knobs, measured=measured,
        forecast=stored_forecast, step_noise_frac=noise, source=_source(table), statistic="mean",
    )
    record.validate(run_id)
    return record


def record_baseline(library: CaseLibrary, candidates: Any, job: JobSpec) -> bool:
    """Record the candidates' baseline run (its run directory) as a case unless the library has it.

    Forecasts then compare against the baseline's measured step, not a forecast of it. The run
    directory's resolved job.yaml gives the knobs it ran with; its stage table's warm-up column
    the steps. Returns True if a case was written.
    """
    from rltune.contracts.rundir import RunDir

    if not candidates.baseline_dir or library.has(candidates.baseline_run):
        return False
    run = RunDir(candidates.baseline_dir)
    if not run.has_stages():
        raise CaseDataError(f"{run.path}: baseline_dir holds no stages.parquet; profile the baseline into it again")
    knobs = run.job().knobs if run.job_path.exists() else dict(candidates.baseline_knobs)
    finished = run.stages_path.stat().st_mtime
    started = finished - run.wall_s()
    library.append(case_from_run(job, knobs, run.table(), candidates.baseline_run, started, finished, "ok", None, 0))
    return True


def _source(table: pa.Table) -> str | None:
    meta = table.schema.metadata or {}
    raw = meta.get(b"rltune.source")
    return raw.decode() if raw else None


def as_cases(library: CaseLibrary | list[CaseRecord] | str | os.PathLike) -> list[CaseRecord]:
    """Accept a library, a path or a list; return the usable cases (ok, and not left out: ``CaseRecord.usable``)."""
    if isinstance(library, list):
        return [c for c in library if c.usable]
    if not isinstance(library, CaseLibrary):
        library = CaseLibrary(library)
    return [c for c in library.load(statuses=("ok",)) if c.usable]


__all__ = ["CaseDataError", "CaseLibrary", "CorruptCaseError", "CorruptCaseWarning", "DuplicateCaseError", "LibraryMissingError", "as_cases",
           "case_file_name", "case_from_run", "job_facts", "record_baseline"]
