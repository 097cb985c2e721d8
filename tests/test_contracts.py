"""The artifact contracts refuse bad files with one located line, and round-trip good ones."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rltune.contracts.job import load_job, save_job
from rltune.contracts.schema import atomic_write_text, to_data
from rltune.errors import (
    ArtifactError,
    MalformedFileError,
    MissingFieldError,
    SchemaVersionError,
    UnknownKeyError,
    WrongTypeError,
)

DEMO = Path(__file__).resolve().parents[1] / "presets" / "cpu-demo.yaml"


def write(tmp_path: Path, data, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.fixture
def job_data() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_demo_job_loads_with_its_values():
    job = load_job(DEMO)
    assert job.name == "tiny-math-cpu"
    assert job.workload.tasks_per_batch == 8
    assert job.rl_mode == "sync"
    assert job.launch.command[:3] == ["rltune", "workload", "run"]


def test_misspelt_key_names_file_field_and_suggestion(tmp_path, job_data):
    job_data["launch"]["comand"] = job_data["launch"].pop("command")
    path = write(tmp_path, job_data)
    with pytest.raises(UnknownKeyError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: launch.comand: unknown key (did you mean 'command'?)"


def test_wrong_type_names_expected_and_found(tmp_path, job_data):
    job_data["workload"]["tasks_per_batch"] = "eight"
    with pytest.raises(WrongTypeError, match=r"workload\.tasks_per_batch: expected an integer, found string 'eight'"):
        load_job(write(tmp_path, job_data))


def test_boolean_is_not_accepted_as_integer(tmp_path, job_data):
    job_data["workload"]["trials_per_task"] = True
    with pytest.raises(WrongTypeError, match="trials_per_task: expected an integer, found boolean"):
        load_job(write(tmp_path, job_data))


def test_missing_required_field(tmp_path, job_data):
    del job_data["model"]["layers"]
    with pytest.raises(MissingFieldError, match=r"model\.layers: missing required field"):
        load_job(write(tmp_path, job_data))


def test_newer_schema_version_is_refused(tmp_path, job_data):
    job_data["schema_version"] = 2
    with pytest.raises(SchemaVersionError, match="newer rltune"):
        load_job(write(tmp_path, job_data))


@pytest.mark.parametrize("version", [None, 0, "1", 1.5, True])
def test_absent_or_malformed_schema_version(tmp_path, job_data, version):
    if version is None:
        del job_data["schema_version"]
    else:
        job_data["schema_version"] = version
    with pytest.raises(ArtifactError, match="schema_version"):
        load_job(write(tmp_path, job_data))


def test_bad_literal_suggests_close_choice(tmp_path, job_data):
    job_data["launch"]["dialect"] = "hydr"
    with pytest.raises(WrongTypeError, match="did you mean 'hydra'"):
        load_job(write(tmp_path, job_data))


def test_bounds_are_checked(tmp_path, job_data):
    job_data["workload"]["tasks_per_batch"] = 0
    with pytest.raises(WrongTypeError, match="expected a value >= 1, found 0"):
        load_job(write(tmp_path, job_data))


def test_cross_field_rule_is_located(tmp_path, job_data):
    job_data["limits"]["warmup_steps"] = job_data["limits"]["steps"]
    with pytest.raises(WrongTypeError, match=r"limits\.warmup_steps: must be smaller than steps"):
        load_job(write(tmp_path, job_data))


def test_unknown_rl_mode_in_knobs(tmp_path, job_data):
    job_data["knobs"]["rl_mode"] = "async"
    with pytest.raises(WrongTypeError, match="knobs.rl_mode: expected one of sync"):
        load_job(write(tmp_path, job_data))


def test_list_item_paths_are_indexed(tmp_path, job_data):
    job_data["launch"]["command"][1] = 5
    with pytest.raises(WrongTypeError, match=r"launch\.command\[1\]: expected a string, found number 5"):
        load_job(write(tmp_path, job_data))


@pytest.mark.parametrize("text, fragment", [
    ("launch: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "expected a YAML mapping"),
    ("", "expected a YAML mapping"),
    ("!!python/object:os.system {}", "not valid YAML"),
])
def test_malformed_yaml_is_one_line(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(MalformedFileError) as err:
        load_job(path)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(MalformedFileError, match="no such file"):
        load_job(tmp_path / "nope.yaml")


def test_round_trip_is_identical(tmp_path):
    job = load_job(DEMO)
    save_job(job, tmp_path / "out.yaml")
    again = load_job(tmp_path / "out.yaml")
    assert to_data(again) == to_data(job)


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "a.yaml"
    path.write_text("old")

    class Boom(Exception):
        pass

    def broken_replace(src, dst):
        raise Boom()

    monkeypatch.setattr("os.replace", broken_replace)
    with pytest.raises(Boom):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.yaml"]


def test_validation_does_not_mutate_input(job_data):
    from rltune.contracts.job import JobSpec
    from rltune.contracts.schema import from_data

    before = copy.deepcopy(job_data)
    from_data(JobSpec, job_data, "job.yaml")
    assert job_data == before
