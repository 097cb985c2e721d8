"""What each weight-sync transport is, without importing it (no torch): names, engine families, rules.

Config files name a transport (the reference workload's ``sync.transport``, sync-bench's
``transports``) and are checked before anything heavy loads, so the facts a check needs live here,
in one table, and every other module reads them instead of spelling a transport's name:

- ``families``: the engine families the transport has an engine-side loader for. ``torch``: an
  engine that is a ``torch.nn.Module`` in the loader's process (the reference workload's HF engine,
  :class:`~rltune.sync.toy_engine.ToyEngine`); ``vllm``: a real vLLM engine, reached through vLLM's
  own ``collective_rpc`` (in-process ``LLMEngine`` or ``vllm serve``).
- ``one_optimizer_step_per_version``: the transport publishes the changes of exactly one optimizer
  step per weight version (it diffs inside the step), so a trainer must not take several steps per
  version.
- ``separate_processes``: the engines must be ranks of a process group the publisher forms.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_FAMILIES = ("torch", "vllm")


@dataclass(frozen=True)
class TransportInfo:
    name: str
    summary: str
    families: tuple[str, ...]
    one_optimizer_step_per_version: bool = False
    separate_processes: bool = False


TRANSPORTS: dict[str, TransportInfo] = {t.name: t for t in (
    TransportInfo("filesystem", "a safetensors checkpoint written and read in full every step (vLLM engines: "
                  "vLLM's own reload_weights)", ("torch", "vllm")),
    TransportInfo("inprocess", "a full copy through memory shared with the engines", ("torch",)),
    TransportInfo("sparse_delta", "only the elements each optimizer step changed, between full anchors; engines "
                  "read and decode while serving, patch in place and verify (rltune.sync)", ("torch", "vllm"),
                  one_optimizer_step_per_version=True),
    TransportInfo("nccl", "a torch.distributed broadcast to engine ranks of the trainer's process group",
                  ("torch",), separate_processes=True),
)}
TRANSPORT_NAMES = tuple(TRANSPORTS)
DEFAULT_TRANSPORT = "filesystem"  # what a job that names none gets: the plain baseline every engine takes
ALIASES = {"sparse": "sparse_delta"}  # sync-bench's name for it


class UnknownTransportError(ValueError):
    """A name that is no transport (the message lists the choices)."""


def transport_info(name: str) -> TransportInfo:
    """The table entry of ``name`` (or its alias); raises :class:`UnknownTransportError` naming the choices."""
    canonical = ALIASES.get(name, name)
    if canonical not in TRANSPORTS:
        raise UnknownTransportError(f"unknown transport {name!r}; choose from {', '.join(TRANSPORT_NAMES)}")
    return TRANSPORTS[canonical]


def transports_for(family: str, *, separate_processes: bool = False) -> tuple[str, ...]:
    """The transports with a loader for engine ``family`` (optionally: those needing no process group)."""
    return tuple(t.name for t in TRANSPORTS.values()
                 if family in t.families and (separate_processes or not t.separate_processes))


def describe(names: tuple[str, ...]) -> str:
    """``name: summary; ...`` for a config field's documentation."""
    return "; ".join(f"{n}: {TRANSPORTS[n].summary}" for n in names)


__all__ = ["ALIASES", "DEFAULT_TRANSPORT", "ENGINE_FAMILIES", "TRANSPORTS", "TRANSPORT_NAMES", "TransportInfo", "UnknownTransportError",
           "describe", "transport_info", "transports_for"]
