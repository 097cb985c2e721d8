"""launcher: slurm against a real one-node SLURM cluster: sbatch, the job's states, scancel, reattach.

The cluster (slurmctld + slurmd + munged on 127.0.0.1, no accounting) is started once per session
by the ``slurm_cluster`` fixture; see schedulers.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rltune.contracts.job import load_job
from rltune.errors import LaunchError
from rltune.launch import JobIdentity, make_launcher, reattach, run_job
from rltune.launch.base import CANCELLED, FAILED, LOST, SUCCEEDED, TIMED_OUT, Submission

from .jobfile import write_job
from .schedulers import alive, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]

# The job: its pid and a child's, its SLURM job id, then what the test asks for through files.
JOB = """
import os, subprocess, sys, time
from pathlib import Path
run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
(run_dir / 'pids').write_text(f"{os.getpid()} {child.pid}")
print('job', os.environ.get('SLURM_JOB_ID'), 'step', os.environ.get('SLURM_STEP_ID'),
      'extra', os.environ.get('EXTRA_VAR'), flush=True)
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


def _slurm_job(tmp_path, mode="exit0", code=0, timeout_s=90, slurm_args=("--partition=debug",), **env):
    return write_job(tmp_path, JOB, launch={"launcher": "slurm", "slurm_args": list(slurm_args), "timeout_s": timeout_s,
                                            "env": {"MODE": mode, "CODE": str(code), "EXTRA_VAR": "from-job-yaml",
                                                    **env}})


def _pids(run_dir: Path) -> list[int]:
    return [int(p) for p in wait_until(lambda: (run_dir / "pids").exists() and (run_dir / "pids").read_text(), 60,
                                       "the job wrote its pids").split()]


def test_a_run_is_a_batch_job_with_the_job_args_its_time_limit_and_its_log_in_the_run_dir(slurm, tmp_path):
    path = _slurm_job(tmp_path, timeout_s=150)
    run_dir = tmp_path / tmp_path.name  # run dirs name the job: one per test
    submitted, lines = [], []
    result = run_job(load_job(path), path, run_dir, overrides={"micro_batch_size": 16}, steps=3,
                     on_output=lines.append, on_submit=submitted.append)
    assert result.ok and result.returncode == 0 and result.state == SUCCEEDED, result.log_tail(20)
    identity = result.identity
    assert submitted == [identity] and identity["launcher"] == "slurm"
    assert identity["address"] == slurm.address and identity["run_dir"] == str(run_dir.resolve())
    job_id = identity["job_id"]
    assert f"job {job_id} step 0 extra from-job-yaml" in lines      # ran as step 0 of its own allocation
    assert result.log_tail(50).count("finishing") == 1
    assert result.argv[:3] == ["srun", "--kill-on-bad-exit=1", "--partition=debug"]
    assert {"orchestrator.steps=3", "trainer.micro_batch_size=16"} <= set(result.argv)
    shown = slurm.scontrol_job(job_id)
    assert shown["JobState"] == "COMPLETED" and shown["ExitCode"] == "0:0"
    assert shown["TimeLimit"] == "00:03:00"                           # 150 s rounded up to minutes
    assert shown["Partition"] == "debug" and shown["JobName"] == f"rltune-{run_dir.name}"
    assert shown["StdOut"] == str(run_dir.resolve() / "launch.log")
    assert shown["WorkDir"] == str(tmp_path.resolve())
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["identity"] == identity and record["returncode"] == 0 and record["state"] == SUCCEEDED
    assert (run_dir / "launch.exit").read_text().split() == [job_id, "0"]
    assert not any(alive(pid) for pid in _pids(run_dir))


def test_a_failing_job_returns_its_exit_code_and_log_tail(slurm, tmp_path):
    path = _slurm_job(tmp_path, code=3)
    result = run_job(load_job(path), path, tmp_path / tmp_path.name)
    assert result.returncode == 3 and not result.ok and not result.timed_out and result.state == FAILED
    assert "finishing" in result.log_tail(10)
    assert slurm.scontrol_job(result.identity["job_id"])["ExitCode"] == "3:0"


def test_a_time_out_cancels_the_job_and_the_child_it_spawned(slurm, tmp_path):
    path = _slurm_job(tmp_path, mode="hang", timeout_s=4)
    run_dir = tmp_path / tmp_path.name  # run dirs name the job: one per test
    result = run_job(load_job(path), path, run_dir)
    assert result.timed_out and not result.ok and result.returncode != 0 and result.state == TIMED_OUT
    assert slurm.scontrol_job(result.identity["job_id"])["JobState"] == "CANCELLED"
    assert not any(alive(pid) for pid in _pids(run_dir))   # cancel() returned only once the job was gone
    assert "job " in result.log_tail(20)


def test_a_job_cancelled_from_outside_is_not_ok_and_keeps_its_log(slurm, tmp_path):
    path = _slurm_job(tmp_path, mode="hang")
    run_dir = tmp_path / tmp_path.name  # run dirs name the job: one per test

    def scancel_when_running(identity):
        def go():
            _pids(run_dir)
            subprocess.run(["scancel", identity["job_id"]], env=slurm.env(), check=True, timeout=60)
        threading.Thread(target=go, daemon=True).start()

    result = run_job(load_job(path), path, run_dir, on_submit=scancel_when_running)
    assert not result.ok and not result.timed_out and result.state == CANCELLED
    assert result.returncode != 0
    assert f"job {result.identity['job_id']}" in result.log_tail(20)
    assert "CANCELLED" in result.log_tail(20)                   # slurmstepd's own line, in the run's log
    assert not any(alive(pid) for pid in _pids(run_dir))


def test_a_job_that_waits_in_the_queue_past_queue_timeout_is_cancelled_as_timed_out(slurm, tmp_path):
    path = write_job(tmp_path, JOB, launch={"launcher": "slurm", "slurm_args": ["--begin=now+1hour"],
                                            "timeout_s": 60, "queue_timeout_s": 2})
    run_dir = tmp_path / tmp_path.name  # run dirs name the job: one per test
    result = run_job(load_job(path), path, run_dir)
    assert result.timed_out and not result.ok and result.state == TIMED_OUT
    shown = slurm.scontrol_job(result.identity["job_id"])
    assert shown["JobState"] == "CANCELLED" and shown["RunTime"] == "00:00:00"   # it never started
    assert result.identity["queue_timeout_s"] == 2 and not (run_dir / "pids").exists()


def test_slurm_down_at_submit_names_the_launcher_the_address_and_the_fix_and_starts_nothing(slurm, tmp_path,
                                                                                            monkeypatch):
    port = free_port()
    down = slurm.write_conf(tmp_path / "down.conf", ctld_port=port)
    monkeypatch.setenv("SLURM_CONF", str(down))
    path = _slurm_job(tmp_path)
    run_dir = tmp_path / tmp_path.name  # run dirs name the job: one per test
    with pytest.raises(LaunchError, match=rf"launch.launcher: slurm: sbatch could not submit to the controller at "
                                          rf"localhost:{port} .*Unable to contact slurm controller.*start slurmctld"):
        run_job(load_job(path), path, run_dir)
    assert slurm.jobs_named(f"rltune-{run_dir.name}") == []
    assert not (run_dir / "launch.json").exists() and not (run_dir / "pids").exists()


def test_sbatch_refusing_the_job_args_is_a_launch_error_naming_slurm_args(slurm, tmp_path):
    path = _slurm_job(tmp_path, slurm_args=["--partition=no-such-partition"])
    with pytest.raises(LaunchError, match=r"sbatch could not submit.*Invalid partition name specified; check launch.slurm_args"):
        run_job(load_job(path), path, tmp_path / tmp_path.name)


def test_two_runs_at_once_share_the_cluster(slurm, tmp_path):
    # Each job waits for the other's 'pids' file: they finish only if slurm runs them side by side.
    barrier = ("import sys, time\nfrom pathlib import Path\n"
               "run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])\n"
               "(run_dir / 'pids').write_text('started')\n"
               "other = run_dir.parent / {other!r} / 'pids'\n"
               "t = time.monotonic()\n"
               "while not other.exists():\n"
               "    assert time.monotonic() - t < 60, 'the other run never started'\n"
               "    time.sleep(0.1)\n")
    results = {}

    def run(name, other):
        d = tmp_path / f"job-{name}"
        d.mkdir()
        path = write_job(d, barrier.format(other=f"run-{tmp_path.name}-{other}"),
                         launch={"launcher": "slurm", "slurm_args": ["--cpus-per-task=1"], "timeout_s": 90})
        results[name] = run_job(load_job(path), path, tmp_path / f"run-{tmp_path.name}-{name}")

    threads = [threading.Thread(target=run, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == ["a", "b"]
    assert all(r.ok for r in results.values()), [r.log_tail(5) for r in results.values()]
    assert results["a"].identity["job_id"] != results["b"].identity["job_id"]


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


def _start_submitter(path, run_dir, identity_file, env):
    return subprocess.Popen([sys.executable, "-c", SUBMITTER, str(path), str(run_dir), str(identity_file)],
                            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_a_second_process_reattaches_to_the_job_of_a_killed_submitter_and_gets_its_result_once(slurm, tmp_path):
    path = _slurm_job(tmp_path, mode="wait-for-go", code=7)
    run_dir, identity_file = tmp_path / tmp_path.name, tmp_path / "identity.json"
    env = {**slurm.env(), "PYTHONPATH": str(REPO)}
    first = _start_submitter(path, run_dir, identity_file, env)
    try:
        wait_until(identity_file.exists, 60, "the submitter journalled the identity")
        _pids(run_dir)
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    identity = json.loads(identity_file.read_text())
    job_id = identity["job_id"]
    assert slurm.scontrol_job(job_id)["JobState"] == "RUNNING"     # the job did not die with its submitter
    (run_dir / "go").write_text("")
    second = subprocess.run([sys.executable, "-c", REATTACHER, str(identity_file)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    result = json.loads(second.stdout.splitlines()[-1])
    assert result["returncode"] == 7 and result["state"] == FAILED and not result["timed_out"]
    assert result["identity"] == identity
    assert slurm.jobs_named(f"rltune-{run_dir.name}") == [job_id]   # one job, never submitted again
    log = (run_dir / "launch.log").read_text()
    assert log.count(f"job {job_id} step 0") == 1 and log.count("finishing") == 1
    assert (run_dir / "launch.exit").read_text().split() == [job_id, "7"]


def test_sigterm_to_the_submitter_cancels_its_job(slurm, tmp_path):
    path = _slurm_job(tmp_path, mode="hang")
    run_dir, identity_file = tmp_path / tmp_path.name, tmp_path / "identity.json"
    first = _start_submitter(path, run_dir, identity_file, {**slurm.env(), "PYTHONPATH": str(REPO)})
    try:
        wait_until(identity_file.exists, 60, "the submitter journalled the identity")
        pids = _pids(run_dir)
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0 and b"Stopped: terminated by SIGTERM" in out
    job_id = json.loads(identity_file.read_text())["job_id"]
    assert slurm.scontrol_job(job_id)["JobState"] == "CANCELLED"
    assert not any(alive(pid) for pid in pids)


def _submit(slurm, tmp_path, mode, code=0, timeout_s=60) -> tuple:
    """Submit straight through the launcher, without following (as a submitter that died would leave it)."""
    job = load_job(_slurm_job(tmp_path, mode=mode, code=code, timeout_s=timeout_s))
    run_dir = tmp_path / tmp_path.name  # run dirs name the job: one per test
    run_dir.mkdir()
    argv = ["srun", "--kill-on-bad-exit=1", sys.executable, "job.py", "--run-dir", str(run_dir)]
    env = {**slurm.env(), **job.launch.env}
    handle = make_launcher(job.launch, "job.yaml").submit(Submission(
        argv=argv, cwd=tmp_path, env=env, run_dir=run_dir, log_path=run_dir / "launch.log",
        timeout_s=timeout_s, name=run_dir.name))
    return handle, run_dir


def test_once_the_controller_forgets_a_job_its_exit_file_answers_and_a_job_without_one_is_lost(slurm, tmp_path):
    (tmp_path / "a").mkdir()
    handle, _ = _submit(slurm, tmp_path / "a", "exit0", code=5)
    assert handle.wait(60).state == FAILED
    identity = handle.identity.to_json()
    slurm.restart_controller(clear_state=True)                 # a controller reset: every job forgotten
    assert slurm.scontrol_job(identity["job_id"]) == {}
    state = reattach(identity).poll()
    assert (state.state, state.returncode) == (FAILED, 5) and "launch.exit" in state.detail
    Path(identity["extra"]["exit_path"]).unlink()
    lost = reattach(identity).poll()
    assert lost.state == LOST and "left no" in lost.detail
    assert JobIdentity.from_json(identity).job_id == identity["job_id"]


@pytest.mark.slow
def test_losing_the_node_ends_the_job_node_fail_and_the_node_comes_back(slurm, tmp_path):
    handle, run_dir = _submit(slurm, tmp_path, "hang", timeout_s=120)
    pids = _pids(run_dir)
    slurm.kill_node()
    assert not any(alive(pid) for pid in pids)
    t = time.monotonic()
    state = handle.wait(90)
    observed_s = time.monotonic() - t
    assert state.state == FAILED and state.detail.startswith("NODE_FAIL"), state
    assert handle.result(state).returncode != 0
    print(f"NODE_FAIL seen {observed_s:.1f} s after the node died (SlurmdTimeout=5)")
    slurm.start_slurmd()                                       # ReturnToService=2: the node is idle again
    assert slurm.node_state() == "idle"


@pytest.mark.slow
def test_slurms_own_time_limit_ends_a_job_whose_submitter_is_gone(slurm, tmp_path):
    handle, run_dir = _submit(slurm, tmp_path, "hang", timeout_s=60)
    pids = _pids(run_dir)
    # Nobody follows the job: slurm's --time=1 ends it (its check runs about every 30 s).
    state = handle.wait(150)
    assert state.state == TIMED_OUT and state.detail.startswith("TIMEOUT"), state
    result = handle.result(state)
    assert result.timed_out and not result.ok
    assert not any(alive(pid) for pid in pids)
    assert "DUE TO TIME LIMIT" in result.log_tail(20)
