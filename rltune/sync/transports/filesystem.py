"""``filesystem``: a full safetensors checkpoint per step; each engine reads and loads all of it in the pause.

The trainer writes ``<dir>/step-NNNNNN.safetensors`` (streamed, fsync'd, renamed into place); the
message carries its path. Once every engine has loaded a step, checkpoints beyond the newest
``keep`` are removed. Engine side: :class:`FilesystemLoader` loads a torch module by name (or
through its ``load_weights``); :class:`VllmFilesystemLoader` hands the checkpoint to vLLM's own
``reload_weights`` (load + post-load processing, as at boot), the baseline the sparse path is
measured against.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from rltune.sync.transports.base import (
    Loader,
    LoadResult,
    Publisher,
    PublishResult,
    load_into,
    timed,
    trainer_state,
)


class FilesystemLoader(Loader):
    """Reads the step's checkpoint onto the engine's device and loads every tensor."""

    def load(self, engine: torch.nn.Module, message: dict[str, Any]) -> LoadResult:
        from safetensors.torch import load_file

        device = next(engine.parameters()).device
        state = load_file(message["path"], device=str(device))
        load_into(engine, state.items())
        return LoadResult(bytes=float(os.path.getsize(message["path"])))


class VllmFilesystemLoader(Loader):
    """A vLLM engine reloads the step's checkpoint through its own ``reload_weights``, every worker, in the pause.

    vLLM reads every safetensors file of the directory it is given, so the step's checkpoint is
    linked (a copy on another file system) into a directory of its own beside it for the reload.
    """

    family = "vllm"

    def load(self, engine: Any, message: dict[str, Any]) -> LoadResult:
        path = Path(message["path"])
        directory = path.parent / f".reload-{path.stem}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        try:
            try:
                os.link(path, directory / "model.safetensors")
            except OSError:  # another file system: a copy reads the same bytes
                shutil.copyfile(path, directory / "model.safetensors")
            t0 = time.perf_counter()
            engine.pause()
            t1 = time.perf_counter()
            try:
                engine.collective_rpc("reload_weights", dict(weights_path=str(directory), is_checkpoint_format=True))
            finally:
                t2 = time.perf_counter()
                engine.resume()
            t3 = time.perf_counter()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return LoadResult(bytes=float(path.stat().st_size),
                          details=dict(pause_s=t1 - t0, apply_s=t2 - t1, resume_s=t3 - t2))


class FilesystemPublisher(Publisher):
    """Full checkpoint per step under ``directory``; ``engine_dtype`` casts floating tensors as written."""

    name = "filesystem"

    def __init__(self, model: torch.nn.Module, directory: str | Path, engine_dtype: torch.dtype | None = None,
                 keep: int = 1):
        self.model = model
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engine_dtype = engine_dtype
        self.keep = max(1, keep)
        self.written: list[Path] = []
        self.device = next(model.parameters()).device

    def publish(self, step: int) -> PublishResult:
        from rltune.sync.format import save_safetensors_atomic

        t: dict[str, float] = {}
        with timed((self.device,), t, "write"):
            state = {n: v.contiguous().cpu() for n, v in trainer_state(self.model, self.engine_dtype).items()}
            path = self.dir / f"step-{step:06d}.safetensors"
            save_safetensors_atomic(state, path, {"step": str(step)})
        self.written.append(path)
        size = path.stat().st_size
        return PublishResult(t["write"], size, message=dict(step=step, path=str(path)))

    def loader(self, family: str = "torch") -> Loader:
        self._check_family(family)
        return VllmFilesystemLoader() if family == "vllm" else FilesystemLoader()

    def loaded(self, step: int) -> None:
        while len(self.written) > self.keep:
            self.written.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        for path in self.written:
            path.unlink(missing_ok=True)
        self.written = []
