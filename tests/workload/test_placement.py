"""The GPU split: which device each trainer rank and engine gets, and the config rules around it."""

from __future__ import annotations

import pytest

from rltune.contracts.schema import from_data
from rltune.errors import RltuneError
from rltune.workload.config import WorkloadConfig
from rltune.workload.launch import torchrun_argv
from rltune.workload.placement import Placement, PlacementError, place


def config(**sections) -> WorkloadConfig:
    cfg = from_data(WorkloadConfig, sections, "workload.yaml")
    cfg.validate()
    return cfg


def test_shared_by_default_every_process_on_the_configured_device():
    cfg = config(engine={"num_engines": 3})
    assert place(cfg, 0, "cpu", "cpu") == Placement(["cpu"], ["cpu", "cpu", "cpu"])
    assert place(cfg, 2, "cuda", "cuda") == Placement(["cuda"], ["cuda"] * 3)


@pytest.mark.parametrize("trainer_gpus, rollout_gpus, engines, want", [
    (1, 1, 1, Placement(["cuda:0"], ["cuda:1"])),
    (1, 1, 3, Placement(["cuda:0"], ["cuda:1", "cuda:1", "cuda:1"])),
    (2, 2, 3, Placement(["cuda:0", "cuda:1"], ["cuda:2", "cuda:3", "cuda:2"])),
    (1, 3, 4, Placement(["cuda:0"], ["cuda:1", "cuda:2", "cuda:3", "cuda:1"])),
])
def test_a_split_puts_trainer_ranks_first_and_engines_round_robin_after(trainer_gpus, rollout_gpus, engines, want):
    launcher = "torchrun" if trainer_gpus > 1 else "inprocess"
    cfg = config(placement={"trainer_gpus": trainer_gpus, "rollout_gpus": rollout_gpus},
                 engine={"num_engines": engines}, trainer={"launcher": launcher})
    assert place(cfg, 8, "cuda", "cuda") == want
    assert cfg.trainer_ranks == trainer_gpus


def test_a_split_larger_than_the_machine_names_both_knobs_and_the_count():
    cfg = config(placement={"trainer_gpus": 1, "rollout_gpus": 2})
    with pytest.raises(PlacementError, match=r"trainer_gpus 1 \+ placement.rollout_gpus 2 = 3 GPUs, this machine shows 1"):
        place(cfg, 1, "cuda", "cuda")


@pytest.mark.parametrize("sections, field", [
    ({"placement": {"trainer_gpus": 1}}, "placement.rollout_gpus"),
    ({"placement": {"rollout_gpus": 2}}, "placement.trainer_gpus"),
    ({"placement": {"trainer_gpus": 2, "rollout_gpus": 1}}, "placement.trainer_gpus"),
    ({"placement": {"trainer_gpus": 2, "rollout_gpus": 1}, "trainer": {"launcher": "torchrun", "world_size": 3}},
     "trainer.world_size"),
])
def test_inconsistent_splits_are_refused_naming_the_field(sections, field):
    with pytest.raises(RltuneError, match=field.replace(".", r"\.")):
        config(**sections)


def test_torchrun_starts_one_rank_per_trainer_gpu(tmp_path):
    cfg = config(placement={"trainer_gpus": 2, "rollout_gpus": 2}, trainer={"launcher": "torchrun"})
    argv = torchrun_argv(cfg, tmp_path / "c.yaml", tmp_path, None)
    assert "--nproc_per_node=2" in argv
