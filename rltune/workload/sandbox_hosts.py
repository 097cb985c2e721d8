"""The rollout's side of the sandbox hosts: start N hosts (or reach a service's), place trials, collect load.

:class:`SandboxHosts` starts ``env.sandbox_hosts`` host processes (:mod:`rltune.workload.sandbox_host`),
each with ``env.sandbox_pool_size`` sandboxes, its own work directory and, with
``env.sandbox_host_cores`` > 0, its own cores: host i takes that many CPUs counted down from the
highest this process may use (the trainer and engine threads start from the lowest), wrapping round
when there are more hosts than CPUs. With ``env.sandbox_endpoints`` it starts nothing and reaches
those sockets instead (a sandbox service of one's own that speaks the protocol).

A trial goes to the live host with the fewest of this rollout's sandboxes open or asked for there
(ties: the next in turn), opens its sandbox over a connection of its own and holds that connection
until teardown. A host that dies mid-trial fails only the trials it held: their requests end with
:class:`~rltune.workload.sandbox_protocol.SandboxHostLost` (an ``OSError``, so the trial is
counted as failed and the step goes on); the host is then left out of placement, and the step's
``sandbox_hosts`` column drops. No host is restarted.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rltune.errors import RltuneError
from rltune.workload.sandbox import ExecResult, ImageSpec, SandboxLimits
from rltune.workload.sandbox_protocol import (
    PROTOCOL_VERSION,
    RESPONSES,
    SandboxHostLost,
    SandboxProtocolError,
    decode,
    encode,
    parse_endpoint,
    read_message,
)

# A request that gets no answer in this long (an open waits for a free sandbox; an exec runs its
# command under its own wall-clock limit first) means the host hangs: it is treated as lost.
REQUEST_TIMEOUT_S = 900.0
START_TIMEOUT_S = 60.0


class SandboxHostError(RltuneError):
    """Sandbox hosts could not be started or reached as configured."""


def host_cores(index: int, cores_per_host: int, available: list[int] | None = None) -> list[int]:
    """The CPUs host ``index`` is pinned to: ``cores_per_host`` of them counted down from the highest."""
    if cores_per_host <= 0:
        return []
    cpus = sorted(available if available is not None else os.sched_getaffinity(0), reverse=True)
    return sorted({cpus[(index * cores_per_host + j) % len(cpus)] for j in range(cores_per_host)})


class HostSession:
    """One connection to a host: requests answered in order. Its sandboxes go when it closes."""

    def __init__(self, endpoint: str, connect_timeout_s: float = 10.0):
        family, address = parse_endpoint(endpoint)
        self.endpoint = endpoint
        deadline = time.monotonic() + connect_timeout_s
        while True:
            self._sock = socket.socket(family, socket.SOCK_STREAM)
            self._sock.settimeout(connect_timeout_s)
            try:
                self._sock.connect(address)
                break
            except BlockingIOError:  # the host's listen queue is full for a moment (EAGAIN): try again
                self._sock.close()
                if time.monotonic() > deadline:
                    raise SandboxHostLost(f"sandbox host {endpoint}: its listen queue stayed full for "
                                          f"{connect_timeout_s:g} s") from None
                time.sleep(0.01)
            except OSError as exc:
                self._sock.close()
                raise SandboxHostLost(f"sandbox host {endpoint}: cannot connect ({exc})") from None
        self._stream = self._sock.makefile("rb")
        self._lock = threading.Lock()

    def request(self, op: str, timeout_s: float = REQUEST_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """Send one request, return the response's fields; a refusal raises :class:`SandboxProtocolError`."""
        with self._lock:
            try:
                self._sock.settimeout(timeout_s)
                self._sock.sendall(encode({"v": PROTOCOL_VERSION, "op": op, **fields}))
                line = read_message(self._stream)
            except TimeoutError:
                raise SandboxHostLost(f"sandbox host {self.endpoint}: no answer to {op!r} in {timeout_s:g} s") from None
            except OSError as exc:
                raise SandboxHostLost(f"sandbox host {self.endpoint}: connection lost during {op!r} ({exc})") from None
        if line is None:
            raise SandboxHostLost(f"sandbox host {self.endpoint}: closed the connection during {op!r} (the host died?)")
        response = decode(line)
        if response.get("ok") is not True:
            raise SandboxProtocolError(f"sandbox host {self.endpoint}: {op}: {response.get('message', response)}",
                                       str(response.get("error", "bad_request")))
        missing = [name for name in RESPONSES[op] if name not in response]
        if missing:
            raise SandboxProtocolError(f"sandbox host {self.endpoint}: {op}: the response lacks {', '.join(missing)}")
        return response

    def close(self) -> None:
        try:
            self._stream.close()
            self._sock.close()
        except OSError:
            pass


@dataclass
class RemoteSandbox:
    """A trial's sandbox on a host, held over its own session."""

    session: HostSession
    sandbox_id: str
    host: int
    setup_s: float
    queue_s: float
    fs_s: float
    exec_s: float = 0.0

    def execute(self, turn_text: str, tests: int = 0, wall_s: float | None = None) -> ExecResult:
        fields: dict[str, Any] = {"sandbox": self.sandbox_id, "command": turn_text}
        if tests:
            fields["tests"] = int(tests)
        if wall_s is not None:
            fields["wall_s"] = max(0.01, float(wall_s))
        answer = self.session.request("exec", **fields)
        result = ExecResult(str(answer["output"]), int(answer["returncode"]), bool(answer["timed_out"]),
                            float(answer["seconds"]))
        self.exec_s += result.seconds
        return result


@dataclass
class _Host:
    index: int
    endpoint: str
    cores: list[int] = field(default_factory=list)
    process: subprocess.Popen | None = None
    log: Path | None = None
    alive: bool = True
    outstanding: int = 0
    control: HostSession | None = None


class SandboxHosts:
    """N sandbox hosts and the placement of trials on them (see the module docstring)."""

    def __init__(self, count: int, per_host: int, limits: SandboxLimits, image: ImageSpec, *,
                 cores_per_host: int = 0, endpoints: list[str] | tuple[str, ...] = (), workdir: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.limits = limits
        self.image = image
        self.per_host = per_host
        self._lock = threading.Lock()
        self._turn = 0
        self.lost = 0
        self._root = Path(tempfile.mkdtemp(prefix="rltune-hosts-", dir=workdir))
        self.hosts: list[_Host] = []
        try:
            if endpoints:
                self.hosts = [_Host(i, e) for i, e in enumerate(endpoints)]
            else:
                self.hosts = [self._start(i, per_host, host_cores(i, cores_per_host)) for i in range(count)]
                self._wait_ready(start_timeout_s)
            for host in self.hosts:
                host.control = HostSession(host.endpoint)
                host.control.request("hello", timeout_s=30.0)
                host.control.request("stats", timeout_s=30.0)  # the first step's window starts now
        except BaseException:
            self.close()
            raise

    def _start(self, index: int, per_host: int, cores: list[int]) -> _Host:
        workdir = self._root / f"host-{index}"
        workdir.mkdir()
        log = self._root / f"host-{index}.log"
        argv = [sys.executable, "-m", "rltune.workload.sandbox_host", "--listen", f"unix:{self._root / f'host-{index}.sock'}",
                "--workdir", str(workdir), "--max-sandboxes", str(per_host), "--name", f"host-{index}"]
        if cores:
            argv += ["--cores", ",".join(map(str, cores))]
        env = dict(os.environ)
        # The host imports rltune from the same tree as this process, wherever it was started from.
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        with open(log, "wb") as err:
            # In the run's own process group (a cancelled run's group kill takes its hosts), and told to stop
            # when the process that started it dies however it dies.
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                    preexec_fn=_stop_with_parent)
        return _Host(index, "", cores, proc, log)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for host in self.hosts:
            assert host.process is not None and host.process.stdout is not None
            line = _read_line_before(host.process.stdout, deadline)
            if not line.startswith("listening "):
                code = host.process.poll()
                detail = host.log.read_text(errors="replace").strip()[-400:] if host.log and host.log.exists() else ""
                raise SandboxHostError(f"sandbox host {host.index} did not start"
                                       + (f" (exit code {code})" if code is not None else f" within {timeout_s:g} s")
                                       + (f": {detail}" if detail else ""))
            host.endpoint = line.split(" ", 1)[1].strip()

    # -- placement --------------------------------------------------------------------------------
    def _place(self) -> _Host:
        with self._lock:
            live = [h for h in self.hosts if h.alive and (h.process is None or h.process.poll() is None)]
            for host in self.hosts:
                if host.alive and host not in live:
                    self._mark_lost(host)
            if not live:
                raise SandboxHostLost("every sandbox host is gone; no trial can get a sandbox")
            n = len(self.hosts)
            host = min(live, key=lambda h: (h.outstanding, (h.index - self._turn) % n))
            self._turn = (host.index + 1) % n
            host.outstanding += 1
            return host

    def _mark_lost(self, host: _Host) -> None:
        if host.alive:
            host.alive = False
            self.lost += 1

    def _lost(self, host: _Host) -> None:
        """A session to ``host`` broke: the host is lost unless it still answers (one session broke, not the host)."""
        if host.process is not None:
            try:  # a killed host's connections close as it exits: give the exit a moment to be seen
                host.process.wait(timeout=1.0)
                alive = False
            except subprocess.TimeoutExpired:
                alive = True
        else:
            try:
                alive = host.control is not None and bool(host.control.request("hello", timeout_s=10.0))
            except (SandboxHostLost, SandboxProtocolError):
                alive = False
        if not alive:
            with self._lock:
                self._mark_lost(host)

    @contextmanager
    def sandbox(self, files: dict[str, str]):
        """Place a trial, open its sandbox there, yield the :class:`RemoteSandbox`, remove it."""
        host = self._place()
        session = None
        try:
            session = HostSession(host.endpoint)
            answer = session.request("open", files=files,
                                     image={"modules": self.image.modules, "prebuilt": self.image.prebuilt},
                                     limits={"cpu_s": self.limits.cpu_s, "memory_mb": self.limits.memory_mb,
                                             "wall_s": self.limits.wall_s})
            box = RemoteSandbox(session, answer["sandbox"], host.index, float(answer["setup_s"]),
                                float(answer["queue_s"]), float(answer["fs_s"]))
            try:
                yield box
            finally:
                try:
                    box.fs_s += float(session.request("close", timeout_s=60.0, sandbox=box.sandbox_id)["fs_s"])
                except SandboxHostLost:
                    pass  # the host is gone and its sandboxes with it; the trial's own error says so
        except SandboxHostLost as exc:
            exc.host = host.index  # the trial failed on this host, wherever in its session
            self._lost(host)
            raise
        except SandboxProtocolError as exc:
            if exc.error == "setup_failed":
                raise OSError(str(exc)) from None  # a failed set-up fails the trial, as a local one does
            raise
        finally:
            if session is not None:
                session.close()
            with self._lock:
                host.outstanding -= 1

    # -- per-step figures -------------------------------------------------------------------------
    def host_stats(self) -> list[dict[str, Any] | None]:
        """Each host's ``stats`` since the last call (None for a host that is gone)."""
        out: list[dict[str, Any] | None] = []
        for host in self.hosts:
            if not host.alive or host.control is None:
                out.append(None)
                continue
            try:
                out.append(host.control.request("stats", timeout_s=30.0))
            except SandboxHostLost:
                with self._lock:
                    self._mark_lost(host)
                out.append(None)
        return out

    def live_count(self) -> int:
        with self._lock:
            return sum(h.alive and (h.process is None or h.process.poll() is None) for h in self.hosts)

    def kill(self, index: int) -> None:
        """Kill host ``index`` (SIGKILL, no clean-up of its own): what a crashed host looks like."""
        process = self.hosts[index].process
        if process is None:
            raise SandboxHostError(f"host {index} is a service at {self.hosts[index].endpoint}; rltune did not start it")
        process.kill()
        process.wait(timeout=10)

    def close(self) -> None:
        for host in self.hosts:
            if host.control is not None:
                host.control.close()
            proc = host.process
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        shutil.rmtree(self._root, ignore_errors=True)


def _stop_with_parent() -> None:
    """In a host between fork and exec: SIGTERM it when its parent dies (Linux; elsewhere the group kill)."""
    from rltune.workload.sandbox import _PR_SET_PDEATHSIG, _PRCTL

    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _read_line_before(stream, deadline: float) -> str:
    """The first line of a child's stdout, or '' if none came before ``deadline`` or it exited."""
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    buffer = b""
    try:
        while b"\n" not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(timeout=remaining):
                return ""
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            buffer += chunk
    finally:
        selector.close()
    return buffer.split(b"\n", 1)[0].decode("utf-8", errors="replace")


__all__ = ["HostSession", "RemoteSandbox", "SandboxHostError", "SandboxHosts", "host_cores"]
