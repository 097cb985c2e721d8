"""run_job runs a real subprocess: overrides reach it, crashes and time-outs come back, nothing is orphaned."""

from __future__ import annotations

import json
import os
import time

import pytest

from rltune.contracts.job import load_job
from rltune.launch import UnmappedKnobError, build_argv, process, run_job

from .jobfile import write_job

ECHO_ARGS = """
import json, sys
from pathlib import Path
run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])
(run_dir / 'args.json').write_text(json.dumps(sys.argv[1:]))
print('hello from the job', flush=True)
"""

SPAWN_AND_HANG = """
import os, subprocess, sys, time
from pathlib import Path
run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])
child = subprocess.Popen([sys.executable, '-c', {child!r}])
(run_dir / 'pids').write_text(f"{{os.getpid()}} {{child.pid}}")
print('spawned', flush=True)
{tail}
"""

IGNORE_TERM_CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once it is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(run_dir):
    return [int(p) for p in (run_dir / "pids").read_text().split()]


def test_overrides_are_mapped_rendered_and_the_resolved_job_is_written(tmp_path):
    path = write_job(tmp_path, ECHO_ARGS)
    job = load_job(path)
    run_dir = tmp_path / "run"
    lines = []
    result = run_job(job, path, run_dir, overrides={"micro_batch_size": 16}, steps=3, on_output=lines.append)
    assert result.ok and result.returncode == 0 and not result.timed_out
    args = json.loads((run_dir / "args.json").read_text())
    assert args == ["--run-dir", str(run_dir.resolve()), "--steps", "3", "orchestrator.steps=3",
                    "orchestrator.rl_mode=sync", "trainer.micro_batch_size=16"]
    assert "hello from the job" in lines
    assert result.log_tail(5).splitlines()[-1] == "hello from the job"
    resolved = load_job(run_dir / "job.yaml")
    assert resolved.knobs["micro_batch_size"] == 16 and resolved.limits.steps == 3
    assert resolved.launch.workdir == str(tmp_path.resolve())
    record = json.loads((run_dir / "launch.json").read_text())
    assert record["argv"] == result.argv and record["returncode"] == 0


def test_without_overrides_the_job_limit_steps_and_every_knob_are_rendered(tmp_path):
    # What runs is the job file: a tuned or hand-edited preset reproduces its run with no override.
    path = write_job(tmp_path, ECHO_ARGS, knobs={"micro_batch_size": 32})
    argv = build_argv(load_job(path), path, tmp_path / "r")
    assert argv[-5:] == ["--steps", "4", "orchestrator.steps=4", "orchestrator.rl_mode=sync",
                         "trainer.micro_batch_size=32"]


def test_a_knob_without_a_mapping_only_describes_the_job_until_it_is_overridden(tmp_path):
    path = write_job(tmp_path, ECHO_ARGS, knobs={"engines_per_node": 8})
    argv = build_argv(load_job(path), path, tmp_path / "r")
    assert not any("engines_per_node" in a for a in argv)
    assert build_argv(load_job(path), path, tmp_path / "r", overrides={"engines_per_node": 8}) == argv
    with pytest.raises(UnmappedKnobError, match="'engines_per_node'"):
        build_argv(load_job(path), path, tmp_path / "r", overrides={"engines_per_node": 4})


def test_an_override_of_an_unmapped_knob_names_the_knob_and_the_fix(tmp_path):
    path = write_job(tmp_path, ECHO_ARGS)
    with pytest.raises(UnmappedKnobError, match=r"'tp_size'.*add 'tp_size: <the job's config key>' under launch.knob_map"):
        run_job(load_job(path), path, tmp_path / "run", overrides={"tp_size": 2})


def test_a_crash_returns_its_exit_code_and_the_log_tail(tmp_path):
    path = write_job(tmp_path, "import sys\nprint('step 1 ok')\nraise SystemExit('CUDA out of memory (simulated by the job)')\n")
    result = run_job(load_job(path), path, tmp_path / "run")
    assert result.returncode == 1 and not result.timed_out and not result.ok
    assert result.log_tail(1) == "CUDA out of memory (simulated by the job)"
    assert "step 1 ok" in result.log_tail(5)


def test_a_time_out_kills_the_job_and_the_child_it_spawned(tmp_path):
    script = SPAWN_AND_HANG.format(child="import time; time.sleep(600)", tail="time.sleep(600)")
    path = write_job(tmp_path, script, launch={"timeout_s": 1.5})
    run_dir = tmp_path / "run"
    t = time.monotonic()
    result = run_job(load_job(path), path, run_dir)
    assert result.timed_out and result.returncode != 0
    assert time.monotonic() - t < 10
    parent, child = _pids(run_dir)
    assert not _alive(parent) and not _alive(child)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "KILL_GRACE_S", 0.5)
    script = SPAWN_AND_HANG.format(child=IGNORE_TERM_CHILD, tail="time.sleep(600)")
    path = write_job(tmp_path, script, launch={"timeout_s": 1.5})
    run_dir = tmp_path / "run"
    result = run_job(load_job(path), path, run_dir)
    assert result.timed_out
    assert not any(_alive(pid) for pid in _pids(run_dir))


def test_a_job_that_exits_leaving_a_background_child_leaves_no_orphan(tmp_path):
    script = SPAWN_AND_HANG.format(child="import time; time.sleep(600)", tail="time.sleep(0.3)")
    path = write_job(tmp_path, script)
    run_dir = tmp_path / "run"
    result = run_job(load_job(path), path, run_dir)
    assert result.returncode == 0 and not result.timed_out
    _, child = _pids(run_dir)
    assert not _alive(child)


def test_a_missing_program_is_bad_input_refused_before_the_run_dir_exists(tmp_path):
    from rltune.launch import LaunchInputError

    path = write_job(tmp_path, ECHO_ARGS, launch={"command": ["no-such-program-xyz", "{run_dir}"]})
    with pytest.raises(LaunchInputError, match="launch.command\\[0\\]: 'no-such-program-xyz' is not on PATH") as caught:
        run_job(load_job(path), path, tmp_path / "run")
    assert caught.value.exit_code == 2 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps", [0, -1, 10**23])
def test_a_step_count_no_run_can_have_is_refused_before_launch(tmp_path, steps):
    from rltune.launch import LaunchInputError

    path = write_job(tmp_path, ECHO_ARGS)
    with pytest.raises(LaunchInputError, match="--steps"):
        run_job(load_job(path), path, tmp_path / "run", steps=steps)
    assert not (tmp_path / "run").exists()


def test_torchrun_starts_one_process_per_rank(tmp_path):
    script = ("import os, sys\nfrom pathlib import Path\n"
              "run_dir = Path(sys.argv[sys.argv.index('--run-dir') + 1])\n"
              "(run_dir / f\"rank{os.environ['RANK']}\").write_text(os.environ['WORLD_SIZE'])\n")
    path = write_job(tmp_path, script, launch={"launcher": "torchrun", "nproc_per_node": 2})
    run_dir = tmp_path / "run"
    result = run_job(load_job(path), path, run_dir)
    assert result.ok, result.log_tail(20)
    assert result.argv[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert sorted(p.name for p in run_dir.glob("rank*")) == ["rank0", "rank1"]
    assert (run_dir / "rank1").read_text() == "2"
