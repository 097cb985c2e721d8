"""Override dialects spell each override exactly as the job's config system reads it."""

from __future__ import annotations

import sys

import pytest

from rltune.launch import OverrideError, launcher_argv, render_overrides


def test_rltune_dialect_is_trailing_key_equals_value():
    out = render_overrides("rltune", {"trainer.micro_batch_size": 8, "orchestrator.rl_mode": "one_step_async"})
    assert out == ["trainer.micro_batch_size=8", "orchestrator.rl_mode=one_step_async"]


def test_hydra_dialect_keeps_plus_prefix_and_quotes_values_its_grammar_would_misread():
    out = render_overrides("hydra", {"+actor.fsdp.offload": True, "data.path": "/d/x.parquet", "tag": "a b,c",
                                     "name": "it's", "lr": 1e-06, "empty": ""})
    assert out == ["+actor.fsdp.offload=true", "data.path=/d/x.parquet", "tag='a b,c'", "name='it\\'s'",
                   "lr=1e-06", "empty=''"]


def test_prime_rl_dialect_is_double_dash_dotted_key_then_value_and_at_loads_toml():
    out = render_overrides("prime-rl", {"@": "configs/rl.toml", "trainer.micro_batch_size": 2, "async": False})
    assert out == ["@", "configs/rl.toml", "--trainer.micro_batch_size", "2", "--async", "false"]


def test_argparse_dialect_is_flag_then_value():
    assert render_overrides("argparse", {"micro_train_batch_size": 4, "colocate": True, "lr": 0.5}) == [
        "--micro_train_batch_size", "4", "--colocate", "true", "--lr", "0.5"]


def test_values_are_one_argv_item_each_even_with_shell_characters():
    out = render_overrides("prime-rl", {"name": "x; rm -rf / $(id)"})
    assert out == ["--name", "x; rm -rf / $(id)"]


@pytest.mark.parametrize("key", ["", "a b", "a=b", "-a", "--a", ".a", "a..b", "a.b "])
def test_malformed_keys_are_refused(key):
    with pytest.raises(OverrideError, match="dotted config key"):
        render_overrides("hydra", {key: 1})


def test_plus_prefix_outside_hydra_is_refused():
    with pytest.raises(OverrideError, match="hydra"):
        render_overrides("rltune", {"+a.b": 1})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "two\nlines", [1, 2], None])
def test_values_that_cannot_be_one_argument_are_refused(value):
    with pytest.raises(OverrideError):
        render_overrides("rltune", {"a.b": value})


def test_unknown_dialect_is_refused_with_the_choices():
    with pytest.raises(OverrideError, match="hydra"):
        render_overrides("toml", {"a": 1})


def test_torchrun_wraps_the_script_and_drops_a_leading_python():
    assert launcher_argv("torchrun", ["python", "train.py", "--x", "1"], nproc_per_node=4, python="/py") == [
        "/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "train.py", "--x", "1"]
    assert launcher_argv("torchrun", ["-m", "pkg.train"], python="/py")[-2:] == ["-m", "pkg.train"]
    assert launcher_argv("torchrun", [sys.executable, "t.py"], python="/py")[-1] == "t.py"


def test_slurm_prefixes_srun_with_its_arguments():
    assert launcher_argv("slurm", ["python", "t.py"], slurm_args=["--nodes=2", "--gpus-per-node=8"]) == [
        "srun", "--kill-on-bad-exit=1", "--nodes=2", "--gpus-per-node=8", "python", "t.py"]


def test_local_is_the_argv_unchanged_and_empty_argv_is_an_error():
    assert launcher_argv("local", ["a", "b"]) == ["a", "b"]
    from rltune.errors import LaunchError

    with pytest.raises(LaunchError, match="empty"):
        launcher_argv("local", [])
    with pytest.raises(LaunchError, match="unknown launcher"):
        launcher_argv("k8s", ["a"])
