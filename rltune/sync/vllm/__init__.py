"""Sparse delta sync inside a real vLLM engine.

Two halves, one per process:

- :mod:`rltune.sync.vllm.worker`: the worker extension vLLM mixes into each of its workers
  (``worker_extension_cls=WORKER_EXTENSION``): index map from the engine's own ``load_weights``,
  plain weights on CPU, prefetch thread, in-place apply and verification, TP-group plan.
- :mod:`rltune.sync.vllm.receiver`: :class:`VllmReceiver`, what an RL loop calls (``attach``,
  ``prepare(step)`` while the engine serves, ``update(step)`` in the pause), through
  ``LLM.collective_rpc`` or the OpenAI-compatible server's ``/collective_rpc``.

Importing this package does not import vLLM or torch.
"""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = "rltune.sync.vllm.worker.RltuneWorkerExtension"

# What a CPU engine on a small machine needs besides a KV cache size (kv_cache_memory_bytes=..., or
# VLLM_CPU_KVCACHE_SPACE in whole GiB, which overrides it): vLLM's default utilisation is refused
# where NUMA node 0 reports little memory.
CPU_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",  # keep the workers' traffic on loopback
}


def _shield_llvmlite() -> None:
    """Keep vLLM's CPU kernel rebinding from tripping over numba's llvmlite library object.

    When a vLLM worker starts it scans every attribute of every loaded module and reads
    ``vars(value)`` of each. llvmlite's ``ffi.lib`` answers any unknown attribute through
    ``__getattr__``, ``__dict__`` included, with a wrapped C function, so the scan fails
    (``'_lib_fn_wrapper' object has no attribute 'get'``) in any process that imported numba (the
    delta codec does) before it built an ``LLM``. Giving ``lib`` an empty ``__dict__`` entry in its
    function table makes the scan see nothing there; llvmlite never looks that name up itself.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_shield_llvmlite()


def __getattr__(name: str) -> Any:
    if name in ("VllmReceiver", "UpdateSummary", "HttpRpc", "LLMRpc", "EngineRpc", "RpcError"):
        from rltune.sync.vllm import receiver

        return getattr(receiver, name)
    raise AttributeError(f"module 'rltune.sync.vllm' has no attribute {name!r}")


__all__ = ["CPU_ENV", "WORKER_EXTENSION", "EngineRpc", "HttpRpc", "LLMRpc", "RpcError", "UpdateSummary",
           "VllmReceiver"]
