"""``inprocess``: a full copy of every tensor, device to device, with no file in between.

Two ways the engine reaches the trainer's tensors:

- ``shared=True`` (engines in their own processes, the reference workload): buffers created once
  and shared with every engine (shared memory on a CPU, CUDA IPC on a GPU); publishing copies the
  trainer's tensors into them, each engine copies out of them in the pause.
- ``shared=False`` (engine in the trainer's process, sync-bench): the engine copies straight from
  the trainer's live tensors in the pause, and publishing costs nothing but finishing the step.
"""

from __future__ import annotations

from typing import Any

import torch

from rltune.sync.transports.base import (
    Loader,
    LoadResult,
    Publisher,
    PublishResult,
    load_into,
    state_bytes,
    timed,
    trainer_state,
)


class InprocessLoader(Loader):
    """Copies ``source`` (shared buffers or the trainer's own tensors) into the engine."""

    def __init__(self, source: dict[str, torch.Tensor]):
        self.source = source

    def load(self, engine: torch.nn.Module, message: dict[str, Any]) -> LoadResult:
        load_into(engine, self.source.items())
        return LoadResult(bytes=float(state_bytes(self.source)))

    def close(self) -> None:
        self.source = {}  # an engine releases tensors shared by the trainer (CUDA IPC) before it ends


class InprocessPublisher(Publisher):
    """Full in-process copy; ``engine_dtype`` casts floating tensors (shared buffers only)."""

    name = "inprocess"

    def __init__(self, model: torch.nn.Module, engine_dtype: torch.dtype | None = None, shared: bool = True):
        self.model = model
        self.shared = shared
        self.device = next(model.parameters()).device
        self.buffers = ({n: t.clone().share_memory_() for n, t in trainer_state(model, engine_dtype).items()}
                        if shared else None)

    def publish(self, step: int) -> PublishResult:
        t: dict[str, float] = {}
        with timed((self.device,), t, "publish"):
            state = trainer_state(self.model)
            if self.buffers is not None:
                with torch.no_grad():
                    for name, buf in self.buffers.items():
                        buf.copy_(state[name])
        return PublishResult(t["publish"], state_bytes(self.buffers or state), message=dict(step=step))

    def loader(self, family: str = "torch") -> InprocessLoader:
        self._check_family(family)
        return InprocessLoader(self.buffers if self.buffers is not None else trainer_state(self.model))
