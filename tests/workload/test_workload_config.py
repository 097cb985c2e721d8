"""The workload config: schema errors, overrides and their errors, presets, the CLI's exit code."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rltune.cli.main import main
from rltune.errors import (
    MalformedFileError,
    MissingFieldError,
    SchemaVersionError,
    UnknownKeyError,
    WrongTypeError,
)
from rltune.workload.config import WorkloadConfig, knob_keys, load_workload_config, parse_override

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "presets" / "workload").glob("*.yaml"))
TINY = REPO / "presets" / "workload" / "tiny-math.yaml"

# The knobs the tuner's knowledge base maps abstract knob names onto (docs/workload.md lists them).
TUNER_KNOBS = [
    "orchestrator.rl_mode", "orchestrator.max_sample_age", "orchestrator.steps", "orchestrator.tasks_per_batch",
    "orchestrator.trials_per_task", "trainer.micro_batch_size", "trainer.packing", "trainer.grad_checkpointing",
    "trainer.reuse_rollout_logprobs", "trainer.lr", "engine.max_concurrent_seqs", "engine.batching",
    "engine.num_engines", "engine.compile", "env.sandbox_pool_size", "env.prebuilt_image", "env.trial_timeout_s",
    "sync.transport",
]


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "wl.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_preset_parses_and_names_schema_version_1():
    assert {p.name for p in PRESETS} >= {"tiny-math.yaml", "tiny-tool-use.yaml", "small-math.yaml", "small-tool-use.yaml"}
    for path in PRESETS:
        cfg = load_workload_config(path)
        assert cfg.schema_version == 1
        assert cfg.batch_size == cfg.orchestrator.tasks_per_batch * cfg.orchestrator.trials_per_task


def test_every_tuner_knob_is_a_config_key():
    keys = knob_keys()
    assert [k for k in TUNER_KNOBS if k not in keys] == []


def test_every_knob_is_documented():
    doc = (REPO / "docs" / "workload.md").read_text()
    assert [k for k in knob_keys() if f"`{k}`" not in doc] == []


def test_overrides_are_parsed_as_yaml_and_applied():
    cfg = load_workload_config(TINY, ["trainer.packing=true", "trainer.lr=3e-5", "engine.batching=static",
                                      "orchestrator.rl_mode=fully_async", "env.trial_timeout_s=2"])
    assert cfg.trainer.packing is True
    assert cfg.trainer.lr == pytest.approx(3e-5)
    assert (cfg.engine.batching, cfg.orchestrator.rl_mode, cfg.env.trial_timeout_s) == ("static", "fully_async", 2.0)


def test_unknown_override_key_names_the_file_and_suggests_the_key():
    with pytest.raises(UnknownKeyError) as err:
        load_workload_config(TINY, ["trainer.micro_batchsize=4"])
    assert str(err.value) == (f"{TINY}: trainer.micro_batchsize: unknown override key "
                              "(did you mean 'trainer.micro_batch_size'?)")


@pytest.mark.parametrize(("override", "error", "text"), [
    ("trainer.micro_batch_size", MalformedFileError, "is not 'dotted.key=value'"),
    ("=3", MalformedFileError, "is not 'dotted.key=value'"),
    ("trainer.micro_batch_size=[1", WrongTypeError, "not valid YAML"),
    ("trainer.micro_batch_size=two", WrongTypeError, "expected an integer"),
    ("trainer.micro_batch_size=0", WrongTypeError, "expected a value >= 1"),
    ("trainer.packing=maybe", WrongTypeError, "expected true or false"),
    ("engine.batching=stati", WrongTypeError, "did you mean 'static'"),
    ("trainer=3", UnknownKeyError, "unknown override key"),
    ("nonsense.key=1", UnknownKeyError, "see docs/workload.md"),
    ("trainer.advantage_sign=0", WrongTypeError, "trainer.advantage_sign: must be 1 (train) or -1"),
    ("trainer.advantage_sign=2", WrongTypeError, "expected a value <= 1"),
    ("env.operators=+/", WrongTypeError, "env.operators: expected one or more of '+-*'"),
    ("env.max_terms=1", WrongTypeError, "expected a value >= 2"),
])
def test_bad_overrides_fail_with_a_located_message(override, error, text):
    with pytest.raises(error) as err:
        load_workload_config(TINY, [override])
    assert text in str(err.value)
    assert str(TINY) in str(err.value)


def test_parse_override_keeps_strings_and_numbers_apart():
    assert parse_override("sync.transport=inprocess", "f") == ("sync.transport", "inprocess")
    assert parse_override("orchestrator.steps=10", "f") == ("orchestrator.steps", 10)
    assert parse_override("trainer.lr= 1.0e-5", "f") == ("trainer.lr", 1e-5)


def test_schema_errors_in_the_file(tmp_path):
    base = yaml.safe_load(TINY.read_text())
    bad = dict(base, trainer=dict(base["trainer"], packin=True))
    with pytest.raises(UnknownKeyError, match=r"trainer\.packin: unknown key \(did you mean 'packing'\?\)"):
        load_workload_config(write(tmp_path, bad))
    with pytest.raises(MissingFieldError, match="schema_version"):
        load_workload_config(write(tmp_path, {k: v for k, v in base.items() if k != "schema_version"}))
    with pytest.raises(SchemaVersionError):
        load_workload_config(write(tmp_path, dict(base, schema_version=2)))
    with pytest.raises(WrongTypeError, match="world_size > 1 needs trainer.launcher: torchrun"):
        load_workload_config(TINY, ["trainer.world_size=2"])
    with pytest.raises(WrongTypeError, match="mini_batches"):
        load_workload_config(TINY, ["trainer.mini_batches=9"])


def test_defaults_fill_a_minimal_file(tmp_path):
    cfg = load_workload_config(write(tmp_path, {"schema_version": 1}))
    assert cfg == WorkloadConfig()


def test_cli_turns_a_bad_override_into_one_line_and_exit_2(capsys):
    rc = main(["workload", "run", str(TINY), "--steps", "1", "trainer.micro_batchsize=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"rltune: {TINY}: trainer.micro_batchsize: unknown override key "
                   "(did you mean 'trainer.micro_batch_size'?)"]


def test_cli_check_counts_the_small_preset_without_building_it(capsys):
    import json

    rc = main(["workload", "check", str(REPO / "presets" / "workload" / "small-math.yaml")])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert 0.45e9 < out["params"] < 0.55e9
    assert out["preset"] == "small"
