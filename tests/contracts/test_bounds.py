"""Numbers are finite and in range, names are names, enums list their values: one located line each.

Every case changes one value of a real file (the shipped presets, or the real chain in
conftest.py) and expects the exact message: the file, the dotted field, what was expected.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rltune.contracts.candidates import load_candidates
from rltune.contracts.diagnosis import load_diagnosis
from rltune.contracts.forecast import load_forecast
from rltune.contracts.job import check_knob_overrides, load_job
from rltune.contracts.knowledge import load_knowledge
from rltune.errors import ArtifactError, UnknownKeyError, WrongTypeError
from rltune.workload.config import load_workload_config

from .conftest import DEMO_JOB, PRESETS

STAGE_GROUPS = "'rollout', 'training', 'weight_sync', 'training+weight_sync'"


def changed(source: Path, tmp_path: Path, where: tuple, value) -> Path:
    """A copy of ``source`` with the value at ``where`` (keys and list indices) set to ``value``."""
    data = yaml.safe_load(source.read_text())
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


JOB_CASES = [
    (("knobs", "micro_batch_size"), -8, "knobs.micro_batch_size: expected a count >= 1, found -8"),
    (("knobs", "micro_batch_size"), 0, "knobs.micro_batch_size: expected a count >= 1, found 0"),
    (("knobs", "micro_batch_size"), "abc", "knobs.micro_batch_size: expected an integer, found string 'abc'"),
    (("knobs", "micro_batch_size"), 8.5, "knobs.micro_batch_size: expected an integer, found 8.5"),
    (("knobs", "micro_batch_size"), True, "knobs.micro_batch_size: expected an integer, found boolean true"),
    (("knobs", "num_engines"), 0, "knobs.num_engines: expected a count >= 1, found 0"),
    (("knobs", "packing"), "yes", "knobs.packing: expected true or false, found string 'yes'"),
    (("knobs", "engine_batching"), 3, "knobs.engine_batching: expected a string, found 3"),
    (("knobs", "sandbox_pool_size"), -1, "knobs.sandbox_pool_size: expected a value >= 0, found -1"),
    (("knobs", "rl_mode"), "banana", "knobs.rl_mode: expected one of sync, one_step_async, fully_async, found 'banana'"),
    (("name",), "", "name: give the job a name (e.g. 'qwen3-8b-math')"),
    (("name",), "   ", "name: give the job a name (e.g. 'qwen3-8b-math')"),
    (("name",), "../../../../tmp/x", "name: '../../../../tmp/x' is not a plain name: no path separators, surrounding "
                                     "spaces or control characters"),
    (("name",), "a\\b", "name: 'a\\\\b' is not a plain name: no path separators, surrounding spaces or control characters"),
    (("name",), "..", "name: '..' is not a plain name: no path separators, surrounding spaces or control characters"),
    (("name",), "x\n", "name: 'x\\n' is not a plain name: no path separators, surrounding spaces or control characters"),
    (("model", "name"), "", "model.name: give the model's name (e.g. 'Qwen3-0.6B')"),
    (("model", "layers"), 10**30, "model.layers: expected a value <= 10000, found 1e+30"),
    (("model", "layers"), 0, "model.layers: expected a value >= 1, found 0"),
    (("model", "total_params"), 1e30, "model.total_params: expected a value <= 1e+15, found 1e+30"),
    (("model", "hidden"), -128, "model.hidden: expected a value >= 1, found -128"),
    (("workload", "context_limit_tokens"), 8, "workload.context_limit_tokens: is below answer_cap_tokens (16): a trial "
                                             "could not hold one whole answer; raise it or lower the cap"),
    (("workload", "tasks_per_batch"), 0, "workload.tasks_per_batch: expected a value >= 1, found 0"),
    (("workload", "trial_timeout_s"), 1e300, "workload.trial_timeout_s: expected a value <= 1e+07, found 1e+300"),
    (("gpus", "count"), -1, "gpus.count: expected a value >= 0, found -1"),
    (("gpus", "device"), "", "gpus.device: give the accelerator kind, e.g. 'H200', or 'cpu'"),
    (("launch", "command"), [], "launch.command: give the job's argv, its program first (e.g. [python, train.py, ...])"),
    (("launch", "command"), [""], "launch.command: give the job's argv, its program first (e.g. [python, train.py, ...])"),
    (("launch", "timeout_s"), 0, "launch.timeout_s: expected a value >= 1, found 0"),
    (("limits", "steps"), 10**23, "limits.steps: expected a value <= 1000000, found 1e+23"),
    (("limits", "steps"), 0, "limits.steps: expected a value >= 1, found 0"),
    (("limits", "noise_pct"), 150, "limits.noise_pct: expected a value <= 100, found 150"),
    (("limits", "noise_pct"), -5, "limits.noise_pct: expected a value >= 0, found -5"),
    (("limits", "min_forecast_gain_pct"), -50, "limits.min_forecast_gain_pct: expected a value >= 0, found -50"),
]


@pytest.mark.parametrize(("where", "value", "message"), JOB_CASES, ids=[f"{'.'.join(c[0])}={c[1]!r}" for c in JOB_CASES])
def test_a_job_value_out_of_range_or_of_the_wrong_kind_is_one_line(tmp_path, where, value, message):
    data = yaml.safe_load(DEMO_JOB.read_text())
    if where == ("knobs", "sandbox_pool_size"):  # a knob whose smallest value is 0, not 1
        data["knobs"]["sandbox_pool_size"] = 4
    source = tmp_path / "source" / DEMO_JOB.name
    source.parent.mkdir()
    source.write_text(yaml.safe_dump(data, sort_keys=False))
    path = changed(source, tmp_path, where, value)
    with pytest.raises(WrongTypeError) as err:
        load_job(path)
    assert str(err.value) == f"{path}: {message}"


def test_every_real_preset_still_loads():
    names = [load_job(path).name for path in sorted(PRESETS.glob("*.yaml")) if path.name != "knowledge.yaml"]
    assert len(names) >= 15 and all(names)


KNOWLEDGE = PRESETS / "knowledge.yaml"


def _fix_index(knob: str, relative: bool) -> int:
    fixes = yaml.safe_load(KNOWLEDGE.read_text())["fixes"]
    return next(i for i, f in enumerate(fixes) if knob in f["overrides"]
                and isinstance(f["overrides"][knob], str) == relative)


@pytest.mark.parametrize(("where", "value", "message"), [
    (("knobs", "micro_batch_size", "min"), 300, "knobs.micro_batch_size.min: min (300) is above max (256); swap them"),
    (("knobs", "micro_batch_size", "min"), 1.5, "knobs.micro_batch_size.min: an int knob's min is a whole number, found 1.5"),
    (("knobs", "packing", "min"), 0, "knobs.packing.min: only a numeric knob has a min; this one is bool"),
    (("knobs", "rl_mode", "choices"), ["sync", 2], "knobs.rl_mode.choices[1]: expected a str value, found 2"),
    (("knobs", "micro_batch_size", "type"), "integer", None),  # a Literal: the valid types are listed
])
def test_a_knowledge_knob_that_contradicts_itself_is_refused(tmp_path, where, value, message):
    path = changed(KNOWLEDGE, tmp_path, where, value)
    with pytest.raises(WrongTypeError) as err:
        load_knowledge(path)
    if message is None:
        assert str(err.value) == (f"{path}: knobs.micro_batch_size.type: expected one of 'int', 'float', 'bool', 'str', "
                                  "found string 'integer' (did you mean 'int'?)")
    else:
        assert str(err.value) == f"{path}: {message}"


@pytest.mark.parametrize(("value", "problem"), [
    ("/0", "relative change '/0' divides by zero; give a literal value instead"),
    ("*0", "relative change '*0' multiplies by zero; give a literal value instead"),
    ("/0.0", "relative change '/0.0' divides by zero; give a literal value instead"),
])
def test_a_relative_change_by_zero_is_refused_at_load(tmp_path, value, problem):
    i = _fix_index("micro_batch_size", relative=True)
    path = changed(KNOWLEDGE, tmp_path, ("fixes", i, "overrides", "micro_batch_size"), value)
    with pytest.raises(WrongTypeError) as err:
        load_knowledge(path)
    assert str(err.value) == f"{path}: fixes[{i}].overrides.micro_batch_size: {problem}"


@pytest.mark.parametrize(("knob", "value", "problem"), [
    ("micro_batch_size", 0, "0 is below the knob's min (1)"),
    ("micro_batch_size", 512, "512 is above the knob's max (256)"),
    ("micro_batch_size", 8.0, "expected an int value (or '*2', '/2', '+1', '-1'), found 8.0"),
])
def test_a_literal_fix_value_outside_the_knob_is_refused(tmp_path, knob, value, problem):
    i = _fix_index(knob, relative=True)
    path = changed(KNOWLEDGE, tmp_path, ("fixes", i, "overrides", knob), value)
    with pytest.raises(WrongTypeError) as err:
        load_knowledge(path)
    assert str(err.value) == f"{path}: fixes[{i}].overrides.{knob}: {problem}"


WORKLOAD = PRESETS / "workload" / "tiny-math.yaml"


@pytest.mark.parametrize(("override", "message"), [
    ("engine.num_engines=0", "engine.num_engines: expected a value >= 1, found 0"),
    ("engine.num_engines=1000", "engine.num_engines: expected a value <= 64, found 1000"),
    ("env.context_limit_tokens=12", "env.context_limit_tokens: is below env.max_new_tokens (16): a trial could not "
                                    "hold one whole answer"),
    ("trainer.micro_batch_size=abc", "trainer.micro_batch_size: expected an integer, found string 'abc'"),
    ("orchestrator.rl_mode=banana", "orchestrator.rl_mode: expected one of 'sync', 'one_step_async', 'fully_async', "
                                    "found string 'banana'"),
])
def test_a_workload_value_out_of_range_is_one_line(override, message):
    with pytest.raises(WrongTypeError) as err:
        load_workload_config(WORKLOAD, [override])
    assert str(err.value) == f"{WORKLOAD}: {message}"


@pytest.mark.parametrize(("kind", "where", "value", "message"), [
    ("forecast", ("gate_pct",), -50, "gate_pct: expected a value >= 0, found -50"),
    ("forecast", ("gate_pct",), 250, "gate_pct: expected a value <= 100, found 250"),
    ("forecast", ("limiting_stage",), "banana",
     f"limiting_stage: expected one of {STAGE_GROUPS}, 'unknown', '', found string 'banana'"),
    ("forecast", ("baseline_step_s",), -1.0, "baseline_step_s: expected a value >= 0, found -1.0"),
    ("forecast", ("forecasts", 0, "limiting_stage"), "banana",
     f"forecasts[0].limiting_stage: expected one of {STAGE_GROUPS}, found string 'banana'"),
    ("forecast", ("forecasts", 0, "stages_s", "rollout"), -1.0,
     "forecasts[0].stages_s.rollout: expected seconds in [0, 1e+07], found -1"),
    ("forecast", ("forecasts", 0, "range_s"), [-1.0, 2.0],
     "forecasts[0].range_s: expected [low, high] seconds with 0 <= low <= high, found [-1.0, 2.0]"),
    ("forecast", ("forecasts", 0, "gain_pct"), 180.0, "forecasts[0].gain_pct: expected a value <= 100, found 180.0"),
    ("forecast", ("forecasts", 0, "rl_mode"), "asynchronous",
     "forecasts[0].rl_mode: expected one of 'sync', 'one_step_async', 'fully_async', found string 'asynchronous'"),
    ("forecast", ("forecasts", 0, "step_s"), float("nan"), "forecasts[0].step_s: expected a finite number, found nan; give a real value"),
    ("diagnosis", ("limiting_stage",), "banana",
     f"limiting_stage: expected one of {STAGE_GROUPS}, 'unknown', found string 'banana'"),
    ("diagnosis", ("step_median_s",), -0.5, "step_median_s: expected a value >= 0, found -0.5"),
    ("diagnosis", ("step_mean_s",), 1e300, "step_mean_s: expected a value <= 1e+07, found 1e+300"),
    ("diagnosis", ("stage_medians_s", "rollout"), -2.0, "stage_medians_s.rollout: expected seconds in [0, 1e+07], found -2"),
    ("diagnosis", ("stages", "step_s", "p90_s"), 0.0, None),  # p10 <= median <= p90
    ("candidates", ("limiting_stage",), "banana",
     f"limiting_stage: expected one of {STAGE_GROUPS}, 'unknown', found string 'banana'"),
    ("candidates", ("next_stage",), "banana", f"next_stage: expected one of {STAGE_GROUPS}, found string 'banana'"),
    ("candidates", ("candidates", 0, "id"), "", "candidates[0].id: a candidate needs an id (e.g. 'r1-c3')"),
])
def test_a_chain_value_out_of_range_is_one_line(tmp_path, chain, kind, where, value, message):
    load = {"forecast": load_forecast, "diagnosis": load_diagnosis, "candidates": load_candidates}[kind]
    path = changed(getattr(chain, kind), tmp_path, where, value)
    with pytest.raises(WrongTypeError) as err:
        load(path)
    if message is None:
        assert str(err.value).startswith(f"{path}: stages.step_s.median_s: expected p10_s <= median_s <= p90_s, found ")
    else:
        assert str(err.value) == f"{path}: {message}"


def test_the_chain_files_round_trip(chain):
    assert load_forecast(chain.forecast).gate_pct == 5.0
    assert load_candidates(chain.candidates).limiting_stage == "training+weight_sync"
    assert load_diagnosis(chain.diagnosis).limiting_stage == "training+weight_sync"


# -- knob overrides (--set, a trial's overrides) against the job --------------------------------


@pytest.fixture(scope="module")
def demo():
    return load_job(DEMO_JOB)


@pytest.mark.parametrize(("overrides", "error", "message"), [
    ({"micro_batch_size": "abc"}, WrongTypeError,
     "micro_batch_size: expected an integer, found string 'abc' (the job's baseline is 8)"),
    ({"micro_batch_size": -8}, WrongTypeError, "micro_batch_size: expected a count >= 1, found -8 (the job's baseline is 8)"),
    ({"micro_batch_size": 2.5}, WrongTypeError, "micro_batch_size: expected an integer, found 2.5 (the job's baseline is 8)"),
    ({"num_engines": 0}, WrongTypeError, "num_engines: expected a count >= 1, found 0 (the job's baseline is 1)"),
    ({"packing": 1}, WrongTypeError, "packing: expected true or false, found 1 (the job's baseline is False)"),
    ({"rl_mode": "banana"}, WrongTypeError,
     "rl_mode: expected one of sync, one_step_async, fully_async, found string 'banana' (the job's baseline is 'sync')"),
    ({"micro_bach_size": 4}, UnknownKeyError,
     "micro_bach_size: not a knob of job 'tiny-math-cpu' (did you mean 'micro_batch_size'?); add it under 'knobs' "
     "with its baseline value"),
    ([("micro_batch_size", 4), ("micro_batch_size", 16)], WrongTypeError,
     "micro_batch_size: given twice (4, then 16); give it once"),
])
def test_a_bad_knob_override_is_refused_naming_its_source(demo, overrides, error, message):
    with pytest.raises(error) as err:
        check_knob_overrides(demo, overrides, "--set")
    assert str(err.value) == f"--set: {message}"
    assert isinstance(err.value, ArtifactError)


def test_good_overrides_come_back_as_a_mapping(demo):
    given = [("micro_batch_size", 16), ("packing", True), ("rl_mode", "fully_async"), ("engine_batching", "static")]
    assert check_knob_overrides(demo, given, "--set") == dict(given)
    assert check_knob_overrides(demo, {}, "--set") == {}


def test_a_knob_the_knowledge_base_does_not_know_takes_its_baselines_kind(tmp_path, demo):
    job = copy.deepcopy(demo)
    job.knobs["task_seed"] = 3
    assert check_knob_overrides(job, {"task_seed": 4.5}, "--set") == {"task_seed": 4.5}  # a number for a number
    with pytest.raises(WrongTypeError) as err:
        check_knob_overrides(job, {"task_seed": "x"}, "forecast.yaml: forecasts[0].overrides")
    assert str(err.value) == ("forecast.yaml: forecasts[0].overrides: task_seed: expected a number, found string 'x' "
                              "(the job's baseline is 3)")
