"""An append-only, fsynced JSON-lines journal: what makes ``rltune auto`` resumable after ``kill -9``.

Each event is one line written with a single ``write`` and made durable with ``fsync`` before the
loop moves on. A process killed mid-write leaves at most one torn last line; reading skips it, so
the journal always replays to the last event that was fully written, and the next append cuts the
torn line off first.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rltune.errors import RltuneError


class JournalError(RltuneError):
    """The journal cannot be read or belongs to another job."""


class Journal:
    """Events of one ``auto`` run, in the order they happened."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @staticmethod
    def _drop_torn_tail(fd: int) -> None:
        """Cut an unterminated last line (a writer killed mid-write) so the next event starts clean."""
        size = os.fstat(fd).st_size
        if not size or os.pread(fd, 1, size - 1) == b"\n":
            return
        end = size
        while end > 0:
            start = max(0, end - 4096)
            chunk = os.pread(fd, end - start, start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                os.ftruncate(fd, start + cut + 1)
                return
            end = start
        os.ftruncate(fd, 0)

    def events(self) -> list[dict[str, Any]]:
        """Every fully written event; a torn last line (a kill mid-write) is ignored."""
        if not self.path.exists():
            return []
        out = []
        lines = self.path.read_bytes().split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the last, unterminated line: torn by a kill
                    break
                raise JournalError(f"{self.path}: line {number}: not JSON; the journal was edited by hand? "
                                   f"remove the line or start a fresh --workdir") from None
            out.append(event)
        return out

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event durably and return it."""
        event = {"event": kind, "time": time.time(), **fields}
        line = json.dumps(event, sort_keys=False, default=str).encode() + b"\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._drop_torn_tail(fd)
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        return event
