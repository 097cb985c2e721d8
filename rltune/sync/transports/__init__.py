"""The weight-sync transport layer: one base (:mod:`.base`), one module per transport, one factory.

- :mod:`.filesystem`: full safetensors checkpoint per step.
- :mod:`.inprocess`: full copy through shared tensors (or the trainer's own, in one process).
- :mod:`.sparse_delta`: only the changed elements, between anchors (rltune.sync's sender/receiver).
- :mod:`.nccl`: ``torch.distributed`` broadcast to engine ranks in their own processes.

Each transport module holds both halves: its trainer-side :class:`~.base.Publisher` and its
engine-side :class:`~.base.Loader` for each engine family it serves (``torch`` modules, and real
``vllm`` engines reached through vLLM's ``collective_rpc``). :func:`make_publisher` builds any
publisher; ``publisher.loader(family)`` is the engine half. :mod:`.registry` says what each
transport is without importing it (no torch), for config checks.

Importing this package imports neither torch nor a transport; its names load on first use.
"""

from __future__ import annotations

from typing import Any

from rltune.sync.transports.registry import (
    ALIASES,
    ENGINE_FAMILIES,
    TRANSPORT_NAMES,
    TRANSPORTS,
    transport_info,
)

_BASE = ("NCCL_SAFE_ENV", "EngineGate", "Loader", "LoadResult", "Publisher", "PublishResult", "TransportError",
         "TransportUnavailableError", "UpdateResult", "load_into", "set_nccl_safe_env", "synchronize", "timed",
         "trainer_state")
_FACTORY = ("canonical_name", "make_publisher")


def __getattr__(name: str) -> Any:
    if name in _BASE:
        from rltune.sync.transports import base

        return getattr(base, name)
    if name in _FACTORY:
        from rltune.sync.transports import factory

        return getattr(factory, name)
    raise AttributeError(f"module 'rltune.sync.transports' has no attribute {name!r}")


__all__ = ["ALIASES", "ENGINE_FAMILIES", "TRANSPORTS", "TRANSPORT_NAMES", *_BASE, *_FACTORY, "transport_info"]
