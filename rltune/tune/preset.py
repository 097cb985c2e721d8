"""Write the tuned preset: the job as given, with the best knob values found and where they came from."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from rltune.contracts.job import JobSpec, KnobValue, load_job
from rltune.contracts.outputs import safe_name
from rltune.contracts.schema import atomic_write_text, to_data


def write_tuned_preset(job: JobSpec, job_path: str | Path, knobs: dict[str, KnobValue], out_dir: str | Path,
                       provenance: dict[str, Any]) -> Path:
    """Write ``out_dir/<job name>.yaml`` and return its path.

    The job's name goes through :func:`~rltune.contracts.outputs.safe_name`: a name read from the
    job file (``../../tmp/x``) can never put the preset outside ``out_dir``.

    The launch working directory is rewritten so the preset starts the job from the same directory
    as the original wherever the preset lives. ``provenance`` (untuned and tuned step, speed-up,
    runs) becomes the file's header comment; the preset is read back to prove it is a valid job.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tuned = copy.deepcopy(job)
    tuned.knobs = dict(knobs)
    original_workdir = (Path(job_path).resolve().parent / job.launch.workdir).resolve()
    tuned.launch.workdir = os.path.relpath(original_workdir, out_dir.resolve())
    header = [f"# Tuned by 'rltune auto' from {job_path}."]
    header += [f"# {key}: {value}" for key, value in provenance.items()]
    body = yaml.safe_dump(to_data(tuned), sort_keys=False, allow_unicode=True, width=100)
    path = out_dir / f"{safe_name(job.name, default='job')}.yaml"
    atomic_write_text(path, "\n".join(header) + "\n" + body)
    load_job(path)
    return path
