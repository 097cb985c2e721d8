"""Check a tuning job that runs the reference workload before it launches anything.

A job whose ``launch.command`` is ``rltune workload run CONFIG ...`` in the ``rltune`` dialect gets
its workload config loaded with exactly the overrides a run would pass (the job's command, then
every mapped knob), and, with vLLM engines, vLLM's own engine-argument validation. A misspelt key
in ``launch.knob_map`` (``engine.vllm.max_num_seqz``) or a value vLLM refuses (``--set
kv_cache_dtype=fp9``) is then one line naming the job file, the knob and the key, with the
workload's (and vLLM's) own words, exit 2, before the job starts. Any other job is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rltune.contracts.job import JobSpec, KnobValue
from rltune.errors import ArtifactError, DuplicateKeyError, MeasurementError, RltuneError

# options of 'rltune workload run' that take a value (everything else after CONFIG is an override)
_VALUE_OPTIONS = {"--run-dir", "--steps"}


def workload_invocation(job: JobSpec) -> tuple[str, list[str]] | None:
    """(CONFIG, the overrides written in the command) if the job runs ``rltune workload run``; else None."""
    if job.launch.dialect != "rltune":
        return None
    command = list(job.launch.command)
    for i in range(len(command) - 2):
        if command[i] == "workload" and command[i + 1] == "run":
            rest = command[i + 2:]
            break
    else:
        return None
    config, overrides, skip = None, [], False
    for part in rest:
        if skip:
            skip = False
        elif part in _VALUE_OPTIONS:
            skip = True
        elif part.startswith("-"):
            continue
        elif config is None:
            config = part
        elif "=" in part:
            overrides.append(part)
    return (config, overrides) if config is not None else None


def check_workload_job(job: JobSpec, job_path: str | Path, overrides: Mapping[str, KnobValue] | None = None,
                       steps: int | None = None) -> None:
    """Raise one located :class:`RltuneError` if the workload would refuse this run's config."""
    from rltune.launch.dialects import render_overrides
    from rltune.launch.job import resolve_overrides, workdir_of

    found = workload_invocation(job)
    if found is None:
        return
    config, written = found
    if "{" in config:  # filled in at launch ({run_dir}): nothing to read yet
        return
    path = Path(config)
    if not path.is_absolute():
        path = workdir_of(job, Path(job_path)) / path
    if not path.exists():
        return  # the launch reports a missing file in the job's own words
    mapped = resolve_overrides(job, Path(job_path), overrides, steps)
    knob_of = {key: knob for knob, key in job.launch.knob_map.items()}
    try:
        from rltune.workload.config import load_workload_config

        cfg = load_workload_config(path, [*written, *render_overrides("rltune", mapped)])
        if cfg.engine.backend == "vllm":
            from rltune.workload.engine_vllm import check_engine_args

            check_engine_args(cfg, str(path))
    except RltuneError as exc:
        key = getattr(exc, "field", None) or _key_in(str(exc), knob_of)
        where = f"launch.knob_map.{knob_of[key]}: " if key in knob_of else ""
        raise type(exc)(*_located(exc, f"{job_path}: {where}")) from None


def _key_in(message: str, knob_of: Mapping[str, str]) -> str | None:
    hits = [key for key in knob_of if f"{key}:" in message]
    return max(hits, key=len) if hits else None


def _located(exc: RltuneError, prefix: str) -> tuple:
    """Constructor arguments of ``exc``'s class for the same message with ``prefix`` in front."""
    if isinstance(exc, DuplicateKeyError):
        return (prefix + exc.file, exc.field, exc.problem, exc.line)
    if isinstance(exc, MeasurementError):
        return (prefix + exc.file, exc.step, exc.field, exc.problem)
    if isinstance(exc, ArtifactError):
        return (prefix + exc.file, exc.field, exc.problem)
    return (prefix + str(exc),)


__all__ = ["check_workload_job", "workload_invocation"]
