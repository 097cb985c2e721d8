"""The launcher layer without a scheduler: identities, the job file's launcher fields, the local launcher's reattach."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rltune.contracts.job import load_job, ray_submit_options
from rltune.errors import ArtifactError, LaunchError
from rltune.launch import JobIdentity, launcher_argv, make_launcher, reattach, run_job
from rltune.launch.base import LOST, RUNNING
from rltune.launch.local import LocalLauncher
from rltune.launch.ray import RayLauncher
from rltune.launch.slurm import SlurmLauncher, controller_of
from rltune.launch.torchrun import TorchrunLauncher

from .jobfile import write_job
from .schedulers import alive, wait_until

REPO = Path(__file__).resolve().parents[2]


def _identity(**changes):
    data = {"version": 1, "launcher": "slurm", "job_id": "42", "address": "head:6817", "run_dir": "/r",
            "log_path": "/r/launch.log", "submitted_at": 10.0, "timeout_s": 60.0, "queue_timeout_s": None, "argv": ["srun", "x"],
            "extra": {"job_name": "rltune-r"}}
    data.update(changes)
    return data


def test_an_identity_round_trips_through_json():
    identity = JobIdentity.from_json(json.loads(json.dumps(_identity())))
    assert identity.job_id == "42" and identity.extra == {"job_name": "rltune-r"}
    assert identity.to_json() == _identity()


@pytest.mark.parametrize("changes, field", [({"version": 2}, "version"), ({"job_id": 42}, "job_id"),
                                            ({"timeout_s": None}, "timeout_s"), ({"jobid": "1"}, "jobid"),
                                            ({"submitted_at": True}, "submitted_at")])
def test_an_identity_that_does_not_fit_names_the_field(changes, field):
    with pytest.raises(LaunchError, match=rf"identity: {field}:"):
        JobIdentity.from_json(_identity(**changes))


def test_reattach_refuses_an_unknown_launcher():
    with pytest.raises(LaunchError, match="unknown launcher 'k8s'"):
        reattach(_identity(launcher="k8s"))


def test_the_factory_gives_one_launcher_per_kind(tmp_path):
    kinds = {"local": LocalLauncher, "torchrun": TorchrunLauncher, "slurm": SlurmLauncher, "ray": RayLauncher}
    for kind, cls in kinds.items():
        job = load_job(write_job(tmp_path, "", launch={"launcher": kind}))
        assert type(make_launcher(job.launch)) is cls
    assert launcher_argv("ray", ["python", "t.py"]) == ["python", "t.py"]


@pytest.mark.parametrize("arg", ["--time=10", "-t10", "-t", "--output=x.log", "-J", "--job-name=x", "--chdir=/",
                                 "--array=1-3", "--parsable", "--wait"])
def test_slurm_args_may_not_set_what_rltune_derives(tmp_path, arg):
    path = write_job(tmp_path, "", launch={"launcher": "slurm", "slurm_args": ["--partition=debug", arg]})
    with pytest.raises(ArtifactError, match=r"launch.slurm_args\[1\]: rltune sets .* itself .*; remove it"):
        load_job(path)


def test_ray_args_read_like_ray_job_submit():
    assert ray_submit_options(["--entrypoint-num-cpus=1", "--entrypoint-num-gpus", "8",
                               '--runtime-env-json={"env_vars": {"A": "1"}}', "--entrypoint-memory=1000"]) == {
        "entrypoint_num_cpus": 1.0, "entrypoint_num_gpus": 8.0, "runtime_env": {"env_vars": {"A": "1"}},
        "entrypoint_memory": 1000}


@pytest.mark.parametrize("args, problem", [(["--working-dir=."], "unknown option"),
                                           (["--entrypoint-num-cpus=two"], "cannot read 'two' as float"),
                                           (["--entrypoint-num-gpus=-1"], "must not be negative"),
                                           (["--runtime-env-json=[1]"], "expected a JSON object"),
                                           (["--metadata-json={"], "cannot read '{' as JSON"),
                                           (["--entrypoint-num-cpus"], "needs a value")])
def test_ray_args_that_do_not_read_name_the_option(tmp_path, args, problem):
    path = write_job(tmp_path, "", launch={"launcher": "ray", "ray_address": "http://h:8265", "ray_args": args})
    with pytest.raises(ArtifactError, match=rf"launch.ray_args: .*{problem}"):
        load_job(path)


@pytest.mark.parametrize("address", ["h:8265", "ray://h:10001", "http://h", "http://h:8265/api"])
def test_a_ray_address_is_the_jobs_api_url(tmp_path, address):
    path = write_job(tmp_path, "", launch={"launcher": "ray", "ray_address": address})
    with pytest.raises(ArtifactError, match=r"launch.ray_address: expected the jobs API address http\(s\)://HOST:PORT"):
        load_job(path)


def test_ray_with_no_address_anywhere_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    path = write_job(tmp_path, "print(1)", launch={"launcher": "ray"})
    with pytest.raises(LaunchError, match=r"launch.ray_address: not set, nor RAY_API_SERVER_ADDRESS or RAY_ADDRESS"):
        run_job(load_job(path), path, tmp_path / "run")


def test_the_slurm_controller_address_is_read_from_slurm_conf(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=c1\n# SlurmctldHost=nothere\nSlurmctldHost=ctl1(10.0.0.1)\nSlurmctldHost=ctl2\n"
                    "SlurmctldPort=7000-7002\n")
    assert controller_of({"SLURM_CONF": str(conf)}) == (str(conf), "ctl1:7000", "c1")
    assert controller_of({"SLURM_CONF": str(tmp_path / "none")})[1] == "(slurm.conf unreadable)"


LOCAL_SUBMITTER = """
import json, sys
from pathlib import Path
from rltune.contracts.job import load_job
from rltune.launch import run_job
path, run_dir, out = map(Path, sys.argv[1:4])
run_job(load_job(path), path, run_dir, on_submit=lambda identity: out.write_text(json.dumps(identity)))
"""

HANG = """
import os, sys, time
from pathlib import Path
run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])
(run_dir / 'pids').write_text(str(os.getpid()))
time.sleep(600)
"""


def test_a_local_job_whose_submitter_was_killed_is_found_then_cancelled_and_reported_lost(tmp_path):
    path = write_job(tmp_path, HANG)
    run_dir, identity_file = tmp_path / "run", tmp_path / "identity.json"
    first = subprocess.Popen([sys.executable, "-c", LOCAL_SUBMITTER, str(path), str(run_dir), str(identity_file)],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: identity_file.exists() and (run_dir / "pids").exists(), 60, "the local job started")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    job_pid = int((run_dir / "pids").read_text())
    identity = json.loads(identity_file.read_text())
    assert identity["launcher"] == "local" and identity["job_id"] == str(job_pid)
    try:
        handle = reattach(identity)
        assert handle.poll().state == RUNNING and alive(job_pid)    # the group outlived its submitter
        # A recycled pid is not taken for the job: another start time is another process.
        assert reattach({**identity, "extra": {**identity["extra"], "start_ticks": -1}}).poll().state == LOST
        final = handle.cancel()
        assert final.state == LOST and final.returncode != 0
        assert not alive(job_pid)
    finally:
        if alive(job_pid):
            os.killpg(job_pid, signal.SIGKILL)


def test_help_and_the_launcher_modules_import_neither_ray_nor_torch():
    code = ("import sys\nfrom rltune.cli.main import main\nmain(['--help'])\n"
            "import rltune.launch, rltune.launch.local, rltune.launch.torchrun, rltune.launch.slurm, rltune.launch.ray\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout
