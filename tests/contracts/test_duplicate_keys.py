"""A key written twice in one mapping, at any depth of any YAML rltune reads, is one located line.

YAML itself keeps the last value without a word; each case copies a real file (a shipped preset or
a file of the real chain in conftest.py), writes one of its lines twice with another value, and
expects the file, the line of the repeat, the dotted field and the line of the first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from rltune.contracts.schema import parse_yaml, read_yaml
from rltune.errors import DuplicateKeyError, MalformedFileError

from .conftest import DEMO_JOB, PRESETS


def _loaders() -> dict[str, Callable[[Path], object]]:
    from rltune.contracts.candidates import load_candidates
    from rltune.contracts.diagnosis import load_diagnosis
    from rltune.contracts.forecast import load_forecast
    from rltune.contracts.job import load_job
    from rltune.contracts.knowledge import load_knowledge
    from rltune.sync.bench.readers import load_readers_config
    from rltune.sync.bench.run import load_sync_bench_config
    from rltune.sync.estimate import load_model_spec
    from rltune.workload.config import load_workload_config

    return {"job": load_job, "knowledge": load_knowledge, "workload": load_workload_config,
            "sync": load_sync_bench_config, "readers": load_readers_config, "estimate": load_model_spec,
            "diagnosis": load_diagnosis, "candidates": load_candidates, "forecast": load_forecast}


def repeat_line(source: Path, tmp_path: Path, pattern: str, value: str) -> tuple[Path, int, int]:
    """Copy ``source`` with the first line matching ``pattern`` written again just after it, its
    value replaced by ``value``; return (copy, line of the first, line of the repeat), 1-based."""
    lines = source.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if re.search(pattern, line))
    key = lines[index].split(":", 1)[0].replace("- ", "  ")  # a list item's first key: the same item
    lines.insert(index + 1, f"{key}: {value}")
    out = tmp_path / source.name
    out.write_text("\n".join(lines) + "\n")
    return out, index + 1, index + 2


CASES = [
    # (loader, file (a preset path or a chain attribute), line pattern, repeated value, dotted field)
    ("job", DEMO_JOB, r"^name: ", "other", "name"),
    ("job", DEMO_JOB, r"^  micro_batch_size: ", "16", "knobs.micro_batch_size"),
    ("job", DEMO_JOB, r"^    micro_batch_size: ", "trainer.other", "launch.knob_map.micro_batch_size"),
    ("job", DEMO_JOB, r"^  total_params: ", "1.0e6", "model.total_params"),
    ("knowledge", PRESETS / "knowledge.yaml", r"^    min: 1$", "2", "knobs.max_sample_age.min"),
    ("knowledge", PRESETS / "knowledge.yaml", r"^  - id: ", "other_fix", "fixes[0].id"),
    ("workload", PRESETS / "workload" / "tiny-math.yaml", r"^  num_engines: ", "2", "engine.num_engines"),
    ("sync", PRESETS / "sync" / "cpu.yaml", r"^steps: ", "3", "steps"),
    ("readers", PRESETS / "sync" / "readers" / "cpu.yaml", r"^steps: ", "3", "steps"),
    ("estimate", PRESETS / "sync" / "estimate" / "qwen3-8b.yaml", r"^anchor_interval: ", "10", "anchor_interval"),
    ("diagnosis", "diagnosis", r"^limiting_stage: ", "rollout", "limiting_stage"),
    ("diagnosis", "diagnosis", r"^    median_s: ", "1.0", "stages.step_s.median_s"),
    ("candidates", "candidates", r"^  rationale: ", "other", "candidates[0].rationale"),
    ("forecast", "forecast", r"^gate_pct: ", "0.0", "gate_pct"),
    ("forecast", "forecast", r"^    rollout: ", "1.0", "forecasts[0].stages_s.rollout"),
]


@pytest.mark.parametrize(("kind", "source", "pattern", "value", "dotted"), CASES,
                         ids=[f"{c[0]}:{c[4]}" for c in CASES])
def test_a_repeated_key_names_file_line_field_and_the_first(tmp_path, chain, kind, source, pattern, value, dotted):
    source = getattr(chain, source) if isinstance(source, str) else source
    _loaders()[kind](source)  # the untouched file loads
    path, first, repeat = repeat_line(source, tmp_path, pattern, value)
    with pytest.raises(DuplicateKeyError) as err:
        _loaders()[kind](path)
    assert str(err.value) == f"{path}: line {repeat}: {dotted}: duplicate key (the first is on line {first}); keep one"
    assert (err.value.file, err.value.field, err.value.line) == (str(path), dotted, repeat)


@pytest.mark.parametrize(("text", "dotted", "lines"), [
    ("a: 1\na: 2\n", "a", (1, 2)),
    ("a: 1\n'a': 2\n", "a", (1, 2)),  # quoting does not make another key
    ("a: {b: 1, b: 2}\n", "a.b", (1, 1)),
    ("x:\n- {k: 1}\n- {k: 1, k: 2}\n", "x[1].k", (3, 3)),
    ("x:\n  - - y: 1\n      y: 2\n", "x[0][0].y", (2, 3)),
])
def test_repeats_are_found_at_any_depth_and_spelling(text, dotted, lines):
    with pytest.raises(DuplicateKeyError) as err:
        parse_yaml(text, "f.yaml")
    assert str(err.value) == f"f.yaml: line {lines[1]}: {dotted}: duplicate key (the first is on line {lines[0]}); keep one"


@pytest.mark.parametrize("text", [
    "a: 1\nb: {a: 2}\n",  # the same name in two mappings
    "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n",  # a merge key overridden on purpose
    "x: &a [1, 2]\ny: *a\n",  # an alias read twice
    "1: a\n'1': b\n",  # an integer key and a text key differ
])
def test_what_is_not_a_repeat_loads(text):
    parse_yaml(text, "f.yaml")


def test_a_repeat_is_refused_by_every_real_preset_loader_without_changing_real_presets():
    for path in sorted(PRESETS.rglob("*.yaml")):
        read_yaml(path)  # no shipped preset repeats a key


@pytest.mark.parametrize(("content", "problem"), [
    (b"PAR1\x15\x04\x15", "this is a Parquet file (a stage table or a case), not YAML; give the YAML file the command asks for"),
    (b'{"event": "start", "round": 0}\n{"event": "baseline", "round": 0}\n',
     "this is a JSON-lines file (a journal.jsonl or a metrics log), not YAML; give the YAML file the command asks for"),
    (b"name: x\n\xff\xfe\x00", "not UTF-8 text (byte 0xff at offset 8); give the YAML file the command asks for"),
])
def test_files_that_are_not_yaml_are_named_without_an_exception_name(tmp_path, content, problem):
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(MalformedFileError) as err:
        read_yaml(path)
    assert str(err.value) == f"{path}: {problem}"


def test_a_directory_given_as_a_file_is_one_line(tmp_path):
    with pytest.raises(MalformedFileError) as err:
        read_yaml(tmp_path)
    assert str(err.value) == f"{tmp_path}: is a directory; give the YAML file inside it"
