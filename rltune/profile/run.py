"""Profile a job end to end: launch it, read its metrics, build the stage table, diagnose, write the run dir.

Public API: :func:`profile_job` (job_path, run_dir, steps=None, overrides=None, on_output=None) -> ProfileResult.
The run directory receives job.yaml (resolved), launch.log, launch.json, stages.parquet and
diagnosis.yaml. A job that crashes or times out raises :class:`~rltune.errors.LaunchError` whose
message ends with the log's last lines — after whatever metrics it wrote have been saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.contracts.diagnosis import Diagnosis, save_diagnosis
from rltune.contracts.job import KnobValue, load_job
from rltune.contracts.stages import rows_to_table, source_of, write_stages
from rltune.errors import LaunchError, LogFormatError
from rltune.launch import LaunchResult, resolved_job, run_job
from rltune.launch.job import workdir_of
from rltune.profile.diagnose import diagnose
from rltune.profile.scrape import StepScraper
from rltune.profile.stage_map import map_metrics
from rltune.profile.table import stage_table_from_logs

if TYPE_CHECKING:
    import pyarrow as pa

STAGES_NAME = "stages.parquet"
DIAGNOSIS_NAME = "diagnosis.yaml"
LOG_TAIL_LINES = 5


@dataclass
class ProfileResult:
    run_dir: Path
    table: Any  # pyarrow.Table (kept untyped so importing this module does not import pyarrow)
    diagnosis: Diagnosis | None
    launch: LaunchResult


def _merge_engine_metrics(table: pa.Table, per_step: dict[int, dict[str, float]]) -> pa.Table:
    rows = table.to_pylist()
    for row in rows:
        snapshot = per_step.get(row["step"])
        if not snapshot:
            continue
        core, _ = map_metrics("vllm", snapshot)
        for column, value in core.items():
            if row.get(column) is None:
                row[column] = value
        for key, value in snapshot.items():
            if "/bucket/" not in key:
                row.setdefault(key, value)
    return rows_to_table(rows, source=source_of(table))


def profile_job(job_path: str | Path, run_dir: str | Path, steps: int | None = None,
                overrides: dict[str, KnobValue] | None = None,
                on_output: Callable[[str], None] | None = None) -> ProfileResult:
    """Run the job for ``steps`` steps (default limits.steps) in ``run_dir`` and diagnose it."""
    job_path = Path(job_path)
    run_dir = Path(run_dir).resolve()
    job = load_job(job_path)
    # Always pass the step count, so the job runs exactly as many steps as its stage table will hold.
    steps = int(steps if steps is not None else job.limits.steps)
    resolved = resolved_job(job, job_path, overrides, steps)
    metrics_path = Path(job.metrics.path.replace("{run_dir}", str(run_dir)))
    if not metrics_path.is_absolute():
        metrics_path = workdir_of(job, job_path) / metrics_path
    scraper = StepScraper(job.metrics.vllm_metrics_url, metrics_path) if job.metrics.vllm_metrics_url else None
    if scraper is not None:
        with scraper:
            launch = run_job(job, job_path, run_dir, overrides=overrides, steps=steps, on_output=on_output)
    else:
        launch = run_job(job, job_path, run_dir, overrides=overrides, steps=steps, on_output=on_output)

    table = None
    diagnosis = None
    parse_error: LogFormatError | None = None
    if metrics_path.exists():
        try:
            table, _ = stage_table_from_logs(metrics_path, format=job.metrics.format, run_id=run_dir.name,
                                             warmup_steps=resolved.limits.warmup_steps)
        except LogFormatError as exc:
            parse_error = exc
    if table is not None:
        if scraper is not None and scraper.per_step:
            table = _merge_engine_metrics(table, scraper.per_step)
        write_stages(table, run_dir / STAGES_NAME)
    if not launch.ok:
        what = f"timed out after {job.launch.timeout_s:g} s" if launch.timed_out else f"exited with code {launch.returncode}"
        saved = f"{table.num_rows} steps saved in {run_dir / STAGES_NAME}" if table is not None else "no steps recorded"
        raise LaunchError(f"{job_path}: the job {what} ({saved}); log {launch.log_path}, last lines:\n"
                          f"{launch.log_tail(LOG_TAIL_LINES)}")
    if table is None:
        if parse_error is not None:
            raise parse_error
        raise LogFormatError(f"{job_path}: metrics.path: the job finished but wrote no {metrics_path}; "
                             "check metrics.path against where the job writes its metrics")
    diagnosis = diagnose(table, resolved.rl_mode, run_id=run_dir.name)
    diagnosis.job = "job.yaml"
    if scraper is not None and scraper.failures:
        diagnosis.notes.append(f"{scraper.failures} scrapes of {job.metrics.vllm_metrics_url} failed")
    save_diagnosis(diagnosis, run_dir / DIAGNOSIS_NAME)
    return ProfileResult(run_dir=run_dir, table=table, diagnosis=diagnosis, launch=launch)
