"""The one weight-sync transport layer: a trainer-side publisher and engine-side loaders.

A transport moves the trainer's weights into engine workers. Its two halves:

- :class:`Publisher` (the trainer's process): ``publish(step)`` after each optimizer step returns a
  :class:`PublishResult` whose ``message`` is everything an engine needs to take that step (a path,
  a step number); ``loader(family)`` builds the engine half; transports that diff inside the
  optimizer step (``drives_optimizer_step``) replace ``optimizer.step()`` with ``optimizer_step()``.
- :class:`Loader` (picklable, so a publisher can hand it to engine processes), one per engine
  family the transport serves (:mod:`.registry`): ``attach(engine)`` once before the engine serves,
  then per step ``prefetch(engine, message)`` as soon as the step is published, while the engine
  keeps serving; once ``ready()`` the engine stops dispatch and calls ``load(engine, message)``,
  which takes the step in place. What ``engine`` is depends on the family: ``torch``, the worker's
  ``torch.nn.Module`` (weights go in through its own ``load_weights(iterable of (checkpoint name,
  tensor))`` when it has one, as vLLM's models and :class:`~rltune.sync.toy_engine.ToyEngine` do,
  else by name into its state dict); ``vllm``, an :class:`~rltune.sync.vllm.receiver.EngineRpc`
  that reaches every worker of one vLLM engine (its ``pause``/``resume`` bracket the update).

One module per transport (``filesystem``, ``inprocess``, ``sparse_delta``, ``nccl``), each with its
publisher and its loaders, and one factory (:mod:`rltune.sync.transports.factory`). The reference
workload and ``rltune sync-bench`` both build their transports there and name none of them.
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
    """What one engine's ``load`` did."""

    bytes: float = 0.0  # read or received by this worker
    changes: int | None = None  # elements written in place (sparse), None for full loads
    checksum_verified: bool | None = None  # the transport's own verification; None: it has none
    action: str = "full"  # full, delta, reload (anchor + replay) or none
    prefetched: bool = False  # the step's reads were done while the engine served (by prefetch)
    details: dict[str, float] = field(default_factory=dict)  # seconds of its phases (read_s, write_s, pause_s, ...)


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
    """Engine side of a transport for one engine family (see the module docstring), picklable."""

    family = "torch"

    def attach(self, engine: Any) -> dict[str, float]:
        """Once, before the engine serves: whatever the loader needs of the engine; returns timings."""
        return {}

    def prefetch(self, engine: Any, message: dict[str, Any]) -> bool:
        """Start the work that can run while the engine keeps serving (it may go on after this returns:
        :meth:`ready` says when it is done); False when this transport has none for ``message``."""
        return False

    def ready(self) -> bool:
        """The prefetch begun last has finished (True when none runs): the engine may pause now."""
        return True

    @abstractmethod
    def load(self, engine: Any, message: dict[str, Any]) -> LoadResult:
        """Take the step ``message`` names into the engine's parameters, in place, in the pause."""

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
    def loader(self, family: str = "torch") -> Loader:
        """The engine half for engines of ``family`` (:data:`~.registry.ENGINE_FAMILIES`), to hand to every
        engine (picklable); raises :class:`TransportUnavailableError` for a family the transport cannot serve."""

    def _check_family(self, family: str) -> None:
        from rltune.sync.transports.registry import ENGINE_FAMILIES, transport_info

        if family not in ENGINE_FAMILIES:
            raise TransportError(f"unknown engine family {family!r}; choose from {', '.join(ENGINE_FAMILIES)}")
        info = transport_info(self.name)
        if family not in info.families:
            raise TransportUnavailableError(f"{self.name} has no loader for {family} engines; transports that do: "
                                            + ", ".join(t for t, i in _registry().items() if family in i.families))

    def loaded(self, step: int) -> None:  # noqa: B027 (only transports that keep files use it)
        """Every engine has taken ``step``: what older steps needed may go."""

    def close(self) -> None:  # noqa: B027
        """Release processes and files."""


def _registry():
    from rltune.sync.transports.registry import TRANSPORTS

    return TRANSPORTS


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
