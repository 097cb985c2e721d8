"""The library builder's plan: what it runs, in which order, and that its run ids make a build resumable."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_builder():
    spec = importlib.util.spec_from_file_location("build_library", ROOT / "bench" / "build_library.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_plan_runs_the_baseline_first_singles_before_combinations_and_repeats_the_baseline():
    builder = load_builder()
    from rltune.contracts.job import load_job

    job = load_job(ROOT / "presets" / "cpu-tool-use.yaml")
    plan = builder.job_plan(job, {}, True, combos=5, repeats=4, repeat_singles=2, seed=0)
    assert plan[0] == {}
    assert sum(1 for o in plan if o == {}) == 4
    sizes = [len(o) for o in plan]
    last_single = max(i for i, n in enumerate(sizes) if n == 1)
    first_combo = min(i for i, n in enumerate(sizes) if n >= 2)
    assert last_single < first_combo and sum(1 for n in sizes if n >= 2) == 5
    singles = [json.dumps(o, sort_keys=True) for o in plan if len(o) == 1]
    assert len(singles) - len(set(singles)) == 2  # two single changes measured twice
    assert {"sandbox_pool_size": 2} in plan and {"prebuilt_image": True} in plan
    for overrides in plan:  # only knobs the job maps, never its baseline value
        assert all(k in job.launch.knob_map and job.knobs.get(k) != v for k, v in overrides.items())
    math_job = load_job(ROOT / "presets" / "cpu-demo.yaml")
    assert all("sandbox_pool_size" not in o for o in builder.job_plan(math_job, {}, True, 5, 4, 2, 0))


def test_run_ids_are_deterministic_and_count_repeats():
    builder = load_builder()
    a = builder.run_id_of("tiny-math-cpu", {"micro_batch_size": 2, "packing": True}, 1)
    assert a == builder.run_id_of("tiny-math-cpu", {"packing": True, "micro_batch_size": 2}, 1)
    assert a.startswith("tiny-math-cpu/micro_batch_size=2-packing=True/") and a.endswith("/r1")
    assert builder.run_id_of("tiny-math-cpu", {}, 0).split("/")[1] == "baseline"
    assert builder.settings_plan({"x": [1, 2]}, 0, 3, 7) == builder.settings_plan({"x": [1, 2]}, 0, 3, 7)
