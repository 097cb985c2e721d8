"""One TP group's protocol: TP rank 0 decides, every worker follows, a failure anywhere fails everywhere.

Every engine-side receiver of a TP group runs it: :class:`rltune.sync.receiver.DeltaReceiver` for the
plan of each update, each phase of it and the group-wide checksum sums, and the vLLM worker
extension (:mod:`rltune.sync.vllm.worker`) while it attaches.

- :meth:`TpGroup.decide` ``(fn, what)``: TP rank 0 runs ``fn``; every worker returns its value or
  raises its error. Only rank 0 reads what decides (the store's latest step, a plan's manifests), so
  the workers cannot disagree about it.
- :meth:`TpGroup.phase` ``(fn, what)``: every worker runs ``fn``, then the group reduces one flag. If
  ``fn`` failed on any worker it fails on all: that worker raises its own error, the others
  :class:`~rltune.sync.format.UpdateFailedError` naming ``what``. Every worker issues the same
  collectives whatever happened, so none is left waiting in one the others skipped.
- :meth:`TpGroup.all_reduce`: sums modulo 2**64 (the checksum ring) or maxima of int lists.
- :func:`as_typed`: an rltune error as it is; anything else as
  :class:`~rltune.sync.format.InternalSyncError` naming it, the exception kept as its cause.

A failure is always typed: the worker it happened on raises the error itself (its cause attached);
the others raise a copy rebuilt from its pickle (type and message; a cause does not cross processes).
A collective that fails (gloo's time-out, a peer that went away) raises
:class:`~rltune.sync.format.GroupUnreachableError` on the workers that see it, after ``on_lost``.

The collectives sit behind :class:`Collectives` (two calls): :class:`TorchCollectives` over a
``torch.distributed`` process group (the gloo group with a time-out that a receiver is given, or that
the vLLM worker makes beside vLLM's own groups), :data:`SOLO` for a worker alone.

Example::

    tp = TpGroup(TorchCollectives(gloo_group), on_lost=mark_invalid)
    plan = tp.decide(make_plan, "planning the update", sends="its plan")
    tp.phase(lambda: read_my_rows(plan), "reading step 5's anchor")
    total = tp.all_reduce([my_share])[0]
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Protocol

from rltune.errors import RltuneError
from rltune.sync import format as fmt
from rltune.sync.kernels.reference import MASK64

_LOST = "this worker stays invalid and reloads the latest anchor at its next update"


def as_typed(exc: BaseException, what: str) -> RltuneError:
    """An rltune error as is; anything else as :class:`~rltune.sync.format.InternalSyncError` naming it
    (never a raw exception), with ``exc`` as its cause."""
    if isinstance(exc, RltuneError):
        return exc
    err = fmt.InternalSyncError(f"{what}: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class Collectives(Protocol):
    """The two collectives the protocol needs of a TP group. A call that cannot reach a peer raises
    RuntimeError, as ``torch.distributed`` does."""

    rank: int  # this worker's rank in the group; rank 0 decides

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable), on every worker."""

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every worker's ``values`` (signed 64-bit, the same count on each), in rank order."""


class _Solo:
    """A worker alone: it decides, and its values are the group's."""

    rank = 0

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)]


SOLO: Collectives = _Solo()


class TorchCollectives:
    """:class:`Collectives` over a ``torch.distributed`` process group (gloo: give it a time-out, so a
    worker that died makes the others' collectives fail instead of hang)."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0)

    def broadcast_object(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [t.tolist() for t in every]


class TpGroup:
    """The protocol over one TP group's :class:`Collectives` (see the module docstring).

    ``on_lost``: runs on a worker before it raises GroupUnreachableError (a receiver marks itself
    invalid); ``lost``: what that error tells the user happens next.
    """

    def __init__(self, collectives: Collectives | None = None, *, on_lost: Callable[[], None] | None = None,
                 lost: str = _LOST):
        self.collectives = SOLO if collectives is None else collectives
        self.on_lost = on_lost
        self.lost = lost

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def alone(self) -> bool:
        return self.collectives is SOLO

    def _unreachable(self, problem: str) -> fmt.GroupUnreachableError:
        if self.on_lost is not None:
            self.on_lost()
        return fmt.GroupUnreachableError(f"{problem}; {self.lost}")

    def all_reduce(self, values: list[int], op: str = "sum") -> list[int]:
        """Per position, the sum modulo 2**64 (``op="sum"``) or the maximum (``"max"``) over the group."""
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        if self.alone or not values:
            return [v & MASK64 for v in values] if op == "sum" else list(values)
        signed = [v - (1 << 64) if v >= 1 << 63 else v for v in (x & MASK64 for x in values)]
        try:
            every = self.collectives.all_gather_ints(signed)
        except RuntimeError as exc:  # gloo's time-out or a peer that went away
            raise self._unreachable(f"another worker of this TP group did not answer ({exc})") from None
        columns = list(zip(*every, strict=True))
        # the sum is taken modulo 2^64: exactly the checksum ring (checksum2 lanes are small enough to stay exact)
        return [sum(c) & MASK64 for c in columns] if op == "sum" else [max(c) for c in columns]

    def decide(self, fn: Callable[[], Any], what: str, sends: str = "its answer") -> Any:
        """TP rank 0 runs ``fn``; every worker returns its value, or raises its error (typed with ``what``).
        ``sends``: what rank 0 sends, for the error of a worker that never receives it."""
        out = None
        if self.rank == 0:
            try:
                out = dict(value=fn())
            except Exception as exc:  # every worker raises rank 0's own error (type and message)
                out = dict(error=as_typed(exc, what))
        if self.alone:
            box = out
        else:
            sent = out if self.rank != 0 or "error" not in out else dict(error=_portable(out["error"]))
            try:
                box = self.collectives.broadcast_object(sent)
            except RuntimeError as exc:
                raise self._unreachable(f"TP rank 0 did not send {sends} ({exc})") from None
            if self.rank == 0:
                box = out  # rank 0 raises the error itself, its cause attached
        if "error" in box:
            raise box["error"]
        return box["value"]

    def phase(self, fn: Callable[[], Any], what: str) -> Any:
        """Run local work; if it fails on any worker, every worker raises.

        Any exception counts, not only rltune's own: a worker that left the phase without the flag
        reduction would leave the others waiting in it until the group's time-out. One that is not an
        rltune error comes out as :class:`~rltune.sync.format.InternalSyncError`.
        """
        err: RltuneError | None = None
        result = None
        try:
            result = fn()
        except Exception as exc:  # re-raised below, typed, after every worker has said whether it failed
            err = as_typed(exc, what)
        (failed,) = self.all_reduce([1 if err else 0], op="max")
        if err is not None:
            raise err
        if failed:
            raise fmt.UpdateFailedError(f"{what} failed on another worker of this TP group; every worker fails it "
                                        "the same way (see that worker's error)")
        return result


def _portable(err: RltuneError) -> RltuneError:
    """``err`` as the other workers can rebuild it from its pickle: itself, or (an error type whose
    constructor its pickle cannot call again) an UpdateFailedError with its message."""
    try:
        back = pickle.loads(pickle.dumps(err))
    except Exception:  # any failure to round-trip: the message still reaches every worker
        back = None
    if type(back) is type(err) and str(back) == str(err):
        return err
    return fmt.UpdateFailedError(str(err))


__all__ = ["SOLO", "Collectives", "TorchCollectives", "TpGroup", "as_typed"]
