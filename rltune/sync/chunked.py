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
    deltas = recorder.collect_deltas()   # or, as a delta carries them: [ChunkDelta(name, idx_C, diff_C,
                                         #   checksum_change, checksum2_change)], chunk by chunk

    DeltaRecorder(..., ranges={name: (start, stop)})   # record only these flat elements (a rank's rows)
    DeltaRecorder(..., sink=False)   # no ChangeSink: the torch reference diffs each chunk into tensors
                                     # of its own (no capacity bound); collect_deltas() only

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from rltune.errors import RltuneError
from rltune.sync.kernels import ChangeSink, PackedGroup, checksum2_span_changes, diff_extract
from rltune.sync.kernels.reference import MASK64, adamw_beta_powers
from rltune.sync.ops import NONFINITE_BITS, count_nonfinite, wire_bits, wire_diff, wire_width

DEFAULT_MAX_ELEMENTS = 1 << 26


class ChunkedStepError(RltuneError):
    """The optimizer or its parameters cannot be stepped in chunks."""


Chunk = tuple[torch.Tensor, int, int]  # (parameter, first element, end element) of its flat view


class ChunkHook(Protocol):
    def before(self, chunks: list[Chunk]) -> None: ...

    def after(self, chunks: list[Chunk]) -> None: ...


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor a rank holds of ``t``: a DTensor's local shard (FSDP2's sharded parameters, their
    gradients and optimizer states), any other tensor itself. In-place writes to it are writes to
    the DTensor; reading it runs no collective."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


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


def optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """One optimizer, or several stepping disjoint parameters (Muon with an AdamW beside it), as a list."""
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


@torch.no_grad()
def chunked_step(optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], hook: ChunkHook | None = None,
                 max_elements: int = DEFAULT_MAX_ELEMENTS) -> None:
    """One optimizer step in updates of at most ``max_elements`` with ``hook`` around each (see module doc)."""
    if max_elements <= 0:
        raise ChunkedStepError(f"max_elements must be positive, got {max_elements}")
    if hook is not None and hasattr(hook, "begin_step"):
        hook.begin_step()
    for opt in optimizers(optimizer):
        if hasattr(opt, "step_chunk"):
            _step_elementwise(opt, hook, max_elements)
        elif type(opt) is torch.optim.Muon:
            _step_muon(opt, hook)
        elif isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam
            _step_adam(opt, hook, max_elements)
        else:
            raise ChunkedStepError(f"chunked_step supports Adam/AdamW, torch.optim.Muon and optimizers "
                                   f"with step_chunk (SignSGD), not {type(opt).__name__}")
    if hook is not None and hasattr(hook, "end_step"):
        hook.end_step()


def _step_elementwise(optimizer, hook, max_elements: int) -> None:
    for g, group in enumerate(optimizer.param_groups):
        stepped = [p for p in group["params"] if p.grad is not None]
        grad_of = {id(local_tensor(p)): local_tensor(p.grad) for p in stepped}
        for update in _updates(optimizer, g, [local_tensor(p) for p in stepped], max_elements):
            if hook is not None:
                hook.before(update)
            for p, a, b in update:
                optimizer.step_chunk(p, grad_of[id(p)], group, a, b)
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
        # DTensor (FSDP2) parameters step as their local shards: the update is elementwise, so stepping
        # the shard is the DTensor step, with no collective
        params, grads, exp_avgs, exp_avg_sqs, max_sqs = ([local_tensor(t) for t in ts]
                                                         for ts in (params, grads, exp_avgs, exp_avg_sqs, max_sqs))
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


def _step_muon(optimizer, hook) -> None:
    """torch.optim.Muon, one matrix an update, in the optimizer's own order: the same updates on every
    rank, since a DTensor (FSDP2) matrix's Newton-Schulz iteration runs collectives over the whole
    matrix (every rank steps every matrix, also one whose local shard is empty). The hook sees each
    matrix's local shard around the write of the new weights."""
    from torch.optim._muon import _single_tensor_muon

    for g, group in enumerate(optimizer.param_groups):
        params, grads, bufs = [], [], []
        optimizer._init_group(group, params, grads, bufs)
        plans = _PLANS.setdefault(optimizer, {})
        key = ("muon", tuple(map(id, params)))
        if group.get("foreach"):
            raise ChunkedStepError("torch.optim.Muon has no foreach step; leave foreach unset")
        if g not in plans or plans[g][0] != key:
            plans[g] = (key, [Update([(local_tensor(p), 0, local_tensor(p).numel())], [(i, 0, local_tensor(p).numel())])
                              for i, p in enumerate(params)])
        for p, grad, buf, update in zip(params, grads, bufs, plans[g][1], strict=True):
            _check_contiguous([update[0][0]])
            if hook is not None:
                hook.before(update)
            _single_tensor_muon([p], [grad], [buf], lr=group["lr"], weight_decay=group["weight_decay"],
                                momentum=group["momentum"], nesterov=group["nesterov"],
                                ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"],
                                eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"], has_complex=False)
            if hook is not None:
                hook.after(update)


@dataclass
class TensorChanges:
    """One tensor's changes in a step: absolute flat indices (ascending), new and old wire bits, checksum change."""

    idx_C: torch.Tensor  # int64
    new_C: torch.Tensor  # int32, unsigned wire bits
    old_C: torch.Tensor  # int32, unsigned wire bits
    checksum_change: int  # sum (idx + 1) * (u_new - u_old) mod 2**64


@dataclass
class ChunkDelta:
    """One recorded chunk's changes as a delta carries them (:meth:`DeltaRecorder.collect_deltas`)."""

    name: str
    idx_C: torch.Tensor  # int64, absolute flat indices of the tensor, ascending
    diff_C: torch.Tensor  # int64, signed wrapped wire-bit differences (u_new - u_old), as ops.wire_diff
    checksum_change: int  # sum (idx + 1) * (u_new - u_old) mod 2**64
    checksum2_change: int  # the packed checksum2 change (kernels.reference.checksum2_update_ref)


class NonFiniteChangesError(ChunkedStepError):
    """The step wrote NaN or infinite values (a NaN loss or gradient): its changes are not a delta to send."""


class UnknownParameterError(ChunkedStepError):
    """The optimizer steps a parameter the recorder was not given."""


class _Prepared(NamedTuple):
    """What the recorder derives from an update's chunks, kept in the update's cache while they keep their storage."""

    names: list[str]  # the chunks that hold recorded elements, clamped to their tensor's range
    offsets: list[int]  # each clamped chunk's first element in its tensor
    sources: list[torch.Tensor]  # the clamped chunks' flat views
    dtype: torch.dtype  # their wire dtype
    group: PackedGroup | None  # the sink's packed group (None without a sink)
    whole: bool  # no chunk was clamped: the update is all recorded elements


class DeltaRecorder:
    """A :class:`ChunkHook` that records every changed element of a step, chunk by chunk.

    ``wire_dtype`` casts floating parameters as sent (fp32 master weights published as bf16); the
    old bits of an update live in the sink's staging buffer, one per wire dtype. ``capacity_fraction``
    sizes the pinned change buffers as a fraction of all recorded elements (a step that changes more
    raises :class:`~rltune.sync.kernels.ChangeCapacityError` at :meth:`collect` and
    :meth:`collect_deltas`). ``backend``: as in :mod:`rltune.sync.kernels` ("auto": Triton on CUDA,
    torch reference on CPU). ``outputs``: where the changes go ("host": pinned memory, "device": the
    GPU's). ``fuse_adamw``: whether a fused AdamW's updates are stepped by the sink with the diff
    inside (``ChangeSink``; "auto": on CUDA).

    ``ranges``: ``{name: (start, stop)}``, the flat elements of each tensor to record (a trainer rank's
    rows); the chunks are clamped to them, an update holding none is not looked at, and only an update
    that holds nothing else is stepped by the sink. None: every element.

    ``origins``: ``{name: first element}``, where the stepped tensor's element 0 lies in the whole
    tensor (an FSDP2 rank's local shard of a DTensor parameter); recorded indices and checksums are
    of the whole tensor. None: 0 for every tensor.

    ``sink=False``: no :class:`~rltune.sync.kernels.ChangeSink`. Each chunk's old wire bits are copied
    before its update and diffed by the torch reference right after it, into tensors of their own on
    the parameters' device: no capacity bound, two host syncs per chunk. :meth:`collect_deltas` then
    returns those tensors; :meth:`collect` needs the sink.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], max_elements: int = DEFAULT_MAX_ELEMENTS,
                 wire_dtype: torch.dtype | None = None, capacity_fraction: float = 0.25, backend: str = "auto",
                 outputs: str = "host", fuse_adamw: str | bool = "auto", *,
                 ranges: Mapping[str, tuple[int, int]] | None = None, sink: bool = True,
                 origins: Mapping[str, int] | None = None):
        self.params = dict(named_params)
        self.origins = {n: int((origins or {}).get(n, 0)) for n in self.params}
        if not self.params:
            raise ChunkedStepError("DeltaRecorder needs at least one parameter")
        if not 0 < capacity_fraction <= 1:
            raise ChunkedStepError(f"capacity_fraction must be in (0, 1], got {capacity_fraction}")
        self.wire_dtype, self.max_elements = wire_dtype, max_elements
        self._name_of = {id(p): n for n, p in self.params.items()}
        self.ranges = {n: (0, p.numel()) for n, p in self.params.items()} if ranges is None else \
            {n: self._range(n, ranges) for n in self.params}
        spans = [(n, lo, hi) for n, (lo, hi) in self.ranges.items() if hi > lo]
        self.device = self.params[spans[0][0] if spans else next(iter(self.params))].device
        self.sink: ChangeSink | None = None
        if sink and spans:
            total = sum(hi - lo for _, lo, hi in spans)
            # a chunk clamped to its tensor's range: at most one per chunk of the whole tensor
            chunks = sum(-(-self.params[n].numel() // max_elements) for n, _, _ in spans)
            largest = min(max_elements, max(hi - lo for _, lo, hi in spans))
            self.sink = ChangeSink(max(1, int(total * capacity_fraction)), largest, max(1, chunks), self.device,
                                   backend, outputs, fuse_adamw)
        self._old: list[torch.Tensor] = []  # without a sink: the update's old wire bits, per chunk
        self._deltas: list[ChunkDelta] = []  # without a sink: the step's changes, chunk by chunk
        self._nonfinite: list[tuple[str, torch.Tensor]] = []  # without a sink: each chunk's non-finite new values

    def _range(self, name: str, ranges: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
        if name not in ranges:
            raise ChunkedStepError(f"DeltaRecorder ranges: no range for {name}; give one per parameter")
        lo, hi = (int(x) for x in ranges[name])
        if not 0 <= lo <= hi <= self.params[name].numel():
            raise ChunkedStepError(f"DeltaRecorder ranges: {name}: [{lo}, {hi}) is not inside its "
                                   f"{self.params[name].numel()} elements")
        return lo, hi

    def _dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and p.is_floating_point() else p.dtype

    def _names(self, chunks: list[Chunk]) -> list[str]:
        names = [self._name_of.get(id(p)) for p, _, _ in chunks]
        if None in names:
            raise UnknownParameterError("the optimizer steps a parameter the DeltaRecorder was not given; pass the "
                                        "same named_parameters() the optimizer holds")
        return names

    def _prepared(self, chunks: list[Chunk]) -> _Prepared | None:
        """An update's :class:`_Prepared`, or None when it holds no recorded element; kept in the
        update's cache (:class:`Update`) while its parameters keep their storage."""
        cache = getattr(chunks, "cache", None)
        ptrs = tuple(p.data_ptr() for p, _, _ in chunks)
        hit = cache.get(self) if cache is not None else None
        if hit is None or hit[0] != ptrs:
            mine = []
            for name, (p, a, b) in zip(self._names(chunks), chunks, strict=True):
                lo, hi = self.ranges[name]
                if max(a, lo) < min(b, hi):
                    mine.append((name, p, max(a, lo), min(b, hi)))
            prepared = None
            if mine:
                offsets = [a + self.origins[n] for n, _, a, _ in mine]  # positions in the whole tensor
                group = None if self.sink is None else self.sink.group([b - a for _, _, a, b in mine], offsets)
                prepared = _Prepared([n for n, _, _, _ in mine], offsets,
                                     [p.detach().view(-1)[a:b] for _, p, a, b in mine], self._dtype(mine[0][1]),
                                     group, [(a, b) for _, _, a, b in mine] == [(a, b) for _, a, b in chunks])
            hit = (ptrs, prepared)
            if cache is not None:
                cache[self] = hit
        return hit[1]

    def begin_step(self) -> None:
        if self.sink is not None:
            self.sink.reset()
        self._old, self._deltas, self._nonfinite = [], [], []

    def before(self, chunks: list[Chunk]) -> None:
        prepared = self._prepared(chunks)
        if prepared is None:
            return
        if self.sink is None:
            self._old = [wire_bits(t, prepared.dtype).clone() for t in prepared.sources]
            return
        self.sink.stage(prepared.group, prepared.sources, prepared.dtype)

    def after(self, chunks: list[Chunk]) -> None:
        prepared = self._prepared(chunks)
        if prepared is None:
            return
        if self.sink is not None:  # no host sync: the kernels queue behind the update
            self.sink.append_staged(prepared.group, prepared.sources, prepared.dtype, prepared.names)
            return
        for name, a, source, old in zip(prepared.names, prepared.offsets, prepared.sources, self._old, strict=True):
            new = wire_bits(source, prepared.dtype)
            # absolute indices and unsigned bits (compiled on a CPU), made once for the delta and both checksums
            idx, new_changed, old_changed, change = diff_extract(old, new, a, backend="torch")
            if idx.numel():
                self._nonfinite.append((name, count_nonfinite(new_changed, prepared.dtype)))
                (mix,) = checksum2_span_changes(idx, old_changed, new_changed, [(0, idx.numel())])
                self._deltas.append(ChunkDelta(name, idx, wire_diff(old_changed, new_changed, wire_width(new)),
                                               change, mix))
        self._old = []

    def step_adamw(self, chunks: list[Chunk], update: AdamWUpdate) -> bool:
        # a fused AdamW update that holds only recorded elements: the sink steps it with the diff inside
        prepared = self._prepared(chunks)
        if prepared is None or self.sink is None or not prepared.whole:
            return False  # part of a chunk is not recorded: staged and diffed after the update
        return self.sink.adamw_append(prepared.group, update, prepared.dtype, prepared.names)

    def end_step(self) -> None:
        if self.sink is not None:
            self.sink.finish()

    def collect(self) -> dict[str, TensorChanges]:
        """Wait for the step's kernels; per tensor, its changes.

        A tensor stepped in one chunk gets views into the sink's reused buffers (valid until the next
        step); one of several chunks gets a concatenated copy.
        """
        if self.sink is None:
            raise ChunkedStepError("collect() reads the change sink; a DeltaRecorder made with sink=False (or with "
                                   "no recorded element) gives the step's changes through collect_deltas()")
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

    def collect_deltas(self) -> list[ChunkDelta]:
        """The step's changes as a delta carries them: one :class:`ChunkDelta` per recorded chunk that
        changed, in the order the step wrote them, in tensors of their own (they stay valid after the
        next step).

        With the sink: one host sync for the step's kernels, then one signed difference and one index
        copy for the whole step (per wire width) and the checksum2 changes from the same changes in one
        pass, sliced per chunk; raises :class:`~rltune.sync.kernels.ChangeCapacityError` when the step
        changed more than the sink holds. Without: what :meth:`after` found, chunk by chunk.

        Raises :class:`NonFiniteChangesError` when a new value is NaN or infinite (one more host sync).
        """
        if self.sink is None:
            self._raise_nonfinite(self._nonfinite)
            return self._deltas
        spans = self.sink.collect_spans()
        idx_all, new_all, old_all = self.sink.step_changes()
        changed = [(name, a, b, change) for name, a, b, change in spans if b > a]
        self._check_finite(changed, new_all)
        idx_all = idx_all.clone()  # the sink's buffers are reused by the next step
        diffs: dict[int, torch.Tensor] = {}
        mixes = checksum2_span_changes(idx_all, old_all, new_all, [(a, b) for _, a, b, _ in changed])
        out = []
        for (name, a, b, change), mix in zip(changed, mixes, strict=True):
            bits = self._dtype(self.params[name]).itemsize * 8
            if bits not in diffs:
                diffs[bits] = wire_diff(old_all, new_all, bits)
            out.append(ChunkDelta(name, idx_all[a:b], diffs[bits][a:b], change, mix))
        return out

    def _check_finite(self, changed: list[tuple[str, int, int, int]], new_all: torch.Tensor) -> None:
        # One pass over the step's new values (the changed chunks follow one another in the sink), each
        # read with its chunk's wire-dtype mask; one host sync. Per chunk counts only when one is found.
        if not changed:
            return
        masks = [NONFINITE_BITS.get(self._dtype(self.params[name]), 0) for name, _, _, _ in changed]
        first, last = changed[0][1], changed[-1][2]
        values = new_all[first:last]
        if len(set(masks)) == 1:
            mask = masks[0]  # one wire dtype: a scalar mask
            if mask == 0:
                return
        else:
            lengths = torch.tensor([b - a for _, a, b, _ in changed])
            mask = torch.repeat_interleave(torch.tensor(masks, dtype=new_all.dtype), lengths).to(new_all.device)
        flags = ((values & mask) == mask) & (mask != 0)
        if not bool(flags.any()):
            return
        ends = torch.tensor([b - first for _, _, b, _ in changed], device=flags.device)
        totals = torch.nn.functional.pad(flags.cumsum(0), (1, 0))[ends]
        counts = totals - torch.nn.functional.pad(totals[:-1], (1, 0))
        self._raise_nonfinite([(name, c) for (name, _, _, _), c in zip(changed, counts, strict=True)])

    @staticmethod
    def _raise_nonfinite(counts: list[tuple[str, torch.Tensor]]) -> None:
        if not counts:
            return
        values = torch.stack([c for _, c in counts]).tolist()
        per_name: dict[str, int] = {}
        for (name, _), value in zip(counts, values, strict=True):
            if value:
                per_name[name] = per_name.get(name, 0) + value
        if per_name:
            first = ", ".join(f"{name} {n}" for name, n in list(per_name.items())[:3])
            raise NonFiniteChangesError(f"the step wrote {sum(per_name.values())} NaN or infinite values in "
                                        f"{len(per_name)} tensors ({first}{', ...' if len(per_name) > 3 else ''})")


__all__ = ["AdamWUpdate", "ChunkDelta", "ChunkHook", "ChunkedStepError", "DeltaRecorder", "NonFiniteChangesError",
           "TensorChanges", "UnknownParameterError", "Update", "chunked_step", "local_tensor", "optimizers"]
