"""One factory for every transport: what the reference workload and ``rltune sync-bench`` call.

Example::

    pub = make_publisher("sparse_delta", model=model, optimizer=opt, workdir=run_dir,
                         delta=DeltaPublisherConfig(interval=10))
    loader = pub.loader()                      # handed to each engine worker
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rltune.sync.transports.base import Publisher, TransportError
from rltune.sync.transports.registry import ALIASES, TRANSPORT_NAMES, UnknownTransportError, transport_info


def canonical_name(name: str) -> str:
    """``name`` as the layer spells it (``sparse`` -> ``sparse_delta``); raises for an unknown one."""
    try:
        return transport_info(name).name
    except UnknownTransportError as exc:
        raise TransportError(str(exc)) from None


def make_publisher(name: str, *, model: torch.nn.Module, workdir: str | Path, optimizer: torch.optim.Optimizer | None = None,
                   engine_dtype: torch.dtype | None = None, keep: int = 1, shared: bool = True, delta: Any = None,
                   fused: bool | None = None, fused_backend: str = "auto",
                   build_engine: Callable[..., torch.nn.Module] | None = None, engines: int = 1,
                   timeout_s: float = 300.0) -> Publisher:
    """The trainer side of transport ``name``; each transport takes the arguments it needs.

    - filesystem: ``engine_dtype`` (cast as written), ``keep`` (checkpoints kept on disk), files under
      ``workdir/filesystem``.
    - inprocess: ``engine_dtype``, ``shared`` (buffers shared with engine processes, or direct reads of
      the trainer's tensors by an engine in this process).
    - sparse_delta: ``optimizer`` (it drives the step), ``delta`` (a DeltaPublisherConfig), ``fused`` /
      ``fused_backend`` (the engines' apply), files under ``workdir/broadcast``.
    - nccl: ``build_engine(dtype=...)`` (picklable), ``engines`` (ranks), ``timeout_s``.
    """
    name = canonical_name(name)
    workdir = Path(workdir)
    if name == "filesystem":
        from rltune.sync.transports.filesystem import FilesystemPublisher

        return FilesystemPublisher(model, workdir / "filesystem", engine_dtype, keep)
    if name == "inprocess":
        from rltune.sync.transports.inprocess import InprocessPublisher

        return InprocessPublisher(model, engine_dtype, shared)
    if name == "sparse_delta":
        from rltune.sync.transports.sparse_delta import SparseDeltaPublisher

        if optimizer is None:
            raise TransportError("sparse_delta: the publisher drives the optimizer step; pass optimizer=")
        return SparseDeltaPublisher(model, optimizer, workdir / "broadcast", delta, fused, fused_backend)
    from rltune.sync.transports.nccl import NcclPublisher

    if build_engine is None:
        raise TransportError("nccl: engine ranks build their own engine; pass build_engine=")
    return NcclPublisher(model, build_engine, engines, timeout_s)


__all__ = ["ALIASES", "TRANSPORT_NAMES", "canonical_name", "make_publisher"]
