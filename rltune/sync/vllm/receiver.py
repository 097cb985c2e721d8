"""The orchestrator's side: drive every worker of a vLLM engine through one broadcast root.

:class:`VllmReceiver` is what an RL loop calls. It reaches the workers through vLLM's own
``collective_rpc``, either on an ``LLM`` object in this process (:class:`LLMRpc`; the engine core
may run in-process or in its own processes) or over HTTP on a ``vllm serve`` started with
``VLLM_SERVER_DEV_MODE=1`` (:class:`HttpRpc`: ``POST /pause?mode=keep`` -> ``POST /collective_rpc``
-> ``POST /resume``). It does not import vLLM itself.

Example::

    from vllm import LLM
    from rltune.sync.vllm import WORKER_EXTENSION, VllmReceiver

    llm = LLM(model=boot_dir, worker_extension_cls=WORKER_EXTENSION, enforce_eager=True)
    rx = VllmReceiver(llm, root="/shared/broadcast")
    rx.attach()                            # index map, plain weights on CPU, latest anchor + replay
    for step in steps:
        rx.prepare(step)                   # while the engine serves: read + decode this step's parts
        outputs = llm.generate(prompts, sampling)
        summary = rx.update(step)          # pause -> apply + verify -> resume; raises on any failure
    rx.update(step + 1, wait_s=5)          # the trainer is still writing it: wait for its marker
    rx.check_weights()                     # O(weights): both checksums recomputed from the weights held

    rx = VllmReceiver.http("http://127.0.0.1:8000", root="/shared/broadcast")   # the same over HTTP
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

from rltune.errors import RltuneError


class RpcError(RltuneError):
    """The engine could not be reached, or answered something that is not a worker result."""


def error_class(name: str) -> type[RltuneError]:
    """The rltune error class called ``name`` (what a worker reported), or RltuneError."""
    from rltune.sync import casting, kernels
    from rltune.sync import format as fmt
    from rltune.sync.vllm import worker

    for module in (fmt, worker, casting, kernels):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, RltuneError):
            return cls
    return RltuneError


class EngineRpc(Protocol):
    """How the receiver (and the transports' vLLM loaders) reach the workers of one engine.

    ``call``: one of the worker extension's methods, one result dict per worker; ``collective_rpc``:
    one of vLLM's own worker methods with keyword arguments (``reload_weights``); ``pause`` and
    ``resume``: stop and restart dispatch to the engine around an update.
    """

    def call(self, method: str, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]: ...

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class LLMRpc:
    """A ``vllm.LLM`` in this process. ``LLM`` runs one request batch at a time from its caller, so an
    update between ``generate`` calls already holds no batch: pause and resume have nothing to do."""

    def __init__(self, llm):
        self.llm = llm

    def call(self, method: str, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc(method, args=(json.dumps(request),), timeout=timeout_s))

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        return list(self.llm.collective_rpc(method, kwargs=kwargs))

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


class HttpRpc:
    """A ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``: its ``/pause``, ``/collective_rpc`` and ``/resume``.

    ``pause_mode``: what the pause does with requests in flight: ``keep`` freezes them and they go on
    with the new weights after the resume (an asynchronous RL loop's choice), ``wait`` lets them
    finish first, ``abort`` drops them.
    """

    def __init__(self, base_url: str, pause_mode: str = "keep", http_timeout_s: float = 600.0):
        if pause_mode not in ("keep", "wait", "abort"):
            raise RpcError(f"pause_mode must be keep, wait or abort, got {pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.pause_mode = pause_mode
        self.http_timeout_s = http_timeout_s

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.http_timeout_s) as resp:
                text = resp.read().decode() or "null"
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            hint = (" (the server has no such route: start it with VLLM_SERVER_DEV_MODE=1)" if exc.code == 404 else "")
            raise RpcError(f"{self.base_url}{path}: HTTP {exc.code}{hint}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise RpcError(f"{self.base_url}{path}: cannot reach the engine ({exc}); is `vllm serve` running "
                           "there?") from None
        return json.loads(text)

    def call(self, method: str, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        out = self._post("/collective_rpc", dict(method=method, args=[json.dumps(request)], timeout=timeout_s))
        if not isinstance(out, dict) or not isinstance(out.get("results"), list):
            raise RpcError(f"{self.base_url}/collective_rpc answered {str(out)[:200]!r}, not {{'results': [...]}}")
        return out["results"]

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        out = self._post("/collective_rpc", dict(method=method, kwargs=kwargs))
        return list(out["results"]) if isinstance(out, dict) and isinstance(out.get("results"), list) else [out]

    def pause(self) -> None:
        self._post(f"/pause?mode={self.pause_mode}")

    def resume(self) -> None:
        self._post("/resume")


@dataclass
class UpdateSummary:
    """One update of every worker, as the orchestrator saw it."""

    step: int
    action: str  # none, delta or reload (the plan TP rank 0 made; every worker followed it)
    pause_s: float
    apply_s: float  # the update call: apply + verify on every worker, as one round trip
    resume_s: float
    changes: int  # elements written, over all workers
    prefetched: bool  # every worker applied changes it had read and decoded while serving
    workers: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # damaged anchors a reload went past (anchor, error)

    @property
    def dispatch_blocking_s(self) -> float:
        return self.pause_s + self.apply_s + self.resume_s


class VllmReceiver:
    """Sparse delta updates of one vLLM engine (all its workers) from a broadcast root."""

    def __init__(self, engine: Any, root: str, *, timeout_s: float = 120.0, verify: str = "running"):
        """``engine``: a ``vllm.LLM`` or an :class:`EngineRpc`. ``timeout_s`` bounds every collective
        among the workers and every wait for a prefetch. ``verify``: ``running`` (checksums kept current
        in O(changes)) or ``full`` (also recomputed from every parameter after each update)."""
        self.rpc: EngineRpc = engine if hasattr(engine, "call") and hasattr(engine, "pause") else LLMRpc(engine)
        self.root = str(root)
        self.timeout_s = float(timeout_s)
        self.verify = verify
        self.step: int | None = None

    @classmethod
    def http(cls, base_url: str, root: str, *, pause_mode: str = "keep", **kw) -> VllmReceiver:
        """A receiver for ``vllm serve`` at ``base_url`` (started with ``VLLM_SERVER_DEV_MODE=1`` and
        ``--worker-extension-cls rltune.sync.vllm.worker.RltuneWorkerExtension``)."""
        return cls(HttpRpc(base_url, pause_mode), root, **kw)

    def _call(self, method: str, request: dict[str, Any]) -> list[dict[str, Any]]:
        # the RPC's own time-out leaves room for the workers' bounded collectives to report first
        results = self.rpc.call(method, request, self.timeout_s * 2 + 60)
        if not results or not all(isinstance(r, dict) and "ok" in r for r in results):
            raise RpcError(f"{method}: the workers answered {str(results)[:200]!r}; is the engine started with "
                           "worker_extension_cls=rltune.sync.vllm.WORKER_EXTENSION?")
        failed = [(i, r) for i, r in enumerate(results) if not r["ok"]]
        if failed:
            # the worker whose own error it is, not one that only learned that another failed
            i, first = next(((i, r) for i, r in failed if r["error"] != "UpdateFailedError"), failed[0])
            raise error_class(first["error"])(f"engine worker {i}: {first['message']}")
        return results

    def attach(self, load: bool = True) -> list[dict[str, Any]]:
        """Record the index map on every worker, keep plain weights on CPU, load the latest step (with
        ``load=False`` nothing: the first :meth:`update` reloads the anchor below its step and replays)."""
        results = self._call("rltune_attach", dict(root=self.root, timeout_s=self.timeout_s, verify=self.verify,
                                                   load=load))
        self.step = results[0]["step"]
        return results

    def prepare(self, step: int) -> None:
        """Start every worker reading and decoding ``step``'s changes; returns at once."""
        self._call("rltune_prepare", dict(step=int(step)))

    def prepared(self, step: int) -> bool:
        """Every worker has finished reading and decoding ``step`` (the :meth:`prepare` begun for it)."""
        return all(r["done"] and r["step"] == int(step) for r in self._call("rltune_prepared", {}))

    def update(self, step: int, wait_s: float = 0.0) -> UpdateSummary:
        """Pause dispatch, bring every worker to ``step`` and verify it, resume (also after a failure).

        ``wait_s`` (below ``timeout_s``): how long to wait for a step the trainer is still writing before
        :class:`~rltune.sync.format.StepNotReadyError`; the engine keeps its weights either way."""
        t0 = time.perf_counter()
        self.rpc.pause()
        t1 = time.perf_counter()
        try:
            results = self._call("rltune_update", dict(step=int(step), wait_s=float(wait_s)))
        finally:
            t2 = time.perf_counter()
            self.rpc.resume()
        t3 = time.perf_counter()
        self.step = results[0]["step"]
        return UpdateSummary(step=results[0]["step"], action=results[0]["action"], pause_s=t1 - t0, apply_s=t2 - t1,
                             resume_s=t3 - t2, changes=sum(int(r["changes"]) for r in results),
                             prefetched=all(r.get("prefetched") for r in results), workers=results,
                             fallbacks=list(results[0].get("fallbacks") or []))

    def check_weights(self) -> int:
        """Recompute both checksums of every tensor from the weights every worker holds and check them
        against the trainer's (O(weights)): catches a write to the weights outside the receiver. Returns
        the step checked; on a mismatch raises and every worker reloads at its next update."""
        return self._call("rltune_verify", {})[0]["step"]

    def weights(self, tensors: bool = False) -> list[dict[str, Any]]:
        """Per worker: parameter name -> {sha256, shape, dtype[, tensor]}."""
        return [r["weights"] for r in self._call("rltune_weights", dict(tensors=tensors))]


__all__ = ["EngineRpc", "HttpRpc", "LLMRpc", "RpcError", "UpdateSummary", "VllmReceiver", "error_class"]
