"""The one weight-sync transport layer: a trainer-side publisher and an engine-side loader.

A transport moves the trainer's weights into engine workers. Its two halves:

- :class:`Publisher` (the trainer's process): ``publish(step)`` after each optimizer step returns a
  :class:`PublishResult` whose ``message`` is everything an engine needs to take that step (a path,
  a step number); ``loader()`` builds the engine half; transports that diff inside the optimizer
  step (``drives_optimizer_step``) replace ``optimizer.step()`` with ``optimizer_step()``.
- :class:`Loader` (each engine worker; picklable, so a publisher can hand it to engine processes):
  ``prefetch(engine, message)`` while the engine serves, ``load(engine, message)`` in the pause,
  in place. ``engine`` is the worker's ``torch.nn.Module``; weights go in through its own
  ``load_weights(iterable of (checkpoint name, tensor))`` when it has one (vLLM's models and
  :class:`~rltune.sync.toy_engine.ToyEngine` do), else by name into its state dict.

One module per transport (``filesystem``, ``inprocess``, ``sparse_delta``, ``nccl``) and one
factory (:mod:`rltune.sync.transports.factory`). The reference workload and ``rltune sync-bench``
both build their transports there; :mod:`rltune.sync.vllm` is the engine half for real vLLM
engines, on the sparse delta transport's files.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from rltune.errors import RltuneError

# NVLink multicast (NVLS) stays off for anything that may use NCCL: it hangs or fails on shared hosts.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TransportError(RltuneError):
    """A weight-sync transport failed or was used out of order."""


class TransportUnavailableError(TransportError):
    """A transport cannot run on this machine (the message says why); sync-bench skips it."""


def set_nccl_safe_env() -> None:
    """Put NCCL_SAFE_ENV into this process's environment (inherited by processes it starts)."""
    os.environ.update(NCCL_SAFE_ENV)


# ---------------------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(devices: tuple[torch.device, ...], out: dict[str, float], key: str) -> Iterator[None]:
    """Time the block into ``out[key]``, synchronising every CUDA device before and after."""
    for d in devices:
        synchronize(d)
    start = time.perf_counter()
    yield
    for d in devices:
        synchronize(d)
    out[key] = time.perf_counter() - start


# ---------------------------------------------------------------------------------------- results


@dataclass
class PublishResult:
    """Trainer side of one broadcast."""

    seconds: float  # trainer-blocking
    bytes: int  # written to files, copied or sent over the wire
    message: dict[str, Any] = field(default_factory=dict)  # what every engine's loader needs for this step
    details: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadResult:
    """What one engine worker's ``load`` did."""

    bytes: float = 0.0  # read or received by this worker
    changes: int | None = None  # elements written in place (sparse), None for full loads
    checksum_verified: bool | None = None  # the transport's own verification; None: it has none
    action: str = "full"  # full, delta, reload (anchor + replay) or none
    details: dict[str, float] = field(default_factory=dict)


@dataclass
class UpdateResult:
    """Engine side of one broadcast, inside the window in which dispatch to the engine is stopped."""

    pause_s: float
    apply_s: float  # apply + verify (sparse) or transfer + load (full transports)
    resume_s: float
    checksum_verified: bool | None = None
    changes: int | None = None
    details: dict[str, float] = field(default_factory=dict)

    @property
    def dispatch_blocking_s(self) -> float:
        return self.pause_s + self.apply_s + self.resume_s


# ---------------------------------------------------------------------------------------- the two halves


def load_into(engine: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Checkpoint tensors into an engine: its own ``load_weights`` when it has one, else by name."""
    if hasattr(engine, "load_weights"):
        engine.load_weights(items)
        return
    state = engine.state_dict()
    with torch.no_grad():
        for name, tensor in items:
            if name not in state:
                raise TransportError(f"checkpoint tensor {name} has no parameter in the engine; the engine serves "
                                     "another model than the trainer publishes")
            state[name].copy_(tensor, non_blocking=True)


class Loader(ABC):
    """Engine side of a transport: one per engine worker, picklable."""

    def prefetch(self, engine: torch.nn.Module, message: dict[str, Any]) -> bool:
        """Work done while the engine keeps serving; False when this transport has none for ``message``."""
        return False

    @abstractmethod
    def load(self, engine: torch.nn.Module, message: dict[str, Any]) -> LoadResult:
        """Take the step ``message`` names into ``engine``'s parameters, in place, in the pause."""

    def close(self) -> None:  # noqa: B027 (most loaders hold nothing to release)
        """Release what the loader holds (shared buffers, open files)."""


class Publisher(ABC):
    """Trainer side of a transport (see the module docstring)."""

    name: str = ""
    drives_optimizer_step = False  # True: the trainer's optimizer step must go through optimizer_step()

    def optimizer_step(self) -> dict[str, float]:
        """Run the trainer's optimizer step (only transports that diff inside it); returns timings."""
        raise TransportError(f"{self.name}: does not drive the optimizer step; call optimizer.step()")

    @abstractmethod
    def publish(self, step: int) -> PublishResult:
        """Broadcast ``step`` (step 0: the weights the engines boot from), trainer side."""

    @abstractmethod
    def loader(self) -> Loader:
        """The engine half, to hand to every engine worker (picklable)."""

    def loaded(self, step: int) -> None:  # noqa: B027 (only transports that keep files use it)
        """Every engine has taken ``step``: what older steps needed may go."""

    def close(self) -> None:  # noqa: B027
        """Release processes and files."""


class EngineGate:
    """Stops and restarts dispatch to an engine worker.

    Pausing waits for the worker's in-flight device work, so no forward pass reads a weight while
    it is rewritten; resuming waits for the update's last kernel before dispatch reopens.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.accepting = True

    def pause(self) -> None:
        self.accepting = False
        synchronize(self.device)

    def resume(self) -> None:
        synchronize(self.device)
        self.accepting = True


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def trainer_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The trainer's checkpoint tensors: views of the live weights, or copies cast to ``dtype``."""
    state = {n: t.detach() for n, t in model.state_dict().items()}
    if dtype is None:
        return state
    return {n: (t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t) for n, t in state.items()}


__all__ = ["NCCL_SAFE_ENV", "EngineGate", "LoadResult", "Loader", "PublishResult", "Publisher", "TransportError",
           "TransportUnavailableError", "UpdateResult", "load_into", "set_nccl_safe_env", "state_bytes", "synchronize",
           "timed", "trainer_state"]
