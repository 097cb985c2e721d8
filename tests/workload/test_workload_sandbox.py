"""Sandboxes: limits kill runaway programs and nothing is left behind; the command language is safe."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from rltune.workload.sandbox import SandboxLimits, SandboxPool, run_limited


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it holds no resources and its parent reaps it.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_runaway_program_and_its_children_are_killed_at_the_wall_clock_limit(tmp_path):
    # The program starts a child that would sleep for a minute, records its pid, then spins forever.
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "open('child.pid', 'w').write(str(c.pid)); "
            "exec('while True: pass')")
    start = time.perf_counter()
    result = run_limited([sys.executable, "-c", code], tmp_path, SandboxLimits(cpu_s=30, memory_mb=512, wall_s=1.0))
    elapsed = time.perf_counter() - start
    assert result.timed_out and result.killed
    assert elapsed < 5.0, elapsed
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.time() + 2
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the sandbox left a child process running"


def test_cpu_time_limit_kills_a_busy_loop_before_the_wall_clock():
    result = run_limited([sys.executable, "-c", "while True: pass"], "/tmp",
                         SandboxLimits(cpu_s=1, memory_mb=512, wall_s=20))
    assert not result.timed_out
    assert result.returncode < 0  # SIGXCPU or SIGKILL from the kernel
    assert result.seconds < 10


def test_memory_limit_stops_a_large_allocation():
    result = run_limited([sys.executable, "-c", "x = bytearray(1 << 30); print('allocated')"], "/tmp",
                         SandboxLimits(cpu_s=5, memory_mb=256, wall_s=20))
    assert "allocated" not in result.output
    assert result.returncode != 0
    assert "MemoryError" in result.output


def test_a_normal_command_runs_and_its_output_comes_back(tmp_path):
    result = run_limited([sys.executable, "-c", "print(6 * 7)"], tmp_path, SandboxLimits())
    assert (result.returncode, result.output.strip(), result.timed_out) == (0, "42", False)


@pytest.fixture
def pool():
    p = SandboxPool(2, SandboxLimits(cpu_s=2, memory_mb=512, wall_s=5), prebuilt=False, modules=3)
    yield p
    p.close()


@pytest.mark.parametrize(("turn", "expected"), [
    ("sum data.txt", "60"),
    ("cat data.txt\nignored second line", "10 20 30"),
    ("wc data.txt", "1"),
    ("calc (2+3)*4-1", "19"),
    ("run m1", None),
    ("ls", "data.txt lib"),
    ("cat ../../etc/passwd", "error: bad file name"),
    ("cat /etc/passwd", "error: bad file name"),
    ("calc __import__('os')", "error: only integers"),
    ("rm -rf .", "error: unknown command 'rm'"),
    ("Zq9 <unk>((", "error: unknown command 'Zq9'"),
    ("", "error: empty command"),
    ("calc 999999999999999*999999999999999", "error: number too large"),
])
def test_the_sandbox_command_language(pool, turn, expected):
    with pool.sandbox({"data.txt": "10 20 30\n"}) as box:
        result = box.execute(turn)
    assert result.returncode == 0
    if expected is None:  # 'run m1' executes the image's module: its main() result
        assert result.output.isdigit() and int(result.output) > 0
    else:
        assert result.output.startswith(expected), result.output


def test_teardown_removes_the_trial_directory_even_after_an_error(pool):
    with pytest.raises(RuntimeError):
        with pool.sandbox({"data.txt": "1\n"}) as box:
            root = box.root
            assert (root / "data.txt").exists() and (root / "lib" / "m0.py").exists()
            raise RuntimeError("trial crashed")
    assert not root.exists()


def test_prebuilt_image_builds_once_and_each_trial_only_copies():
    limits = SandboxLimits()
    built = {}
    for prebuilt in (False, True):
        p = SandboxPool(1, limits, prebuilt=prebuilt, modules=4)
        setups = []
        for i in range(3):
            with p.sandbox({"data.txt": f"{i}\n"}) as box:
                assert box.execute("cat data.txt").output.strip() == str(i)
                assert len(list((box.root / "lib" / "__pycache__").iterdir())) == 4  # compiled modules present
                setups.append(box.setup_s)
        built[prebuilt] = p.images_built
        p.close()
        if prebuilt:
            # Copying a built image is cheaper than building (it skips the compile subprocess).
            assert max(setups[1:]) < setups[0]
    assert built == {False: 3, True: 1}


def test_pool_size_bounds_concurrent_sandboxes():
    import threading

    p = SandboxPool(2, SandboxLimits(), prebuilt=True, modules=0)
    active = []
    peak = [0]
    lock = threading.Lock()

    def trial():
        with p.sandbox({"data.txt": "1\n"}):
            with lock:
                active.append(1)
                peak[0] = max(peak[0], len(active))
            time.sleep(0.05)
            with lock:
                active.pop()

    threads = [threading.Thread(target=trial) for _ in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    p.close()
    assert peak[0] == 2
    assert p.take_slot_wait_s() > 0
