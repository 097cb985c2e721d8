"""``sparse_delta``: only the elements each optimizer step changed, between periodic full anchors.

Trainer side, :class:`SparseDeltaPublisher`: :class:`~rltune.sync.sender.DeltaPublisher` takes
over the optimizer step (it diffs each chunk as the optimizer writes it) and writes a delta per
step, an anchor every ``interval`` steps (docs/delta-format.md). Engine side, one loader per family:

- :class:`SparseDeltaLoader` (a torch module): a :class:`~rltune.sync.receiver.DeltaReceiver` whose
  index map is recorded from the engine's own loader: a copy the engine makes of itself in another
  dtype (``engine.recording_copy(dtype)``, as :class:`~rltune.sync.toy_engine.ToyEngine` has), or,
  for an engine that loads checkpoint tensors by name (a transformers model), a by-name copy of its
  parameters.
- :class:`VllmSparseDeltaLoader` (a real vLLM engine): the same files through
  :mod:`rltune.sync.vllm` (its worker extension, in every worker).

Both read and decode the step's parts while the engine serves (``prefetch``), then patch in place
and verify every tensor in the pause (``load``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from rltune.sync.transports.base import Loader, LoadResult, Publisher, PublishResult, timed


class ShadowEngine(torch.nn.Module):
    """Parameters named and shaped like an engine's, in another dtype; ``load_weights`` copies by name.

    A checkpoint name the engine holds only as a tie to another parameter (``lm_head.weight`` tied to
    the embedding) is skipped: its values arrive under the name it is tied to.
    """

    def __init__(self, engine: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self._names = {}
        for name, p in engine.named_parameters():
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False))
        self._params = dict(self.named_parameters())
        self._tied = set(engine.state_dict()) - set(self._params)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        from rltune.sync.format import IndexMapError

        for name, tensor in weights:
            if name in self._params:
                self._params[name].copy_(tensor)
            elif name not in self._tied:
                raise IndexMapError(f"checkpoint tensor {name} has no parameter in the engine")


class SparseDeltaLoader(Loader):
    """Engine side, a torch module: prefetch on a thread while serving, then patch in place and verify.

    ``attach`` records the index map and loads the latest step (anchor + replay) before the engine
    serves; a ``load`` before any ``attach`` attaches first. ``prefetch`` reads and decodes the
    step's parts on a thread; ``load`` waits for it and applies in the pause (or, when the step is
    not the next delta, reloads an anchor and replays).
    """

    def __init__(self, root: str | Path, fused: bool | None = None, fused_backend: str = "auto"):
        self.root = Path(root)
        self.fused, self.fused_backend = fused, fused_backend
        self.receiver = None
        self._attached = None  # the report of the load attach made
        self._prefetch: tuple[int, threading.Thread, dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, receiver=None, _prefetch=None, _attached=None)  # engine processes attach their own

    def attach(self, engine: torch.nn.Module) -> dict[str, float]:
        from rltune.sync import format as fmt
        from rltune.sync.indexmap import IndexMap
        from rltune.sync.receiver import DeltaReceiver
        from rltune.sync.store import BroadcastStore

        start = time.perf_counter()
        store = BroadcastStore(self.root)
        steps = store.complete_steps()
        if not steps:
            raise fmt.ChainError(f"{self.root}: no complete step yet; publish step 0 before the engines load")
        manifest = store.manifest(steps[-1])
        spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
        build = getattr(engine, "recording_copy", None) or (lambda dtype: ShadowEngine(engine, dtype))
        imap = IndexMap.record(build, spec, source=str(store.step_dir(steps[-1]) / fmt.MANIFEST_NAME))
        self.receiver = DeltaReceiver(self.root, engine, imap, fused=self.fused, fused_backend=self.fused_backend)
        recorded = time.perf_counter()
        self._attached = self.receiver.load_latest()
        return dict(record_s=recorded - start, attach_s=time.perf_counter() - start)

    def prefetch(self, engine: torch.nn.Module, message: dict[str, Any]) -> bool:
        if self.receiver is None:
            return False  # the first load reads an anchor in full
        self._join()
        result: dict[str, Any] = {}
        step = int(message["step"])

        def run() -> None:
            start = time.perf_counter()
            result["prefetched"] = self.receiver.prefetch(step)
            result["prefetch_s"] = time.perf_counter() - start

        thread = threading.Thread(target=run, name=f"rltune-prefetch-{step}", daemon=True)
        self._prefetch = (step, thread, result)
        thread.start()
        return True

    def ready(self) -> bool:
        return self._prefetch is None or not self._prefetch[1].is_alive()

    def _join(self) -> dict[str, Any]:
        if self._prefetch is None:
            return {}
        step, thread, result = self._prefetch
        thread.join()  # DeltaReceiver.prefetch never raises and reads a bounded amount
        self._prefetch = None
        return dict(result, step=step)

    def load(self, engine: torch.nn.Module, message: dict[str, Any]) -> LoadResult:
        from rltune.sync import format as fmt

        step = int(message["step"])
        if self.receiver is None:
            self.attach(engine)
            report, prefetch = self._attached, {}
        else:
            prefetch = self._join()
            report = self.receiver.apply(step)
        reached = self.receiver.step
        if reached != step:
            raise fmt.ChainError(f"{self.root}: the engine reached broadcast step {reached}, not the step "
                                 f"{step} it was told to load; a newer step was published meanwhile")
        prefetched = bool(prefetch.get("prefetched")) and prefetch.get("step") == step
        details = {f"{k}_s": v for k, v in report.phases.items()}
        if prefetched:
            details["prefetch_s"] = float(prefetch["prefetch_s"])
        return LoadResult(bytes=float(message.get("bytes", 0.0)), changes=report.changes_applied,
                          checksum_verified=True, action=report.action, prefetched=prefetched, details=details)

    def close(self) -> None:
        if self._prefetch is not None:
            self._join()


class VllmSparseDeltaLoader(Loader):
    """Engine side, a real vLLM engine: every worker patches in place through rltune's worker extension.

    The engine must run with ``worker_extension_cls=rltune.sync.vllm.WORKER_EXTENSION``. ``attach``
    builds a :class:`~rltune.sync.vllm.VllmReceiver` on the engine's RPC handle (index map from
    vLLM's own ``load_weights``, the first-update layout check, the latest step); ``prefetch`` starts
    every worker reading and decoding while the engine serves; ``ready`` asks whether they are done
    (at most every :attr:`poll_s`); ``load`` pauses, applies and verifies on every worker, resumes.
    """

    family = "vllm"
    poll_s = 0.02  # served engines answer ready() over HTTP: a few ms each

    def __init__(self, root: str | Path, timeout_s: float = 120.0, verify: str = "running"):
        self.root = Path(root)
        self.timeout_s, self.verify = timeout_s, verify
        self.receiver = None
        self._pending: int | None = None
        self._ready_at = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, receiver=None, _pending=None)

    def attach(self, engine: Any) -> dict[str, float]:
        from rltune.sync.vllm.receiver import VllmReceiver

        start = time.perf_counter()
        self.receiver = VllmReceiver(engine, str(self.root), timeout_s=self.timeout_s, verify=self.verify)
        report, *_ = self.receiver.attach()
        out = dict(attach_s=time.perf_counter() - start, plain_layers=float(report.get("plain_layers", 0)))
        out.update({f"layout_{k}": float(v) for k, v in (report.get("layout") or {}).items()})
        return out

    def prefetch(self, engine: Any, message: dict[str, Any]) -> bool:
        self._pending = int(message["step"])
        self.receiver.prepare(self._pending)
        self._ready_at = 0.0
        return True

    def ready(self) -> bool:
        if self._pending is None:
            return True
        now = time.perf_counter()
        if now - self._ready_at < self.poll_s:
            return False
        self._ready_at = now
        return self.receiver.prepared(self._pending)

    def load(self, engine: Any, message: dict[str, Any]) -> LoadResult:
        from rltune.sync import format as fmt

        step = int(message["step"])
        if self.receiver is None:
            self.attach(engine)
        self._pending = None
        summary = self.receiver.update(step)
        if summary.step != step:
            raise fmt.ChainError(f"{self.root}: the engine reached broadcast step {summary.step}, not {step}")
        phases = [w.get("phases", {}) for w in summary.workers]
        details = dict(pause_s=summary.pause_s, apply_s=summary.apply_s, resume_s=summary.resume_s,
                       read_s=max(p.get("read", 0.0) for p in phases), write_s=max(p.get("write", 0.0) for p in phases))
        prefetch = [w.get("prefetch_s") for w in summary.workers]
        if summary.prefetched and all(p is not None for p in prefetch):
            details["prefetch_s"] = max(prefetch)
        return LoadResult(bytes=float(message.get("bytes", 0.0)), changes=summary.changes, checksum_verified=True,
                          action=summary.action, prefetched=summary.prefetched, details=details)


class SparseDeltaPublisher(Publisher):
    """Trainer side: a DeltaPublisher whose options are a :class:`~rltune.sync.sender.DeltaPublisherConfig`."""

    name = "sparse_delta"
    drives_optimizer_step = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str | Path, config=None,
                 fused: bool | None = None, fused_backend: str = "auto"):
        from rltune.sync.sender import DeltaPublisher, DeltaPublisherConfig

        self.root = Path(root)
        self.publisher = DeltaPublisher(model, optimizer, self.root, config=config or DeltaPublisherConfig())
        self.device = next(model.parameters()).device
        self.fused, self.fused_backend = fused, fused_backend

    def optimizer_step(self) -> dict[str, float]:
        t: dict[str, float] = {}
        with timed((self.device,), t, "step"):
            self.publisher.step()
        return {"optimizer_step_s": t["step"]}

    def publish(self, step: int) -> PublishResult:
        t: dict[str, float] = {}
        with timed((self.device,), t, "publish"):
            manifest = self.publisher.publish(step)
        delta = sum(f["bytes"] for f in manifest["parts"])
        anchor = sum(f["bytes"] for f in manifest["anchors"])
        return PublishResult(t["publish"], delta + anchor,
                             message=dict(step=step, kind=manifest["kind"], bytes=float(delta + anchor)),
                             details=dict(delta_bytes=float(delta), anchor_bytes=float(anchor),
                                          anchor=float(manifest["kind"] == "anchor")))

    def loader(self, family: str = "torch") -> Loader:
        self._check_family(family)
        if family == "vllm":
            return VllmSparseDeltaLoader(self.root)
        return SparseDeltaLoader(self.root, self.fused, self.fused_backend)
