"""Optimizer integration of delta sync: step in chunks and diff each chunk as it is written.

Just before the optimizer writes a chunk, the parameter still holds the previous broadcast's
weights, so the delta comes from the step itself and no copy of the weights is kept: the hook
copies the chunk's old wire bits into a reused staging buffer, and right after the update the
diff/extract kernel compares them with the new bits and appends the changed (index, new, old)
triples and the chunk's running-checksum change to the sink's buffers, without a host sync
(:class:`rltune.sync.kernels.ChangeSink`). Small parameters are stepped and diffed together: one
multi-tensor update and one diff for up to ``max_elements`` elements, not one per tensor (a 0.5 B
model has ~300 of them). With torch's fused AdamW on a GPU the copy goes too: the sink steps each
update itself, with the arithmetic of torch's fused kernel (bit-identical), and finds the changes
in registers as it writes the new weights; only the changed rows' old and new bits are written
for the gather that follows. On CPU the same runs through the torch references.

API::

    chunked_step(optimizer, hook=None, max_elements=1 << 26) -> None
        One optimizer step in updates of at most ``max_elements`` elements: consecutive whole
        parameters of one dtype together, one of half that or more alone (in chunks of
        ``max_elements`` when larger). Calls ``hook.before(chunks)`` / ``hook.after(chunks)``
        around each update, ``chunks`` a list of ``(param, start, stop)`` (flat element ranges; an
        :class:`Update`, the same object step after step, whose ``cache`` a hook may use), and
        ``hook.begin_step()`` / ``hook.end_step()`` around the step when the hook has them. Each
        update is the optimizer's own update (fused, foreach or per tensor, as its param group
        says) on a subset of the parameters, so the step is bit-identical to ``optimizer.step()`` for
        ``torch.optim.Adam``/``AdamW`` and for optimizers with an elementwise
        ``step_chunk(param, grad, group, start, stop)`` (``SignSGD``).

        A hook with ``step_adamw(chunks, update) -> bool`` is offered each update of a fused AdamW
        (``fused=True``, no amsgrad, decoupled or no weight decay) first, as an :class:`AdamWUpdate`;
        when it returns True it has stepped the update itself (``ChangeSink.adamw_append``: the diff
        inside the update) and ``before``/``after`` are not called for it.

    recorder = DeltaRecorder(model.named_parameters(), max_elements, wire_dtype=torch.bfloat16)
    chunked_step(optimizer, recorder, max_elements)
    changes = recorder.collect()    # {name: TensorChanges(idx_C, new_C, old_C, checksum_change)}

Example::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    rec = DeltaRecorder(model.named_parameters(), 1 << 26)
    loss(model).backward()
    chunked_step(opt, rec, 1 << 26)
    for name, ch in rec.collect().items():
        publish(name, ch.idx_C, ch.new_C, ch.old_C)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from rltune.errors import RltuneError
from rltune.sync.kernels import ChangeSink
from rltune.sync.kernels.reference import MASK64, adamw_beta_powers

DEFAULT_MAX_ELEMENTS = 1 << 26


class ChunkedStepError(RltuneError):
    """The optimizer or its parameters cannot be stepped in chunks."""


Chunk = tuple[torch.Tensor, int, int]  # (parameter, first element, end element) of its flat view


class ChunkHook(Protocol):
    def before(self, chunks: list[Chunk]) -> None: ...

    def after(self, chunks: list[Chunk]) -> None: ...


def _check_contiguous(params: list[torch.Tensor]) -> None:
    if not all(p.is_contiguous() for p in params):
        raise ChunkedStepError("chunked_step needs contiguous parameters; call .contiguous() on them before "
                               "building the optimizer")


def _plan(params: list[torch.Tensor], max_elements: int) -> list[list[tuple[int, int, int]]]:
    """The step's updates, each a list of (index into ``params``, start, stop): consecutive whole
    parameters of one dtype, at most ``max_elements`` elements in all, go together in one update; a
    parameter of at least half that goes alone (so its diff reads it in place instead of from a
    packed copy), in chunks of ``max_elements`` if it is larger."""
    _check_contiguous(params)
    updates: list[list[tuple[int, int, int]]] = []
    group: list[tuple[int, int, int]] = []
    size = 0
    for i, p in enumerate(params):
        n = p.numel()
        alone = 2 * n >= max_elements
        if group and (alone or size + n > max_elements or p.dtype != params[group[0][0]].dtype):
            updates.append(group)
            group, size = [], 0
        if alone:
            updates.extend([(i, a, min(n, a + max_elements))] for a in range(0, n, max_elements))
        elif n:
            group.append((i, 0, n))
            size += n
    if group:
        updates.append(group)
    return updates


@dataclass
class AdamWUpdate:
    """One fused AdamW update for a hook to step itself: the members' flat chunks of the parameters,
    gradients and moments, their step counts and the param group's hyper-parameters (lr, betas,
    weight_decay, eps, maximize)."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]
    hyper: dict

    def advance(self) -> torch.Tensor:
        """Count the step, as torch's fused AdamW does before its kernel, and return the members'
        ``[beta1**step, beta2**step]`` (float32, ``[2, members]``, on the device)."""
        torch._foreach_add_(self.steps, 1)
        beta1, beta2 = self.hyper["betas"]
        steps = self.steps[0].reshape(1) if len(self.steps) == 1 else torch.stack(self.steps)
        return adamw_beta_powers(steps, beta1, beta2)


def _fusable(group: dict) -> bool:
    # the updates torch's fused AdamW kernel computes and the fused step + diff reproduces
    decoupled = group.get("decoupled_weight_decay", False) or group["weight_decay"] == 0
    scalars = not any(isinstance(x, torch.Tensor) for x in (group["lr"], *group["betas"]))
    return bool(group["fused"]) and not group["amsgrad"] and decoupled and scalars


class Update(list):
    """One update's chunks, ``(param, start, stop)`` each, as hooks receive them. While the optimizer
    steps the same parameters, every step passes the same ``Update`` objects, so a hook may keep what
    it derives from the chunks (views, layouts) in ``cache``, keyed by the hook itself (weakly: an
    entry goes with its hook)."""

    def __init__(self, chunks: list[Chunk], index: list[tuple[int, int, int]]):
        super().__init__(chunks)
        self.index = index  # (position in the param group's stepped parameters, start, stop) per chunk
        self.cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> {group: (key, updates)}


def _updates(optimizer, group_index: int, params: list[torch.Tensor], max_elements: int) -> list[Update]:
    _check_contiguous(params)  # every step: a parameter's .data may have been replaced since the plan
    key = (max_elements, tuple(map(id, params)))  # the updates hold the parameters, so their ids stay theirs
    plans = _PLANS.setdefault(optimizer, {})
    if group_index not in plans or plans[group_index][0] != key:
        plans[group_index] = (key, [Update([(params[i], a, b) for i, a, b in u], u)
                                    for u in _plan(params, max_elements)])
    return plans[group_index][1]


@torch.no_grad()
def chunked_step(optimizer: torch.optim.Optimizer, hook: ChunkHook | None = None,
                 max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
    """One optimizer step in updates of at most ``max_elements`` with ``hook`` around each (see module doc)."""
    if max_elements <= 0:
        raise ChunkedStepError(f"max_elements must be positive, got {max_elements}")
    if hook is not None and hasattr(hook, "begin_step"):
        hook.begin_step()
    if hasattr(optimizer, "step_chunk"):
        _step_elementwise(optimizer, hook, max_elements)
    elif isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        _step_adam(optimizer, hook, max_elements)
    else:
        raise ChunkedStepError(f"chunked_step supports Adam/AdamW and optimizers with step_chunk (SignSGD), not "
                               f"{type(optimizer).__name__}")
    if hook is not None and hasattr(hook, "end_step"):
        hook.end_step()


def _step_elementwise(optimizer, hook, max_elements: int) -> None:
    for g, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        for update in _updates(optimizer, g, params, max_elements):
            if hook is not None:
                hook.before(update)
            for p, a, b in update:
                optimizer.step_chunk(p, p.grad, group, a, b)
            if hook is not None:
                hook.after(update)


def _flat(tensor: torch.Tensor, a: int, b: int) -> torch.Tensor:
    # a view of a contiguous parameter or state; a gradient may be copied
    return tensor if b - a == tensor.numel() else tensor.reshape(-1)[a:b]


def _step_adam(optimizer: torch.optim.Adam, hook, max_elements: int) -> None:
    from torch.optim.adam import adam

    for g, group in enumerate(optimizer.param_groups):
        if group["capturable"] or group["differentiable"]:
            raise ChunkedStepError("chunked AdamW needs capturable=False and differentiable=False")
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
        if has_complex:
            raise ChunkedStepError("chunked AdamW does not support complex parameters")
        beta1, beta2 = group["betas"]
        step_adamw = getattr(hook, "step_adamw", None) if _fusable(group) else None
        hyper = {key: group[key] for key in ("lr", "betas", "weight_decay", "eps", "maximize")}
        split: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # parameter in chunks: (count before, after)
        for chunks in _updates(optimizer, g, params, max_elements):
            update = chunks.index
            counts = []
            for i, a, b in update:
                if b - a == params[i].numel():
                    counts.append(steps[i])  # a whole parameter: its own step count advances
                else:  # each chunk advances from the same count; the count moves on after the step
                    before = split[i][0] if i in split else steps[i].clone()
                    split[i] = (before, before.clone())
                    counts.append(split[i][1])
            ps, gs, ms, vs = ([_flat(t[i], a, b) for i, a, b in update] for t in (params, grads, exp_avgs, exp_avg_sqs))
            if step_adamw is not None and step_adamw(chunks, AdamWUpdate(ps, gs, ms, vs, counts, hyper)):
                continue
            if hook is not None:
                hook.before(chunks)
            adam(ps, gs, ms, vs, [_flat(max_sqs[i], a, b) for i, a, b in update] if group["amsgrad"] else [], counts,
                 amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
                 grad_scale=None, found_inf=None, decoupled_weight_decay=group.get("decoupled_weight_decay", False))
            if hook is not None:
                hook.after(chunks)
        for i, (_, after) in split.items():
            steps[i].copy_(after)


@dataclass
class TensorChanges:
    """One tensor's changes in a step: absolute flat indices (ascending), new and old wire bits, checksum change."""

    idx_C: torch.Tensor  # int64
    new_C: torch.Tensor  # int32, unsigned wire bits
    old_C: torch.Tensor  # int32, unsigned wire bits
    checksum_change: int  # sum (idx + 1) * (u_new - u_old) mod 2**64


class DeltaRecorder:
    """A :class:`ChunkHook` that records every changed element of a step, chunk by chunk.

    ``wire_dtype`` casts floating parameters as sent (fp32 master weights published as bf16); the
    old bits of an update live in the sink's staging buffer, one per wire dtype. ``capacity_fraction`` sizes the
    pinned change buffers as a fraction of all elements (a step that changes more raises
    :class:`~rltune.sync.kernels.ChangeCapacityError` at :meth:`collect`). ``backend``: as in
    :mod:`rltune.sync.kernels` ("auto": Triton on CUDA, torch reference on CPU). ``outputs``: where
    the changes go ("host": pinned memory, "device": the GPU's). ``fuse_adamw``: whether a fused
    AdamW's updates are stepped by the sink with the diff inside (``ChangeSink``; "auto": on CUDA).
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], max_elements: int = DEFAULT_MAX_ELEMENTS,
                 wire_dtype: torch.dtype | None = None, capacity_fraction: float = 0.25, backend: str = "auto",
                 outputs: str = "host", fuse_adamw: str | bool = "auto"):
        self.params = dict(named_params)
        if not self.params:
            raise ChunkedStepError("DeltaRecorder needs at least one parameter")
        if not 0 < capacity_fraction <= 1:
            raise ChunkedStepError(f"capacity_fraction must be in (0, 1], got {capacity_fraction}")
        self.wire_dtype, self.max_elements = wire_dtype, max_elements
        self._name_of = {id(p): n for n, p in self.params.items()}
        first = next(iter(self.params.values()))
        self.device = first.device
        total = sum(p.numel() for p in self.params.values())
        chunks = sum(-(-p.numel() // max_elements) for p in self.params.values())
        largest = min(max_elements, max(p.numel() for p in self.params.values()))
        self.sink = ChangeSink(max(1, int(total * capacity_fraction)), largest, max(1, chunks), self.device, backend,
                               outputs, fuse_adamw)

    def _dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and p.is_floating_point() else p.dtype

    def begin_step(self) -> None:
        self.sink.reset()

    def before(self, chunks: list[Chunk]) -> None:
        group = self.sink.group([b - a for _, a, b in chunks], [a for _, a, _ in chunks])
        self.sink.stage(group, [p.detach().view(-1)[a:b] for p, a, b in chunks], self._dtype(chunks[0][0]))

    def _names(self, chunks: list[Chunk]) -> list[str]:
        names = [self._name_of.get(id(p)) for p, _, _ in chunks]
        if None in names:
            raise ChunkedStepError("the optimizer steps a parameter the DeltaRecorder was not given; pass the "
                                   "same named_parameters() the optimizer holds")
        return names

    def after(self, chunks: list[Chunk]) -> None:
        group = self.sink.group([b - a for _, a, b in chunks], [a for _, a, _ in chunks])
        self.sink.append_staged(group, [p.detach().view(-1)[a:b] for p, a, b in chunks], self._dtype(chunks[0][0]),
                                self._names(chunks))

    def step_adamw(self, chunks: list[Chunk], update: AdamWUpdate) -> bool:
        group = self.sink.group([b - a for _, a, b in chunks], [a for _, a, _ in chunks])
        return self.sink.adamw_append(group, update, self._dtype(chunks[0][0]), self._names(chunks))

    def end_step(self) -> None:
        self.sink.finish()

    def collect(self) -> dict[str, TensorChanges]:
        """Wait for the step's kernels; per tensor, its changes.

        A tensor stepped in one chunk gets views into the sink's reused buffers (valid until the next
        step); one of several chunks gets a concatenated copy.
        """
        per_name: dict[str, list] = {}
        for chunk in self.sink.collect():
            per_name.setdefault(chunk.key, []).append(chunk)
        out = {}
        for name, chunks in per_name.items():
            total = 0
            for c in chunks:
                total += c.checksum_change
            if len(chunks) == 1:  # views into the sink's buffers: no host copy of the step's changes
                out[name] = TensorChanges(chunks[0].idx_C, chunks[0].new_C, chunks[0].old_C, total & MASK64)
            else:
                out[name] = TensorChanges(torch.cat([c.idx_C for c in chunks]), torch.cat([c.new_C for c in chunks]),
                                          torch.cat([c.old_C for c in chunks]), total & MASK64)
        return out


__all__ = ["AdamWUpdate", "ChunkHook", "ChunkedStepError", "DeltaRecorder", "TensorChanges", "Update", "chunked_step"]
