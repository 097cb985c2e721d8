"""A real profile -> propose -> predict chain, built once, for the contract tests to break copies of.

The stage table comes from a real verl log (tests/profiling/data, see its README), the job is the
shipped verl preset, the knowledge base the shipped one; the forecast comes from the theory model
(an empty library), as for a job rltune has never run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "presets"
VERL_LOG = REPO / "tests" / "profiling" / "data" / "verl_timing_s_qwen2-7b_grpo_fsdp_steps12.log"
VERL_JOB = PRESETS / "verl-grpo.yaml"
DEMO_JOB = PRESETS / "cpu-demo.yaml"


@dataclass
class Chain:
    job: Path
    diagnosis: Path
    candidates: Path
    forecast: Path
    stages: Path


@pytest.fixture(scope="session")
def chain(tmp_path_factory) -> Chain:
    from rltune.contracts.candidates import save_candidates
    from rltune.contracts.diagnosis import load_diagnosis, save_diagnosis
    from rltune.contracts.forecast import save_forecast
    from rltune.contracts.job import load_job
    from rltune.predict.forecast import forecast_candidates
    from rltune.profile import record_logs
    from rltune.tune.knowledge import load_default_knowledge
    from rltune.tune.propose import propose

    root = tmp_path_factory.mktemp("chain")
    run = record_logs(VERL_LOG, root / "base", rl_mode="fully_async")
    job = load_job(VERL_JOB)
    diagnosis = load_diagnosis(root / "base" / "diagnosis.yaml")
    diagnosis.job_name = job.name  # as the diagnosis of a run rltune launched records it
    save_diagnosis(diagnosis, root / "base" / "diagnosis.yaml")
    candidates = propose(diagnosis, job, load_default_knowledge(), job_path=str(VERL_JOB),
                         baseline_dir=str(run.run_dir))
    save_candidates(candidates, root / "candidates.yaml")
    forecast = forecast_candidates(job, candidates, [], job_path=str(VERL_JOB),
                                   candidates_file=str(root / "candidates.yaml"))
    save_forecast(forecast, root / "forecast.yaml")
    assert candidates.candidates and forecast.forecasts, "the chain must hold something to break"
    return Chain(VERL_JOB, root / "base" / "diagnosis.yaml", root / "candidates.yaml", root / "forecast.yaml",
                 root / "base" / "stages.parquet")
