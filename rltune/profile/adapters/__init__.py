"""Log adapters, one module per format; each exposes NAME, ``claims(text) -> int`` and ``parse(sources, report)``.

``claims`` counts the lines (or documents) of a text that are evidence of its format; the
auto-detector picks the one adapter with evidence and refuses a log with evidence of two
(mixed formats). ``parse`` reads ``[(file name, text), ...]`` into a
:class:`~rltune.profile.adapters._text.ParsedLog` of the source's own metric names per step.
"""

from __future__ import annotations

from types import ModuleType

from rltune.profile.adapters import (
    areal,
    ms_swift,
    nemo_rl,
    openrlhf,
    prime_rl,
    rltune_jsonl,
    skyrl,
    slime,
    trl,
    verl,
    vllm,
)

ADAPTERS: dict[str, ModuleType] = {
    module.NAME: module
    for module in (rltune_jsonl, verl, prime_rl, slime, openrlhf, trl, nemo_rl, skyrl, ms_swift, areal, vllm)
}

__all__ = ["ADAPTERS"]
