"""``sparse_delta``: only the elements each optimizer step changed, between periodic full anchors.

Trainer side, :class:`SparseDeltaPublisher`: :class:`~rltune.sync.sender.DeltaPublisher` takes
over the optimizer step (it diffs each chunk as the optimizer writes it) and writes a delta per
step, an anchor every ``interval`` steps (docs/delta-format.md). Engine side,
:class:`SparseDeltaLoader`: a :class:`~rltune.sync.receiver.DeltaReceiver` built at the engine's
first load, whose index map is recorded from the engine's own loader: a copy the engine makes of
itself in another dtype (``engine.recording_copy(dtype)``, as
:class:`~rltune.sync.toy_engine.ToyEngine` has), or, for an engine that loads checkpoint tensors
by name (a transformers model), a by-name copy of its parameters. ``prefetch`` reads and decodes
the step's parts while the engine serves; ``load`` patches in place and verifies every tensor.

A real vLLM engine takes the same files through :mod:`rltune.sync.vllm` (its own worker extension).
"""

from __future__ import annotations

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
    """Engine side: prefetch while serving, then patch in place and verify (or reload + replay)."""

    def __init__(self, root: str | Path, fused: bool | None = None, fused_backend: str = "auto"):
        self.root = Path(root)
        self.fused, self.fused_backend = fused, fused_backend
        self.receiver = None

    def _attach(self, engine: torch.nn.Module) -> None:
        from rltune.sync import format as fmt
        from rltune.sync.indexmap import IndexMap
        from rltune.sync.receiver import DeltaReceiver
        from rltune.sync.store import BroadcastStore

        store = BroadcastStore(self.root)
        steps = store.complete_steps()
        if not steps:
            raise fmt.ChainError(f"{self.root}: no complete step yet; publish step 0 before the engines load")
        manifest = store.manifest(steps[-1])
        spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
        build = getattr(engine, "recording_copy", None) or (lambda dtype: ShadowEngine(engine, dtype))
        imap = IndexMap.record(build, spec, source=str(store.step_dir(steps[-1]) / fmt.MANIFEST_NAME))
        self.receiver = DeltaReceiver(self.root, engine, imap, fused=self.fused, fused_backend=self.fused_backend)

    def prefetch(self, engine: torch.nn.Module, message: dict[str, Any]) -> bool:
        if self.receiver is None:
            return False  # the first load reads an anchor in full
        return self.receiver.prefetch(message["step"])

    def load(self, engine: torch.nn.Module, message: dict[str, Any]) -> LoadResult:
        from rltune.sync import format as fmt

        if self.receiver is None:
            self._attach(engine)
            report = self.receiver.load_latest()
        else:
            report = self.receiver.apply(message["step"])
        if report.step != message["step"]:
            raise fmt.ChainError(f"{self.root}: the engine reached broadcast step {report.step}, not the step "
                                 f"{message['step']} it was told to load; a newer step was published meanwhile")
        return LoadResult(bytes=float(message.get("bytes", 0.0)), changes=report.changes_applied,
                          checksum_verified=True, action=report.action)


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

    def loader(self) -> SparseDeltaLoader:
        return SparseDeltaLoader(self.root, self.fused, self.fused_backend)
