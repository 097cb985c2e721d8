"""Scrape a vLLM ``/metrics`` endpoint once per step while a job runs.

A background thread watches the job's metrics file. Each time a new step's line appears it
scrapes the endpoint; the difference between consecutive scrapes (counter and histogram
increments, gauges at the later scrape) belongs to that step. Before the first step it scrapes
once as the baseline. A scrape that fails is counted, never fatal: the job's own metrics matter more.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rltune.errors import LogFormatError
from rltune.profile.adapters import vllm

POLL_INTERVAL_S = 0.5  # steps of real jobs last seconds to minutes; half a second attributes them well


class StepScraper:
    def __init__(self, url: str, metrics_path: Path, poll_s: float = POLL_INTERVAL_S):
        self.url = url
        self.metrics_path = metrics_path
        self.poll_s = poll_s
        self.per_step: dict[int, dict[str, float]] = {}
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rltune-vllm-scrape", daemon=True)
        self._last: dict[str, float] | None = None
        self._seen = 0

    def __enter__(self) -> StepScraper:
        self._last = self._scrape()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=vllm.SCRAPE_TIMEOUT_S + 1)
        self._poll()  # a step that ended just before the job did

    def _scrape(self) -> dict[str, float] | None:
        try:
            return vllm.scrape(self.url)
        except LogFormatError:
            self.failures += 1
            return None

    def _new_steps(self) -> list[int]:
        try:
            lines = self.metrics_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        complete = lines if self.metrics_path.read_bytes().endswith(b"\n") else lines[:-1]
        fresh, self._seen = complete[self._seen:], len(complete)
        steps = []
        for line in fresh:
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(step, int):
                steps.append(step)
        return steps

    def _poll(self) -> None:
        steps = self._new_steps()
        if not steps:
            return
        snapshot = self._scrape()
        if snapshot is None:
            return
        if self._last is not None:
            # Several steps finished between two polls share the interval; it goes to the last of them.
            self.per_step[steps[-1]] = vllm.delta(self._last, snapshot)
        self._last = snapshot

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()
