"""The workload keeps the collector off its start-up heap while steps run, and gives it back after."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest

from rltune.workload.config import load_workload_config
from rltune.workload.heap import frozen_heap
from rltune.workload.orchestrator import run_job
from rltune.workload.trainer import DistributedTrainer, GRPOTrainer

REPO = Path(__file__).resolve().parents[2]
FAST = ["orchestrator.tasks_per_batch=2", "orchestrator.trials_per_task=3", "env.max_new_tokens=6"]


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_objects_are_frozen_inside_and_collectable_again_after():
    survivor = Cycle()
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert not any(o is survivor for o in gc.get_objects(generation=2))  # frozen: no collection walks it
    assert gc.get_freeze_count() == 0
    assert any(o is survivor for o in gc.get_objects(generation=2))


def test_garbage_from_before_is_collected_not_frozen_and_garbage_made_inside_is_still_collected():
    before = weakref.ref(Cycle())  # unreachable at once: only the cyclic collector frees it
    assert before() is not None
    with frozen_heap():
        assert before() is None
        inside = weakref.ref(Cycle())
        assert inside() is not None
        gc.collect()
        assert inside() is None


def test_a_callers_own_freeze_is_kept_and_an_error_inside_still_unfreezes():
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() >= before
    gc.unfreeze()
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a step failed")
    assert gc.get_freeze_count() == 0


class FreezeCountingTrainer(DistributedTrainer):
    def __init__(self, trainer):
        super().__init__(trainer)
        self.counts: list[int] = []

    def step(self, samples, separate_old_pass):
        self.counts.append(gc.get_freeze_count())
        return super().step(samples, separate_old_pass)


def test_a_workload_run_trains_with_the_heap_frozen_and_leaves_nothing_frozen(tmp_path):
    cfg = load_workload_config(REPO / "presets" / "workload" / "tiny-math.yaml", FAST)
    trainer = FreezeCountingTrainer(GRPOTrainer(cfg))
    metrics = run_job(cfg, tmp_path, steps=2, trainer=trainer)
    assert len(metrics.read_text().splitlines()) == 2
    assert len(trainer.counts) == 2 and min(trainer.counts) > 0
    assert gc.get_freeze_count() == 0
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1]
