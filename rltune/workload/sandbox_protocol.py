"""The sandbox-host protocol (version 1): how a tool-use trial reaches the sandboxes of a host.

This is the seam where a sandbox service of one's own plugs in (containers, a remote pool): anything
that listens on a stream socket and answers these messages can run the reference workload's
sandboxes. rltune's own host (:mod:`rltune.workload.sandbox_host`) is one implementation; the
client (:mod:`rltune.workload.sandbox_hosts`) is the other side. docs/workload.md ("Sandbox hosts")
specifies it in prose; this module is the one place its names and bounds are spelled.

Framing: each message is one JSON object, UTF-8, on one line ended by ``\\n``, at most
:data:`MAX_MESSAGE_BYTES` bytes with the newline. The client sends a request and reads exactly one
response before it sends the next; a connection is a *session*: the sandboxes opened on it belong
to it and are removed when it closes, however it closes (a client that dies leaves nothing).

Every request carries ``"v": 1`` and ``"op"``; every response carries ``"v": 1`` and ``"ok"``
(``true``, with the op's fields; or ``false`` with ``"error"`` -- one of :data:`ERRORS` -- and a
``"message"`` for a person). Ops and their fields are :data:`REQUESTS` and :data:`RESPONSES`.
Endpoints are written ``unix:/path/to/socket`` or ``tcp:HOST:PORT``.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from rltune.errors import RltuneError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Bounds a host enforces on a request, so a client cannot make it allocate or spawn without limit.
MAX_FILES = 256
MAX_FILE_BYTES = 1024 * 1024
MAX_MODULES = 4096
MAX_TEST_CASES = 1_000_000

# op -> {field: (python type(s), required)}; fields not listed are refused.
REQUESTS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "hello": {},
    "open": {"files": ((dict,), True), "image": ((dict,), False), "limits": ((dict,), False)},
    "exec": {"sandbox": ((str,), True), "command": ((str,), True), "tests": ((int,), False),
             "wall_s": ((int, float), False)},
    "close": {"sandbox": ((str,), True)},
    "stats": {},
}
# What each op's successful response holds (documentation and the client's check).
RESPONSES: dict[str, tuple[str, ...]] = {
    "hello": ("host", "protocol", "cores", "max_sandboxes", "workdir"),
    "open": ("sandbox", "queue_s", "setup_s", "fs_s"),
    "exec": ("output", "returncode", "timed_out", "seconds"),
    "close": ("fs_s",),
    "stats": ("window_s", "load", "busy_frac", "open", "waiting", "opened", "queue_s", "setup_s", "exec_s", "fs_s"),
}
ERRORS = ("bad_request", "version", "no_sandbox", "setup_failed", "too_large")


class SandboxProtocolError(RltuneError):
    """A peer broke the protocol (bad framing, version, fields) or answered with an error."""

    def __init__(self, message: str, error: str = "bad_request"):
        super().__init__(message)
        self.error = error


class SandboxHostLost(ConnectionError):
    """The host went away mid-session (killed, crashed, unreachable): the trials it ran fail, the step goes on.

    A ``ConnectionError`` (an ``OSError``), so a trial treats it as the sandbox failing under it.
    """


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode("utf-8") + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        raise SandboxProtocolError(f"message of {len(data)} bytes is over the protocol's {MAX_MESSAGE_BYTES}", "too_large")
    return data


def decode(line: bytes) -> dict[str, Any]:
    """One received line as a message object; anything else raises :class:`SandboxProtocolError`."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise SandboxProtocolError(f"message over {MAX_MESSAGE_BYTES} bytes", "too_large")
    try:
        data = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise SandboxProtocolError("a message is one JSON object on one UTF-8 line") from None
    if not isinstance(data, dict):
        raise SandboxProtocolError(f"a message is a JSON object, found {type(data).__name__}")
    if data.get("v") != PROTOCOL_VERSION:
        raise SandboxProtocolError(f"protocol version {data.get('v')!r}; this side speaks {PROTOCOL_VERSION}", "version")
    return data


def check_request(message: dict[str, Any]) -> str:
    """The request's op, after checking its fields against :data:`REQUESTS`."""
    op = message.get("op")
    if op not in REQUESTS:
        raise SandboxProtocolError(f"op {op!r}: expected one of {', '.join(REQUESTS)}")
    spec = REQUESTS[op]
    for name in message:
        if name not in ("v", "op") and name not in spec:
            raise SandboxProtocolError(f"{op}: unknown field {name!r} (fields: {', '.join(spec) or 'none'})")
    for name, (types, required) in spec.items():
        if name not in message:
            if required:
                raise SandboxProtocolError(f"{op}: missing field {name!r}")
            continue
        value = message[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise SandboxProtocolError(f"{op}: field {name!r} has the wrong type ({type(value).__name__})")
    return op


def error_response(error: str, message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": False, "error": error, "message": message}


def ok_response(**fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": True, **fields}


def read_message(stream) -> bytes | None:
    """One line from a binary stream (``socket.makefile('rb')``), None at a clean end of stream."""
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) > MAX_MESSAGE_BYTES:
            raise SandboxProtocolError(f"message over {MAX_MESSAGE_BYTES} bytes", "too_large")
        return None  # the peer went away mid-line
    return line


def parse_endpoint(text: str) -> tuple[int, Any]:
    """``unix:/path`` -> (AF_UNIX, path); ``tcp:HOST:PORT`` -> (AF_INET, (host, port))."""
    kind, sep, rest = text.partition(":")
    if sep and kind == "unix" and rest:
        return socket.AF_UNIX, rest
    if sep and kind == "tcp":
        host, sep2, port = rest.rpartition(":")
        if sep2 and host and port.isdigit() and 0 <= int(port) < 65536:
            return socket.AF_INET, (host, int(port))
    raise SandboxProtocolError(f"endpoint {text!r}: write unix:/path/to/socket or tcp:HOST:PORT")


def format_endpoint(family: int, address: Any) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{address}"
    host, port = address[:2]
    return f"tcp:{host}:{port}"


__all__ = ["ERRORS", "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "REQUESTS", "RESPONSES", "SandboxHostLost",
           "SandboxProtocolError", "check_request", "decode", "encode", "error_response", "format_endpoint",
           "ok_response", "parse_endpoint", "read_message"]
