"""A file of another kind, or made for another job, is named as such in one line.

The files are the shipped presets and the real chain of conftest.py (a verl log profiled, proposed
and forecast for the shipped verl preset).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from rltune.cli.main import main
from rltune.contracts.candidates import load_candidates
from rltune.contracts.diagnosis import load_diagnosis
from rltune.contracts.forecast import load_forecast
from rltune.contracts.identity import KINDS, check_same_job, kind_of
from rltune.contracts.job import load_job
from rltune.contracts.knowledge import load_knowledge
from rltune.contracts.reward_check import load_reward_check
from rltune.contracts.verdict import load_verdict
from rltune.errors import OtherJobError, UnknownKeyError, WrongArtifactError
from rltune.predict.forecast import forecast_candidates
from rltune.sync.bench.run import load_sync_bench_config
from rltune.tune.knowledge import load_default_knowledge
from rltune.tune.propose import propose
from rltune.workload.config import load_workload_config

from .conftest import DEMO_JOB, PRESETS, VERL_JOB

LOADERS = {"job": load_job, "diagnosis": load_diagnosis, "candidates": load_candidates, "forecast": load_forecast,
           "knowledge": load_knowledge, "verdict": load_verdict, "reward_check": load_reward_check,
           "workload": load_workload_config, "sync_bench": load_sync_bench_config}
FILES = {"job": VERL_JOB, "diagnosis": "diagnosis", "candidates": "candidates", "forecast": "forecast",
         "knowledge": PRESETS / "knowledge.yaml", "workload": PRESETS / "workload" / "tiny-math.yaml",
         "sync_bench": PRESETS / "sync" / "cpu.yaml"}
PAIRS = [(f, loader) for f, loader in itertools.product(FILES, LOADERS) if f != loader]


def _file(chain, kind: str) -> Path:
    source = FILES[kind]
    return getattr(chain, source) if isinstance(source, str) else source


@pytest.mark.parametrize(("given", "expected"), PAIRS, ids=[f"{g}-as-{e}" for g, e in PAIRS])
def test_a_file_of_another_kind_is_named_before_its_fields_are_read(chain, given, expected):
    path = _file(chain, given)
    with pytest.raises(WrongArtifactError) as err:
        LOADERS[expected](path)
    other, wanted = KINDS[given], KINDS[expected]
    assert str(err.value) == f"{path}: this is {other.noun} ({other.origin}), not {wanted.noun}; {wanted.wanted}"


def test_the_issues_case_reads_as_the_issue_asks(chain):
    with pytest.raises(WrongArtifactError) as err:
        load_candidates(chain.diagnosis)
    assert str(err.value) == (f"{chain.diagnosis}: this is a diagnosis (written by 'rltune profile'), not a candidates "
                              "file; give 'rltune predict' the candidates.yaml from 'rltune propose'")


@pytest.mark.parametrize("kind", list(FILES))
def test_each_real_file_is_recognised_as_its_own_kind(chain, kind):
    data = yaml.safe_load(_file(chain, kind).read_text())
    assert kind_of(data) == kind
    LOADERS[kind](_file(chain, kind))


def test_a_misspelt_key_of_the_right_kind_is_still_reported_as_a_misspelling(tmp_path, chain):
    text = chain.diagnosis.read_text().replace("\nrun_id:", "\nrun_idd:", 1)
    path = tmp_path / "diagnosis.yaml"
    path.write_text(text)
    with pytest.raises(UnknownKeyError) as err:
        load_diagnosis(path)
    assert str(err.value) == f"{path}: run_idd: unknown key (did you mean 'run_id'?)"


def test_predict_given_a_diagnosis_says_so_in_one_line(tmp_path, chain, capsys):
    code = main(["predict", str(chain.diagnosis), "--library", str(tmp_path / "cases"), "--new-library"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (f"rltune: {chain.diagnosis}: this is a diagnosis (written by 'rltune profile'), not a candidates "
                   "file; give 'rltune predict' the candidates.yaml from 'rltune propose'\n")
    assert not (tmp_path / "cases").exists()


# -- job identity -------------------------------------------------------------------------------

VERL_NAME = "verl-grpo-qwen3-8b-gsm8k"
OTHER = ("made for job 'verl-grpo-qwen3-8b-gsm8k', but the job given is 'tiny-math-cpu'; give the job.yaml of "
         "'verl-grpo-qwen3-8b-gsm8k', or make this file again from a run of 'tiny-math-cpu'")


def test_the_chain_carries_its_jobs_name(chain):
    assert load_diagnosis(chain.diagnosis).job_name == VERL_NAME
    assert load_candidates(chain.candidates).job_name == VERL_NAME
    assert load_forecast(chain.forecast).job_name == VERL_NAME


def test_propose_refuses_a_diagnosis_of_another_jobs_run(chain):
    with pytest.raises(OtherJobError) as err:
        propose(load_diagnosis(chain.diagnosis), load_job(DEMO_JOB), load_default_knowledge(),
                diagnosis_file=str(chain.diagnosis))
    assert str(err.value) == f"{chain.diagnosis}: job_name: {OTHER}"


def test_predict_refuses_candidates_of_another_job(chain):
    with pytest.raises(OtherJobError) as err:
        forecast_candidates(load_job(DEMO_JOB), load_candidates(chain.candidates), [],
                            candidates_file=str(chain.candidates))
    assert str(err.value) == f"{chain.candidates}: job_name: {OTHER}"


def test_check_same_job_names_the_file_and_passes_the_same_job(chain):
    demo, verl = load_job(DEMO_JOB), load_job(VERL_JOB)
    forecast = load_forecast(chain.forecast)
    check_same_job(str(chain.forecast), forecast.job_name, verl)
    with pytest.raises(OtherJobError) as err:
        check_same_job(str(chain.forecast), forecast.job_name, demo)
    assert str(err.value) == f"{chain.forecast}: job_name: {OTHER}"


@pytest.mark.parametrize("kind", ["diagnosis", "candidates", "forecast"])
def test_a_file_written_before_job_name_still_loads_and_is_not_checked(tmp_path, chain, kind):
    data = yaml.safe_load(getattr(chain, kind).read_text())
    del data["job_name"]
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = LOADERS[kind](path)
    assert loaded.job_name is None
    check_same_job(str(path), loaded.job_name, load_job(DEMO_JOB))
