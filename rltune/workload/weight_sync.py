"""Weight sync transports: how the trainer's new weights reach the engine processes.

Each transport has a trainer side (a publisher, which writes version ``v`` somewhere) and an engine
side (a picklable loader, handed to every engine at start, which takes version ``v`` into its model
and reports what it read). The orchestrator times publish + every engine's load as ``weight_sync_s``.

- ``filesystem``: a full safetensors checkpoint is written (fsync'd) and each engine reads it and
  loads it with ``load_state_dict``.
- ``inprocess``: a full copy through shared tensors created once at start (shared memory on a CPU,
  CUDA IPC on a GPU); the trainer copies into them, each engine copies out.
- ``sparse_delta``: rltune.sync's sender/receiver (only changed elements, periodic anchors); see
  :mod:`rltune.workload.sparse_delta`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.errors import RltuneError

if TYPE_CHECKING:
    import torch


class WeightSyncError(RltuneError):
    """A weight-sync transport cannot be used or failed."""


def _engine_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(dtype) for name, t in model.state_dict().items()}


class FilesystemLoader:
    def load(self, model, message: dict) -> dict[str, float]:
        from safetensors.torch import load_file

        device = next(model.parameters()).device
        state = load_file(message["path"], device=str(device))
        model.load_state_dict(state, strict=True)
        return {"bytes": float(os.path.getsize(message["path"]))}


class FilesystemPublisher:
    """Full checkpoint per version under ``<run_dir>/weights``; old ones removed after loading."""

    name = "filesystem"

    def __init__(self, run_dir: Path, engine_dtype: torch.dtype, model: torch.nn.Module, keep: int = 1):
        self.dir = Path(run_dir) / "weights"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engine_dtype = engine_dtype
        self.keep = keep
        self.written: list[Path] = []

    def engine_loader(self) -> FilesystemLoader:
        return FilesystemLoader()

    def publish(self, model, version: int) -> tuple[dict, dict[str, float]]:
        from rltune.sync.format import save_safetensors_atomic

        state = {k: v.cpu().contiguous() for k, v in _engine_state(model, self.engine_dtype).items()}
        path = self.dir / f"v{version:06d}.safetensors"
        save_safetensors_atomic(state, path, {"version": str(version)})
        self.written.append(path)
        return {"path": str(path)}, {"bytes": float(path.stat().st_size)}

    def loaded(self, version: int) -> None:
        while len(self.written) > self.keep:
            self.written.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        pass


class SharedLoader:
    def __init__(self, buffers: dict[str, torch.Tensor]):
        self.buffers = buffers

    def load(self, model, message: dict) -> dict[str, float]:
        import torch

        params = model.state_dict()
        with torch.no_grad():
            for name, buf in self.buffers.items():
                params[name].copy_(buf, non_blocking=True)
        return {"bytes": float(sum(b.numel() * b.element_size() for b in self.buffers.values()))}


class InprocessPublisher:
    """Full copy through tensors shared with every engine (shared memory or CUDA IPC)."""

    name = "inprocess"

    def __init__(self, run_dir: Path, engine_dtype: torch.dtype, model: torch.nn.Module, keep: int = 1):
        self.buffers = {name: t.detach().to(engine_dtype).clone().share_memory_()
                        for name, t in model.state_dict().items()}

    def engine_loader(self) -> SharedLoader:
        return SharedLoader(self.buffers)

    def publish(self, model, version: int) -> tuple[dict, dict[str, float]]:
        import torch

        state = model.state_dict()
        with torch.no_grad():
            for name, buf in self.buffers.items():
                buf.copy_(state[name])
        if next(iter(self.buffers.values())).is_cuda:
            torch.cuda.synchronize()
        return {}, {"bytes": float(sum(b.numel() * b.element_size() for b in self.buffers.values()))}

    def loaded(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


def sparse_delta_available() -> bool:
    here = Path(__file__).resolve().parents[1] / "sync"
    return (here / "sender.py").exists() and (here / "receiver.py").exists()


def check_transport(transport: str) -> None:
    """Raise :class:`WeightSyncError` if ``transport`` cannot be used in this checkout."""
    if transport == "sparse_delta" and not sparse_delta_available():
        raise WeightSyncError("sync.transport: sparse_delta needs rltune/sync/sender.py and receiver.py, which "
                              "this checkout does not have; use sync.transport=filesystem or inprocess")
    if transport not in ("filesystem", "inprocess", "sparse_delta"):
        raise WeightSyncError(f"sync.transport: unknown transport {transport!r}; use filesystem, inprocess or sparse_delta")


def make_publisher(transport: str, run_dir: Path, engine_dtype, model, keep: int = 1, *, optimizer=None,
                   preset: str = "tiny", anchor_interval: int = 10) -> Any:
    """The trainer side of ``sync.transport`` (sparse_delta also needs the optimizer it will drive)."""
    if transport == "filesystem":
        return FilesystemPublisher(run_dir, engine_dtype, model, keep)
    if transport == "inprocess":
        return InprocessPublisher(run_dir, engine_dtype, model, keep)
    check_transport(transport)
    if transport == "sparse_delta":
        from rltune.workload.sparse_delta import SparseDeltaPublisher

        return SparseDeltaPublisher(run_dir, engine_dtype, model, optimizer, preset, anchor_interval)
    raise AssertionError(transport)  # check_transport covers every other name


def timed_publish(publisher, model, version: int) -> tuple[dict, dict[str, float]]:
    start = time.perf_counter()
    message, info = publisher.publish(model, version)
    info["publish_s"] = time.perf_counter() - start
    return message, info
