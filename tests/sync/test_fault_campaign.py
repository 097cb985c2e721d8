"""The seeded fault campaign (tests/sync/fault_campaign.py): one test per fault, each bounded in time
and memory. No fault may leave an engine silently wrong, raise a raw exception or hang, and every
one must heal to the trainer's weights bit for bit."""

from __future__ import annotations

import pytest
from fault_campaign import CASE_RSS_GROWTH_MIB, CASE_TIMEOUT_S, FAULTS, build_world, run_fault


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("campaign"))


def test_the_campaign_has_over_a_hundred_distinct_faults_in_every_class():
    names = [f.name for f in FAULTS]
    assert len(names) == len(set(names)) >= 100
    assert {f.klass for f in FAULTS} == {"republish", "uncovered", "leftovers", "cancelling", "typed", "fallback",
                                         "store"}


@pytest.mark.timeout(CASE_TIMEOUT_S * 2)
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault(world, tmp_path, fault):
    outcome = run_fault(fault, world, tmp_path)
    assert outcome.result == "detected", outcome
    assert outcome.prefetch_ok, f"prefetch raised past its contract: {outcome}"
    assert outcome.healed, outcome
    assert outcome.rss_growth_mib < CASE_RSS_GROWTH_MIB, outcome
