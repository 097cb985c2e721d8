"""The seeded fault campaign (tests/sync/fault_campaign.py) against ``ToyEngine`` workers behind a
``DeltaReceiver``: one test per fault, each bounded in time and memory. No fault may leave an engine
silently wrong, raise a raw exception or hang, and every one must heal to the trainer's weights bit
for bit. tests/sync/test_vllm_campaign.py runs the same faults against a real vLLM engine."""

from __future__ import annotations

import pytest
from fault_campaign import CASE_TIMEOUT_S, FAULTS, assert_passed, build_world, run_fault

CLASSES = {"republish", "uncovered", "leftovers", "cancelling", "typed", "fallback", "store", "layout", "cast"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("campaign"))


def test_the_campaign_has_over_a_hundred_distinct_faults_in_every_class():
    names = [f.name for f in FAULTS]
    assert len(names) == len(set(names)) >= 100
    assert {f.klass for f in FAULTS} == CLASSES


# The case's own timer (CASE_TIMEOUT_S) reports a hang in Python code; this one, a thread, also ends a
# hang inside a system call or C code (by ending the run: never silently).
@pytest.mark.timeout(CASE_TIMEOUT_S * 2, method="thread")
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault(world, tmp_path, fault):
    assert_passed(run_fault(fault, world, tmp_path))
