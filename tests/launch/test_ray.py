"""launcher: ray against a real local Ray head: the jobs API, the job's states, stop_job, reattach.

The head (``ray start --head --block`` on 127.0.0.1, 2 CPUs) is started once per session by the
``ray_head`` fixture; see schedulers.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rltune.contracts.job import load_job
from rltune.errors import LaunchError
from rltune.launch import reattach, run_job
from rltune.launch.base import CANCELLED, FAILED, LOST, SUCCEEDED, TIMED_OUT

from .jobfile import write_job
from .schedulers import alive, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]

JOB = """
import os, subprocess, sys, time
from pathlib import Path
run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
(run_dir / 'pids').write_text(f"{os.getpid()} {child.pid}")
print('job in', os.getcwd(), 'extra', os.environ.get('EXTRA_VAR'), flush=True)
mode = os.environ.get('MODE', 'exit0')
if mode == 'hang':
    time.sleep(600)
if mode == 'wait-for-go':
    while not (run_dir / 'go').exists():
        time.sleep(0.1)
print('finishing', flush=True)
child.kill()
raise SystemExit(int(os.environ.get('CODE', '0')))
"""


def _ray_job(tmp_path, head, mode="exit0", code=0, timeout_s=90, address=None):
    return write_job(tmp_path, JOB, launch={
        "launcher": "ray", "ray_address": address or head.address, "timeout_s": timeout_s,
        "ray_args": ["--entrypoint-num-cpus=1", '--metadata-json={"owner": "tests"}'],
        "env": {"MODE": mode, "CODE": str(code), "EXTRA_VAR": "from-job-yaml"}})


def _pids(run_dir: Path) -> list[int]:
    return [int(p) for p in wait_until(lambda: (run_dir / "pids").exists() and (run_dir / "pids").read_text(), 90,
                                       "the job wrote its pids").split()]


def _client(head):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.address)


def test_a_run_is_a_ray_job_whose_log_streams_into_the_run_dir(ray_head, tmp_path):
    path = _ray_job(tmp_path, ray_head)
    run_dir = tmp_path / "run"
    submitted, lines = [], []
    result = run_job(load_job(path), path, run_dir, overrides={"micro_batch_size": 16}, steps=3,
                     on_output=lines.append, on_submit=submitted.append)
    assert result.ok and result.returncode == 0 and result.state == SUCCEEDED, result.log_tail(20)
    identity = result.identity
    assert submitted == [identity] and identity["launcher"] == "ray" and identity["address"] == ray_head.address
    assert identity["job_id"].startswith("rltune-run-")
    assert f"job in {tmp_path.resolve()} extra from-job-yaml" in lines
    log = (run_dir / "launch.log").read_text()
    assert log.count("finishing") == 1 and "job in" in log
    assert {"orchestrator.steps=3", "trainer.micro_batch_size=16"} <= set(result.argv)
    info = _client(ray_head).get_job_info(identity["job_id"])
    assert info.status.value == "SUCCEEDED" and info.driver_exit_code == 0
    assert info.metadata == {"owner": "tests", "rltune_run": "run", "rltune_run_dir": str(run_dir.resolve())}
    assert json.loads((run_dir / "launch.json").read_text())["identity"] == identity
    assert not any(alive(pid) for pid in _pids(run_dir))


def test_a_failing_ray_job_returns_its_exit_code_and_log_tail(ray_head, tmp_path):
    path = _ray_job(tmp_path, ray_head, code=3)
    result = run_job(load_job(path), path, tmp_path / "run")
    assert result.returncode == 3 and not result.ok and not result.timed_out and result.state == FAILED
    assert "finishing" in result.log_tail(10)


def test_a_time_out_stops_the_ray_job_and_the_child_it_spawned(ray_head, tmp_path):
    path = _ray_job(tmp_path, ray_head, mode="hang", timeout_s=6)
    run_dir = tmp_path / "run"
    result = run_job(load_job(path), path, run_dir)
    assert result.timed_out and not result.ok and result.state == TIMED_OUT
    assert _client(ray_head).get_job_status(result.identity["job_id"]).value == "STOPPED"
    assert not any(alive(pid) for pid in _pids(run_dir))


def test_a_ray_job_stopped_from_outside_is_not_ok_and_keeps_its_log(ray_head, tmp_path):
    path = _ray_job(tmp_path, ray_head, mode="hang")
    run_dir = tmp_path / "run"

    def stop_when_running(identity):
        def go():
            _pids(run_dir)
            wait_until(lambda: "job in" in (run_dir / "launch.log").read_text(), 30, "the job's first line in the log")
            subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "stop", "--address", ray_head.address,
                            identity["job_id"]], check=True, capture_output=True, timeout=60)
        threading.Thread(target=go, daemon=True).start()

    result = run_job(load_job(path), path, run_dir, on_submit=stop_when_running)
    assert not result.ok and not result.timed_out and result.state == CANCELLED and result.returncode != 0
    assert "job in" in result.log_tail(20)
    assert not any(alive(pid) for pid in _pids(run_dir))


def test_ray_down_at_submit_names_the_launcher_the_address_and_the_fix(ray_head, tmp_path):
    address = f"http://127.0.0.1:{free_port()}"
    path = _ray_job(tmp_path, ray_head, address=address)
    run_dir = tmp_path / "run"
    with pytest.raises(LaunchError, match=rf"launch.launcher: ray: no Ray jobs API answers at {address} .*"
                                          r"start the cluster's head.*or fix launch.ray_address"):
        run_job(load_job(path), path, run_dir)
    assert not (run_dir / "launch.json").exists() and not (run_dir / "pids").exists()


def test_ray_refusing_the_job_args_is_a_launch_error_naming_ray_args(ray_head, tmp_path):
    path = write_job(tmp_path, JOB, launch={"launcher": "ray", "ray_address": ray_head.address,
                                            "ray_args": ['--runtime-env-json={"pip": 3}']})
    with pytest.raises(LaunchError, match=r"launch.launcher: ray: the cluster at .* refused the job: .*check "
                                          r"launch.ray_args"):
        run_job(load_job(path), path, tmp_path / "run")


SUBMITTER = """
import json, sys
from pathlib import Path
from rltune.contracts.job import load_job
from rltune.launch import run_job
path, run_dir, out = map(Path, sys.argv[1:4])
def on_submit(identity):
    tmp = out.with_suffix('.tmp')
    tmp.write_text(json.dumps(identity))
    tmp.rename(out)
run_job(load_job(path), path, run_dir, on_submit=on_submit)
"""

REATTACHER = """
import json, sys
from rltune.launch import reattach
from rltune.launch.base import result_record
handle = reattach(json.loads(open(sys.argv[1]).read()))
print(json.dumps(result_record(handle.follow())))
"""


def test_a_second_process_reattaches_to_the_ray_job_of_a_killed_submitter_and_gets_its_result_once(ray_head,
                                                                                                   tmp_path):
    path = _ray_job(tmp_path, ray_head, mode="wait-for-go", code=7)
    run_dir, identity_file = tmp_path / "run", tmp_path / "identity.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-c", SUBMITTER, str(path), str(run_dir), str(identity_file)], cwd=REPO,
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        wait_until(identity_file.exists, 60, "the submitter journalled the identity")
        _pids(run_dir)
        wait_until(lambda: "job in" in (run_dir / "launch.log").read_text(), 30, "the first line copied to the log")
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    identity = json.loads(identity_file.read_text())
    client = _client(ray_head)
    assert client.get_job_status(identity["job_id"]).value == "RUNNING"
    (run_dir / "go").write_text("")
    second = subprocess.run([sys.executable, "-c", REATTACHER, str(identity_file)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    result = json.loads(second.stdout.splitlines()[-1])
    assert result["returncode"] == 7 and result["state"] == FAILED and result["identity"] == identity
    mine = [j for j in client.list_jobs() if (j.metadata or {}).get("rltune_run_dir") == str(run_dir.resolve())]
    assert [j.submission_id for j in mine] == [identity["job_id"]]   # one job, never submitted again
    log = (run_dir / "launch.log").read_text()
    assert log.count("job in") == 1 and log.count("finishing") == 1   # rewritten from Ray's copy, not appended twice


def test_a_job_the_cluster_does_not_know_is_lost(ray_head, tmp_path):
    identity = {"version": 1, "launcher": "ray", "job_id": "rltune-never-submitted-000000",
                "address": ray_head.address, "run_dir": str(tmp_path), "log_path": str(tmp_path / "launch.log"),
                "submitted_at": 0.0, "timeout_s": 1.0, "queue_timeout_s": None, "argv": ["true"], "extra": {}}
    state = reattach(identity).poll()
    assert state.state == LOST and state.returncode != 0 and "no longer knows" in state.detail
