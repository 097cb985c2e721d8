"""One sandbox host: a server process with its own cores, work directory and limit on concurrent sandboxes.

``python -m rltune.workload.sandbox_host --listen unix:/path/host.sock --workdir DIR --max-sandboxes N
[--cores 2,3] [--name host-0]`` serves the sandbox-host protocol (:mod:`rltune.workload.sandbox_protocol`)
over a stream socket until it is sent SIGTERM or SIGINT. Its first line on stdout is
``listening <endpoint>`` once it accepts connections (``tcp:127.0.0.1:0`` picks a free port and
prints it). ``--cores`` pins the host and every command it starts to those CPUs
(``os.sched_setaffinity``); sandbox directories live under ``--workdir`` and are removed when their
session ends, and the whole work directory's sandboxes when the host stops.

Load: a sampler thread reads, every :data:`SAMPLE_EVERY_S`, how many of the host's command processes
are runnable (state R); ``stats`` reports their mean per core over the samples in which at least
one command was alive (how crowded the cores are while sandboxes work), and the share of samples
with one (``busy_frac``). More than one runnable process per core means trials wait for the CPU.

It imports only the standard library and its two sibling modules: a host starts in a fraction of
a second and needs none of torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rltune.workload.sandbox import ChildTracker, ImageSpec, Sandbox, SandboxLimits, SandboxPool
from rltune.workload.sandbox_protocol import (
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_MODULES,
    MAX_TEST_CASES,
    PROTOCOL_VERSION,
    SandboxProtocolError,
    check_request,
    decode,
    encode,
    error_response,
    format_endpoint,
    ok_response,
    parse_endpoint,
    read_message,
)

SAMPLE_EVERY_S = 0.02
# Limits a request may ask for: what the workload's config allows, so a client cannot lift them.
MAX_CPU_S, MAX_MEMORY_MB, MAX_WALL_S = 3600, 65536, 3600.0


class LoadSampler:
    """Samples the runnable command processes of a host; :meth:`take` gives the window's figures."""

    def __init__(self, tracker: ChildTracker, cores: int):
        self.tracker = tracker
        self.cores = max(1, cores)
        self._lock = threading.Lock()
        self._reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rltune-host-load", daemon=True)
        self._thread.start()

    def _reset(self) -> None:
        self.samples = 0
        self.busy_samples = 0
        self.runnable_sum = 0
        self.since = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            alive = self.tracker.pids()
            runnable = self.tracker.runnable() if alive else 0
            with self._lock:
                self.samples += 1
                if alive:
                    self.busy_samples += 1
                    self.runnable_sum += runnable

    def take(self) -> dict[str, float]:
        with self._lock:
            out = {"window_s": time.monotonic() - self.since,
                   "load": self.runnable_sum / self.busy_samples / self.cores if self.busy_samples else 0.0,
                   "busy_frac": self.busy_samples / self.samples if self.samples else 0.0}
            self._reset()
        return out

    def stop(self) -> None:
        self._stop.set()


class Host:
    """The host's state: its pool, its sessions' sandboxes and the counters ``stats`` reports."""

    def __init__(self, name: str, workdir: Path, max_sandboxes: int, cores: list[int]):
        self.name = name
        self.workdir = workdir
        self.cores = cores
        self.tracker = ChildTracker()
        self.pool = SandboxPool(max_sandboxes, workdir=str(workdir), tracker=self.tracker)
        self.max_sandboxes = max_sandboxes
        self.sampler = LoadSampler(self.tracker, len(cores))
        self._lock = threading.Lock()
        self._boxes: dict[str, Sandbox] = {}
        self._ids = 0
        self._totals = self._zero()

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"opened": 0, "queue_s": 0.0, "setup_s": 0.0, "exec_s": 0.0, "fs_s": 0.0}

    def _count(self, **amounts: float) -> None:
        with self._lock:
            for key, value in amounts.items():
                self._totals[key] += value

    # -- ops --------------------------------------------------------------------------------------
    def hello(self, request: dict) -> dict:
        return ok_response(host=self.name, protocol=PROTOCOL_VERSION, cores=self.cores,
                           max_sandboxes=self.max_sandboxes, workdir=str(self.workdir))

    def open(self, request: dict, session: set[str]) -> dict:
        files = request["files"]
        if len(files) > MAX_FILES or any(not isinstance(k, str) or not isinstance(v, str) for k, v in files.items()):
            raise SandboxProtocolError(f"open: files is a mapping of at most {MAX_FILES} names to texts")
        for name, text in files.items():
            if not name or "/" in name or "\\" in name or name.startswith(".") or name in ("lib", "results"):
                raise SandboxProtocolError(f"open: file name {name!r} is not a plain name of the trial directory")
            if len(text.encode("utf-8")) > MAX_FILE_BYTES:
                raise SandboxProtocolError(f"open: file {name!r} is over {MAX_FILE_BYTES} bytes", "too_large")
        image = _image(request.get("image", {}))
        limits = _limits(request.get("limits", {}))
        try:
            box = self.pool.open(files, image, limits)
        except OSError as exc:
            raise SandboxProtocolError(f"open: setting up the sandbox failed: {exc}", "setup_failed") from None
        with self._lock:
            self._ids += 1
            sandbox_id = f"{self.name}-s{self._ids}"
            self._boxes[sandbox_id] = box
        session.add(sandbox_id)
        self._count(opened=1, queue_s=box.queue_s, setup_s=box.setup_s, fs_s=box.fs_s)
        return ok_response(sandbox=sandbox_id, queue_s=box.queue_s, setup_s=box.setup_s, fs_s=box.fs_s)

    def _box(self, sandbox_id: str, session: set[str]) -> Sandbox:
        with self._lock:
            box = self._boxes.get(sandbox_id)
        if box is None or sandbox_id not in session:
            raise SandboxProtocolError(f"no sandbox {sandbox_id!r} open in this session", "no_sandbox")
        return box

    def exec(self, request: dict, session: set[str]) -> dict:
        box = self._box(request["sandbox"], session)
        tests = request.get("tests", 0)
        if not 0 <= tests <= MAX_TEST_CASES:
            raise SandboxProtocolError(f"exec: tests must be 0..{MAX_TEST_CASES}, found {tests}")
        wall_s = request.get("wall_s")
        if wall_s is not None and not 0 < wall_s <= MAX_WALL_S:
            raise SandboxProtocolError(f"exec: wall_s must be in (0, {MAX_WALL_S:g}], found {wall_s}")
        result = box.execute(request["command"], tests=tests, wall_s=wall_s)
        self._count(exec_s=result.seconds)
        return ok_response(output=result.output, returncode=result.returncode, timed_out=result.timed_out,
                           seconds=result.seconds)

    def close(self, request: dict, session: set[str]) -> dict:
        box = self._box(request["sandbox"], session)
        fs_s = self._release(request["sandbox"], session, box)
        return ok_response(fs_s=fs_s)

    def _release(self, sandbox_id: str, session: set[str], box: Sandbox) -> float:
        with self._lock:
            self._boxes.pop(sandbox_id, None)
        session.discard(sandbox_id)
        seconds = self.pool.close(box)
        self._count(fs_s=seconds)
        return seconds

    def stats(self, request: dict) -> dict:
        load = self.sampler.take()
        with self._lock:
            totals, self._totals = self._totals, self._zero()
        return ok_response(**load, open=self.pool.open_now, waiting=self.pool.waiting, **totals)

    def end_session(self, session: set[str]) -> None:
        """The connection closed: remove whatever sandboxes it still held."""
        for sandbox_id in list(session):
            with self._lock:
                box = self._boxes.get(sandbox_id)
            if box is not None:
                self._release(sandbox_id, session, box)

    def shutdown(self) -> None:
        self.sampler.stop()
        self.pool.close()


def _image(data: Any) -> ImageSpec:
    if not isinstance(data, dict) or set(data) - {"modules", "prebuilt"}:
        raise SandboxProtocolError("open: image is {\"modules\": int, \"prebuilt\": bool}")
    modules, prebuilt = data.get("modules", 24), data.get("prebuilt", False)
    if isinstance(modules, bool) or not isinstance(modules, int) or not 0 <= modules <= MAX_MODULES:
        raise SandboxProtocolError(f"open: image.modules must be an integer 0..{MAX_MODULES}")
    if not isinstance(prebuilt, bool):
        raise SandboxProtocolError("open: image.prebuilt must be true or false")
    return ImageSpec(modules, prebuilt)


def _limits(data: Any) -> SandboxLimits:
    if not isinstance(data, dict) or set(data) - {"cpu_s", "memory_mb", "wall_s"}:
        raise SandboxProtocolError("open: limits is {\"cpu_s\": int, \"memory_mb\": int, \"wall_s\": number}")
    default = SandboxLimits()
    values = {"cpu_s": data.get("cpu_s", default.cpu_s), "memory_mb": data.get("memory_mb", default.memory_mb),
              "wall_s": data.get("wall_s", default.wall_s)}
    for name, top, kinds in (("cpu_s", MAX_CPU_S, (int,)), ("memory_mb", MAX_MEMORY_MB, (int,)),
                             ("wall_s", MAX_WALL_S, (int, float))):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= top:
            raise SandboxProtocolError(f"open: limits.{name} must be a number in (0, {top:g}]")
    return SandboxLimits(int(values["cpu_s"]), int(values["memory_mb"]), float(values["wall_s"]))


class _Handler(socketserver.StreamRequestHandler):
    """One connection = one session: requests answered in order; its sandboxes removed when it ends."""

    def handle(self) -> None:
        host: Host = self.server.host  # type: ignore[attr-defined]
        session: set[str] = set()
        try:
            while True:
                try:
                    line = read_message(self.rfile)
                except SandboxProtocolError as exc:
                    self._send(error_response(exc.error, str(exc)))
                    return
                if line is None:
                    return
                self._send(self._answer(host, line, session))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: its sandboxes go with it
        finally:
            host.end_session(session)

    @staticmethod
    def _answer(host: Host, line: bytes, session: set[str]) -> dict:
        try:
            request = decode(line)
            op = check_request(request)
            if op == "hello":
                return host.hello(request)
            if op == "stats":
                return host.stats(request)
            return getattr(host, op)(request, session)
        except SandboxProtocolError as exc:
            return error_response(exc.error, str(exc))

    def _send(self, message: dict) -> None:
        self.wfile.write(encode(message))
        self.wfile.flush()


# Every trial opens its own session: a batch's trials connect at once, past socketserver's backlog of 5.
LISTEN_BACKLOG = 4096


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


class _TcpServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG


def serve(listen: str, workdir: Path, max_sandboxes: int, cores: list[int] | None, name: str,
          ready=None) -> None:
    """Run a host until SIGTERM/SIGINT (or ``ready(server)``'s caller shuts the server down)."""
    if cores:
        os.sched_setaffinity(0, cores)
    cores = sorted(os.sched_getaffinity(0))
    workdir.mkdir(parents=True, exist_ok=True)
    family, address = parse_endpoint(listen)
    server_cls = _UnixServer if family == socket.AF_UNIX else _TcpServer
    if family == socket.AF_UNIX and os.path.exists(address):
        os.unlink(address)  # a socket file an earlier host left behind
    server = server_cls(address, _Handler)
    server.host = Host(name, workdir, max_sandboxes, cores)  # type: ignore[attr-defined]

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    bound = server.server_address
    print(f"listening {format_endpoint(family, bound)}", flush=True)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        server.host.shutdown()  # type: ignore[attr-defined]
        if family == socket.AF_UNIX:
            try:
                os.unlink(address)
            except FileNotFoundError:
                pass


def _cores(text: str) -> list[int]:
    try:
        cores = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cores {text!r}: a comma-separated list of CPU numbers, e.g. 2,3") from None
    if not cores:
        raise argparse.ArgumentTypeError("--cores: give at least one CPU")
    return cores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltune.workload.sandbox_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="unix:/path/to/socket or tcp:HOST:PORT (port 0: any free one)")
    parser.add_argument("--workdir", required=True, type=Path, help="where this host's sandbox directories live")
    parser.add_argument("--max-sandboxes", required=True, type=int, help="sandboxes this host runs at once")
    parser.add_argument("--cores", type=_cores, default=None, help="CPUs to pin the host to (default: inherit)")
    parser.add_argument("--name", default="host", help="the host's name in sandbox ids and stats")
    args = parser.parse_args(argv)
    if args.max_sandboxes < 1:
        parser.error("--max-sandboxes must be at least 1")
    try:
        serve(args.listen, args.workdir, args.max_sandboxes, args.cores, args.name)
    except (OSError, SandboxProtocolError) as exc:
        print(f"sandbox host {args.name}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
