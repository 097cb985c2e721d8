"""Sandbox hosts on this CPU: real host processes over real sockets.

The protocol answers and refuses as docs/workload.md says; a host runs at most its own number of
sandboxes and pins itself and its commands to its cores; trials are placed across hosts; and a host
killed mid-trial fails only the trials it held, leaves no command running, and is left out after.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rltune.workload.sandbox import ImageSpec, SandboxLimits
from rltune.workload.sandbox_hosts import HostSession, SandboxHosts, host_cores
from rltune.workload.sandbox_protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    SandboxHostLost,
    SandboxProtocolError,
    parse_endpoint,
)

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(cpu_s=5, memory_mb=512, wall_s=20.0)


def _start_host(tmp_path: Path, listen: str, max_sandboxes: int = 2, name: str = "h") -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "rltune.workload.sandbox_host", "--listen", listen, "--workdir",
                             str(tmp_path / name), "--max-sandboxes", str(max_sandboxes), "--name", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    line = proc.stdout.readline().decode()
    assert line.startswith("listening "), proc.stderr.read().decode()
    return proc, line.split(" ", 1)[1].strip()


@pytest.fixture
def host(tmp_path):
    proc, endpoint = _start_host(tmp_path, f"unix:{tmp_path / 'h.sock'}")
    yield proc, endpoint, tmp_path / "h"
    proc.terminate()
    proc.wait(timeout=10)


def _raw(endpoint: str, payload: bytes) -> dict:
    family, address = parse_endpoint(endpoint)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(address)
        sock.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def test_hello_names_the_host_its_limit_and_the_protocol_version(host):
    _, endpoint, workdir = host
    session = HostSession(endpoint)
    answer = session.request("hello")
    session.close()
    assert answer["protocol"] == PROTOCOL_VERSION == 1
    assert (answer["host"], answer["max_sandboxes"], answer["workdir"]) == ("h", 2, str(workdir))
    assert answer["cores"] == sorted(os.sched_getaffinity(0))  # no --cores: it inherits this process's CPUs


@pytest.mark.parametrize(("payload", "error", "says"), [
    (b"not json\n", "bad_request", "one JSON object"),
    (b"[1, 2]\n", "bad_request", "a JSON object, found list"),
    (b'{"v": 2, "op": "hello"}\n', "version", "protocol version 2"),
    (b'{"v": 1, "op": "reboot"}\n', "bad_request", "op 'reboot'"),
    (b'{"v": 1, "op": "hello", "extra": 1}\n', "bad_request", "unknown field 'extra'"),
    (b'{"v": 1, "op": "exec", "sandbox": "h-s1"}\n', "bad_request", "missing field 'command'"),
    (b'{"v": 1, "op": "exec", "sandbox": "h-s1", "command": "ls", "tests": true}\n', "bad_request", "wrong type"),
    (b'{"v": 1, "op": "exec", "sandbox": "h-s9", "command": "ls"}\n', "no_sandbox", "no sandbox 'h-s9'"),
    (b'{"v": 1, "op": "open", "files": {"../x": "1"}}\n', "bad_request", "not a plain name"),
    (b'{"v": 1, "op": "open", "files": {}, "limits": {"cpu_s": 1e9}}\n', "bad_request", "limits.cpu_s"),
    (b'{"v": 1, "op": "open", "files": {}, "image": {"modules": -1}}\n', "bad_request", "image.modules"),
])
def test_a_request_the_protocol_does_not_allow_is_answered_with_its_error(host, payload, error, says):
    answer = _raw(host[1], payload)
    assert answer["v"] == 1 and answer["ok"] is False and answer["error"] == error
    assert says in answer["message"], answer["message"]


def test_an_oversized_message_is_refused_not_read_into_memory(host):
    answer = _raw(host[1], b'{"v": 1, "op": "hello", "pad": "' + b"x" * (MAX_MESSAGE_BYTES + 10) + b'"}\n')
    assert answer["error"] == "too_large"


def test_a_session_runs_commands_and_its_sandboxes_go_when_it_closes(host):
    _, endpoint, workdir = host
    session = HostSession(endpoint)
    opened = session.request("open", files={"data.txt": "4 5 6\n"}, image={"modules": 3, "prebuilt": False})
    answer = session.request("exec", sandbox=opened["sandbox"], command="sum data.txt", tests=5)
    assert answer["output"] == "15\ntests: 5 passed, 0 failed" and answer["returncode"] == 0
    # A second session cannot reach the first one's sandbox.
    other = HostSession(endpoint)
    with pytest.raises(SandboxProtocolError, match="no sandbox"):
        other.request("exec", sandbox=opened["sandbox"], command="ls")
    trials = next(workdir.glob("rltune-sandboxes-*")) / "trials"
    assert len(list(trials.iterdir())) == 1
    session.close()  # no 'close' request: the host removes the session's sandbox when the connection ends
    deadline = time.monotonic() + 10
    while list(trials.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(trials.iterdir()) == []
    assert other.request("stats")["open"] == 0
    other.close()


def test_a_host_runs_at_most_its_own_number_of_sandboxes(host):
    _, endpoint, _ = host  # --max-sandboxes 2
    first, second, third = HostSession(endpoint), HostSession(endpoint), HostSession(endpoint)
    control = HostSession(endpoint)
    a = first.request("open", files={}, image={"modules": 0})
    second.request("open", files={}, image={"modules": 0})
    got = {}
    waiter = threading.Thread(target=lambda: got.update(third.request("open", files={}, image={"modules": 0})))
    waiter.start()
    deadline = time.monotonic() + 10
    while control.request("stats")["waiting"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert control.request("stats")["waiting"] == 1 and not got  # the third waits for a free sandbox
    first.request("close", sandbox=a["sandbox"])
    waiter.join(timeout=10)
    assert got["sandbox"] and control.request("stats")["open"] == 2
    for s in (first, second, third, control):
        s.close()


def test_a_host_listens_on_tcp_too_and_says_which_port_it_took(tmp_path):
    proc, endpoint = _start_host(tmp_path, "tcp:127.0.0.1:0")
    try:
        assert endpoint.startswith("tcp:127.0.0.1:") and not endpoint.endswith(":0")
        session = HostSession(endpoint)
        assert session.request("hello")["host"] == "h"
        session.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_host_cores_count_down_from_the_highest_cpu_and_wrap():
    assert host_cores(0, 2, [0, 1, 2, 3, 4, 5]) == [4, 5]
    assert host_cores(1, 2, [0, 1, 2, 3, 4, 5]) == [2, 3]
    assert host_cores(2, 4, [0, 1, 2, 3, 4, 5]) == [0, 1, 2, 3]  # the third host of four CPUs wraps round
    assert host_cores(1, 4, [0, 1, 2, 3, 4, 5]) == [0, 1, 4, 5]
    assert host_cores(3, 1, [0, 1]) == [0]
    assert host_cores(0, 0, [0, 1]) == []  # 0: not pinned


def _cpus_allowed(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/status").read_text()
    spec = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Cpus_allowed_list"))
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _commands_under(root: Path) -> list[int]:
    """Pids of processes whose working directory lies under ``root`` (a sandbox command runs in its trial dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(Path(os.readlink(entry / "cwd"))).startswith(str(root)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_two_hosts_pin_their_cores_place_trials_in_turn_and_a_killed_host_fails_only_its_trial(tmp_path):
    hosts = SandboxHosts(2, 2, LIMITS, ImageSpec(modules=4), cores_per_host=1, workdir=str(tmp_path))
    try:
        cpus = sorted(os.sched_getaffinity(0), reverse=True)
        assert [_cpus_allowed(h.process.pid) for h in hosts.hosts] == [{cpus[0]}, {cpus[1 % len(cpus)]}]
        # One at a time, trials go to the hosts in turn.
        placed = []
        for i in range(4):
            with hosts.sandbox({"data.txt": f"{i}\n"}) as box:
                assert box.execute("cat data.txt").output == f"{i}\n"
                placed.append(box.host)
        assert placed == [0, 1, 0, 1]

        # Two trials at once, one on each host; host 0 is killed while its trial's command runs.
        outcome: dict[int, object] = {}
        running = threading.Event()

        def trial(slot: int, tests: int) -> None:
            try:
                with hosts.sandbox({"data.txt": "1 2\n"}) as box:
                    running.set() if box.host == 0 else None
                    outcome[box.host] = box.execute("sum data.txt", tests=tests).output
                    outcome[box.host] = box.execute("sum data.txt").output  # a second command after the first
            except SandboxHostLost as exc:
                outcome[exc.host] = exc

        first = threading.Thread(target=trial, args=(0, 200_000))  # host 0 (its turn): a long command
        first.start()
        assert running.wait(timeout=20)
        second = threading.Thread(target=trial, args=(1, 20))
        second.start()
        host0_dir = tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.startswith("rltune-hosts-")) / "host-0"
        deadline = time.monotonic() + 20
        while not _commands_under(host0_dir) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _commands_under(host0_dir), "host 0's command never started"
        hosts.kill(0)
        first.join(timeout=30)
        second.join(timeout=30)
        assert isinstance(outcome[0], SandboxHostLost) and outcome[0].host == 0
        assert outcome[1] == "3"  # host 1's trial ran to its end
        # The killed host's command died with it (it runs in its own session, told to die with its host).
        deadline = time.monotonic() + 10
        while _commands_under(host0_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _commands_under(host0_dir) == []
        # Host 0 is left out from here on: every trial goes to host 1, and host 0 has no stats.
        assert hosts.live_count() == 1 and hosts.lost == 1
        after = []
        for _ in range(3):
            with hosts.sandbox({}) as box:
                after.append(box.host)
        assert after == [1, 1, 1]
        stats = hosts.host_stats()
        assert stats[0] is None and stats[1]["opened"] >= 4
    finally:
        hosts.close()


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_hosts_stop_when_the_process_that_started_them_is_killed(tmp_path):
    """A run killed with SIGKILL (a time-out, a cancelled trial) leaves no sandbox host running."""
    code = ("import sys, time; from rltune.workload.sandbox_hosts import SandboxHosts; "
            "from rltune.workload.sandbox import SandboxLimits, ImageSpec; "
            f"h = SandboxHosts(2, 1, SandboxLimits(), ImageSpec(modules=0), workdir={str(tmp_path)!r}); "
            "print(' '.join(str(x.process.pid) for x in h.hosts), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_running(p) for p in pids)
    proc.kill()  # only the parent: the hosts must go by themselves
    proc.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        time.sleep(0.05)
    assert alive == []


def test_with_every_host_gone_a_trial_fails_at_once():
    hosts = SandboxHosts(1, 1, LIMITS, ImageSpec(modules=0))
    try:
        hosts.kill(0)
        with pytest.raises(SandboxHostLost, match="every sandbox host is gone"):
            with hosts.sandbox({}):
                pass
    finally:
        hosts.close()


def test_a_service_of_ones_own_is_reached_through_its_endpoint(host):
    """env.sandbox_endpoints: rltune starts nothing and uses the service at the socket."""
    proc, endpoint, _ = host
    hosts = SandboxHosts(1, 1, LIMITS, ImageSpec(modules=2), endpoints=[endpoint])
    try:
        assert hosts.hosts[0].process is None
        with hosts.sandbox({"data.txt": "7\n"}) as box:
            assert box.execute("cat data.txt").output == "7\n"
        with pytest.raises(Exception, match="rltune did not start it"):
            hosts.kill(0)
    finally:
        hosts.close()
    assert proc.poll() is None  # closing the rollout's side leaves the service running


def _host_pid(name: str, parent_run_dir: Path) -> int | None:
    """The pid of the sandbox host called ``name`` whose work directory a run under ``parent_run_dir`` made."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rltune.workload.sandbox_host" in argv and name.encode() in argv:
            return int(entry.name)
    return None


def _children(pid: int) -> list[str]:
    """Child pids of every thread of ``pid`` (a host starts commands from its sessions' threads)."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                found += (task / "children").read_text().split()
            except OSError:
                continue  # the thread ended meanwhile
    except OSError:
        return []
    return found


@pytest.mark.slow
def test_a_host_killed_mid_step_fails_only_its_trials_and_the_run_goes_on(tmp_path):
    """The real workload (tiny tool use, two hosts): host 0 is killed while one of its commands runs; that
    step counts only host 0's trials as failed, the run finishes its steps, and later steps use host 1."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rltune.cli.main", "workload", "run",
                             str(REPO / "presets" / "workload" / "tiny-tool-use.yaml"), "--steps", "4", "--run-dir",
                             str(run_dir), "env.sandbox_hosts=2", "env.sandbox_pool_size=4",
                             "env.sandbox_test_cases=40", "orchestrator.tasks_per_batch=4"],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=tmp_path)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while (not metrics.exists() or not metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics.exists(), "the run never finished a step"
        killed = False
        while not killed and time.monotonic() < deadline and proc.poll() is None:
            pid = _host_pid("host-0", run_dir)
            children = _children(pid) if pid else []
            if children:  # one of host 0's commands runs now: a trial is mid-turn there
                os.kill(pid, 9)
                killed = True
            time.sleep(0.01)
        assert killed, "host 0 never ran a command after the first step"
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()[-2000:]
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    hit = next(r for r in recs if r["sandbox_hosts_lost"] == 1)
    assert 1 <= hit["trials_failed"] == hit["sandbox_host/0/failed"] <= hit["sandbox_host/0/trials"]
    assert hit["sandbox_host/1/failed"] == 0
    for later in recs[recs.index(hit) + 1:]:
        assert later["sandbox_hosts"] == 1 and later["trials_failed"] == 0
        assert later["sandbox_host/1/trials"] == later["trials_total"] and "sandbox_host/0/load" not in later
