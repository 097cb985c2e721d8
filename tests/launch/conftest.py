"""Session fixtures that start a real scheduler on 127.0.0.1 for the launcher tests, and stop it.

``slurm_cluster`` / ``slurm``: a one-node SLURM cluster (see schedulers.py); ``slurm`` also points
this process's slurm commands at it (SLURM_CONF) for one test. ``ray_head``: a local Ray head with
its jobs API. Where a scheduler cannot run here the tests that need it skip, saying why — except
as root on Debian, where `make setup` installs SLURM, so its absence there is a failure.
"""

from __future__ import annotations

import pytest

from .schedulers import RayHead, SlurmCluster, ray_missing, slurm_installable, slurm_missing


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    why = slurm_missing()
    if why is not None:
        if slurm_installable():
            pytest.fail(f"SLURM cannot start: {why}; run 'make setup' first")
        pytest.skip(f"no SLURM here: {why}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    if slurm_cluster.slurmd is None or slurm_cluster.slurmd.poll() is not None:
        slurm_cluster.start_slurmd()  # a test before this one took the node away and failed to bring it back
    return slurm_cluster


@pytest.fixture(scope="session")
def ray_head():
    why = ray_missing()
    if why is not None:
        pytest.skip(f"no Ray here: {why}")
    head = RayHead()
    try:
        head.start()
        yield head
    finally:
        head.stop()
