"""The weight-sync transport layer: one base (:mod:`.base`), one module per transport, one factory.

- :mod:`.filesystem`: full safetensors checkpoint per step.
- :mod:`.inprocess`: full copy through shared tensors (or the trainer's own, in one process).
- :mod:`.sparse_delta`: only the changed elements, between anchors (rltune.sync's sender/receiver).
- :mod:`.nccl`: ``torch.distributed`` broadcast to engine ranks in their own processes.

:func:`make_publisher` builds any of them; a publisher's :meth:`~.base.Publisher.loader` is the
engine half. Real vLLM engines take the sparse delta transport's files through
:mod:`rltune.sync.vllm`.
"""

from rltune.sync.transports.base import (
    NCCL_SAFE_ENV,
    EngineGate,
    Loader,
    LoadResult,
    Publisher,
    PublishResult,
    TransportError,
    TransportUnavailableError,
    UpdateResult,
    load_into,
    set_nccl_safe_env,
    synchronize,
    timed,
    trainer_state,
)
from rltune.sync.transports.factory import ALIASES, TRANSPORT_NAMES, canonical_name, make_publisher

__all__ = ["ALIASES", "NCCL_SAFE_ENV", "TRANSPORT_NAMES", "EngineGate", "LoadResult", "Loader", "PublishResult",
           "Publisher", "TransportError", "TransportUnavailableError", "UpdateResult", "canonical_name", "load_into",
           "make_publisher", "set_nccl_safe_env", "synchronize", "timed", "trainer_state"]
