"""Keep Python's cyclic garbage collector off the long-lived heap while a job runs its steps.

torch, the model, the engine client and (in an engine process) the inference stack leave millions
of long-lived objects. A full collection walks every one of them: 0.55-0.84 s in the reference
workload's orchestrator on a 2-core CPU, about once in 8 steps, at an allocation count rather than
a step boundary. Mid-rollout it stops every trial thread, so the engine runs its scheduler steps on
a trickle of requests and the rollout takes 0.4-0.6 s longer (docs/BENCHMARKS.md). ``gc.freeze``
moves what exists after start-up into a permanent generation no collection walks; what the steps
allocate is still collected. vLLM freezes its own engine processes the same way after start-up.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen_heap"]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, freeze every surviving object for the block, then give them back to the collector.

    A caller that had frozen objects itself keeps them frozen: ``gc.unfreeze`` cannot tell whose
    they are, so it is called only if nothing was frozen before.
    """
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if frozen_before == 0:
            gc.unfreeze()
