"""Element kernels of weight sync: diff/extract, apply, checksum (Triton) and their torch references.

Public functions choose the Triton kernel for CUDA tensors and the torch reference
(:mod:`rltune.sync.kernels.reference`) for CPU tensors. ``backend="triton"`` forces the kernel, which
on a CPU tensor needs ``TRITON_INTERPRET=1`` (set before triton is first imported): that is how CI
compares every kernel with its reference bit for bit. ``backend="torch"`` forces the reference.

API::

    checksum(t, offset=0) -> int                     # sum (offset+i+1) * u[i] mod 2**64
    checksum2(t, offset=0) -> int                    # hash-weighted, two lanes mod 2**31 - 1 (packed)
    checksums(tensors) -> list[int]                  # one host sync for a whole parameter set
    diff_extract(old_bits, new_bits, offset=0) -> (idx_C, new_C, old_C, checksum_change)
    sink = ChangeSink(capacity, max_chunk_elements, max_chunks, device)   # reused step after step
    sink.append(old_bits, new_bits, offset, key)     # no host sync; changes land in pinned memory
    g = sink.group(sizes, offsets); sink.stage(g, chunks, dtype)     # small tensors: packed, one diff
    ...update...; sink.append_staged(g, chunks, dtype, keys)
    sink.finish(); chunks = sink.collect()           # collect() waits for the step's last kernel
    idx, new, old = sink.step_changes()              # all chunks' changes, in append order
    plan = ApplyPlan(params, layouts)                # device tables + compile, once per index map
    result = plan.apply(entry_tensor_E, entry_offsets_E1, idx_C, val_C, add=True)
    patch = plan.stage(...same args...); result = plan.store(patch)   # CPU (numba): read while serving, store in the pause
    apply_mapped_delta(target_bits, pos_C, diff_C, ckpt_idx_C) -> int   # receiver's apply_fn

Layouts (one dict per checkpoint tensor, see :func:`strided_layout`, :func:`table_layout` and
:func:`layouts_from_index_map`) say where element ``(r, c)`` of a checkpoint tensor lives in this
worker's parameters: ``base + r * row_stride + c * col_stride`` inside a held window, or
``base + rows[r] + cols[c]`` with offset tables (layouts that shuffle rows or swizzle block scales).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rltune.errors import RltuneError
from rltune.sync import format as fmt
from rltune.sync.kernels.reference import (
    BITS_MASK,
    BITS_WIDTH,
    MASK64,
    P31,
    apply_deltas_ref,
    as_bits,
    bits_dtype,
    checksum2_contributions_ref,
    checksum2_pack,
    checksum2_ref,
    checksum_ref,
    diff_extract_ref,
    unsigned,
)

# each bits view's mask and width, passed to the Triton kernels as their MASK / WIDTH constexprs
_MASK_OF_BITS = BITS_MASK
_WIDTH_OF_BITS = BITS_WIDTH
# (parameter dtype, wire dtype) pairs the fused AdamW + diff kernel steps: a parameter on its own
# 16- or 32-bit wire, or float32 parameters sent as bfloat16
_ADAMW_WIRES = {(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                (torch.float32, torch.float32)}
_DIFF_MAX_ELEMENTS = (1 << 31) - 1


class KernelError(RltuneError):
    """A sync kernel was called with arguments it cannot handle."""


class KernelBackendError(KernelError):
    """The requested backend cannot run here."""


class ChangeCapacityError(KernelError):
    """A step changed more elements than the change sink holds."""


class LayoutError(KernelError):
    """An index map cannot be expressed as strides or row/column offset tables."""


def _use_triton(device: torch.device, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda"
    if backend == "triton":
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
            return True
        raise KernelBackendError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 in the environment "
                                 "before triton is imported; use backend='auto' for the torch reference")
    raise KernelBackendError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in _MASK_OF_BITS:
        return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return as_bits(t.detach().contiguous())


def _triton():
    from rltune.sync.kernels import triton_kernels

    return triton_kernels


# ------------------------------------------------------------------------------------------ checksum


def _checksum_device(t: torch.Tensor, offset: int) -> torch.Tensor:
    bits = _bits(t)
    return _triton().checksum_partials(bits, offset, _MASK_OF_BITS[bits.dtype]).sum()


def _cpu_kernels():
    """The compiled CPU passes (:mod:`.cpu_kernels`), or None where numba is missing (then the torch
    references run). Looked up in ``sys.modules`` on every call, so a test can take them away."""
    try:
        return importlib.import_module("rltune.sync.kernels.cpu_kernels")
    except ImportError:
        return None


def _compiled_cpu(name: str, t: torch.Tensor, offset: int) -> int | None:
    """A checksum of CPU bits by the compiled pass of :mod:`.cpu_kernels` (equal to the reference bit
    for bit, ~100 x faster), or None where it does not apply (another device, no numba)."""
    bits = _bits(t)
    cpu_kernels = _cpu_kernels() if bits.device.type == "cpu" and bits.dtype in _MASK_OF_BITS else None
    return None if cpu_kernels is None else getattr(cpu_kernels, name)(bits.contiguous(), offset)


def checksum(t: torch.Tensor, offset: int = 0, backend: str = "auto") -> int:
    """Position-weighted checksum of a tensor's wire bits (or of a bits view), as ``checksum_ref``."""
    if not _use_triton(t.device, backend):
        compiled = _compiled_cpu("checksum_cpu", t, offset)
        return checksum_ref(_bits(t), offset) if compiled is None else compiled
    return int(_checksum_device(t, offset)) & MASK64


def checksum2(t: torch.Tensor, offset: int = 0, backend: str = "auto") -> int:
    """Packed second checksum of a tensor's wire bits (or of a bits view), as ``checksum2_ref``."""
    if not _use_triton(t.device, backend):
        compiled = _compiled_cpu("checksum2_cpu", t, offset)
        return checksum2_ref(_bits(t), offset) if compiled is None else compiled
    bits = _bits(t)
    lanes = _triton().checksum2_partials(bits, offset, _MASK_OF_BITS[bits.dtype]).sum(dim=1).tolist()
    return checksum2_pack(int(lanes[0]) % P31, int(lanes[1]) % P31)


def checksum2_span_changes(idx_C: torch.Tensor, old_C: torch.Tensor, new_C: torch.Tensor,
                           spans: list[tuple[int, int]]) -> list[int]:
    """The packed checksum2 change of each span ``[a, b)`` of a step's changes (indices, old and new bits:
    wire bits int16 / int32 / uint8, or a sink's unsigned bits as int32), as ``checksum2_update_ref`` of
    each span: compiled on CPU tensors, the torch reference's per-change lanes summed by running sums
    elsewhere."""
    if not spans:
        return []
    cpu_kernels = (_cpu_kernels() if idx_C.device.type == "cpu" and old_C.dtype == new_C.dtype
                   and old_C.dtype in _MASK_OF_BITS else None)
    if cpu_kernels is not None:
        if old_C.dtype != torch.int32:  # the kernel reads int32 (its low 32 bits): widen as unsigned
            old_C, new_C = unsigned(old_C).to(torch.int32), unsigned(new_C).to(torch.int32)
        return cpu_kernels.checksum2_span_changes_cpu(idx_C.to(torch.int64).contiguous(), old_C.contiguous(),
                                                      new_C.contiguous(), spans)
    # running sums of the per-change lanes (each < 2**32: exact in int64), differenced at the span bounds
    # on the tensors' device: one transfer of two values a span
    cum = torch.nn.functional.pad(torch.stack(checksum2_contributions_ref(idx_C, old_C, new_C)).cumsum(1), (1, 0))
    starts = torch.tensor([a for a, _ in spans], dtype=torch.int64)
    ends = torch.maximum(starts, torch.tensor([b for _, b in spans], dtype=torch.int64))  # an empty span sums to 0
    lanes = (cum[:, ends.to(cum.device)] - cum[:, starts.to(cum.device)]).remainder(P31).tolist()
    return [checksum2_pack(la, lb) for la, lb in zip(lanes[0], lanes[1], strict=True)]


def checksum_pair(t: torch.Tensor, offset: int = 0, backend: str = "auto") -> tuple[int, int]:
    """(checksum, checksum2) of a tensor's wire bits: what a holder of elements ``[offset, offset + N)``
    publishes or verifies as its share."""
    return checksum_pairs([t], [offset], backend)[0]


def checksum_pairs(tensors: list[torch.Tensor], offsets: list[int], backend: str = "auto",
                   wire_dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
    """:func:`checksum_pair` of each tensor (its elements start at the matching offset), of its wire bits
    as sent in ``wire_dtype``: floating tensors of another dtype cast to it, as
    :func:`~rltune.sync.ops.wire_bits` does (None: each in its own dtype). CPU bits go through one
    compiled pass each, split over two threads (``cpu_kernels.checksum_pairs_cpu``); float32 tensors
    sent as bfloat16 are rounded inside that pass, with no cast copy of them."""
    def wire(t: torch.Tensor) -> torch.Tensor:
        cast = wire_dtype is not None and t.is_floating_point() and t.dtype != wire_dtype
        return _bits(t.detach().to(wire_dtype) if cast else t)

    on_cpu = all(t.device.type == "cpu" for t in tensors)
    cpu_kernels = _cpu_kernels() if on_cpu and not (tensors and _use_triton(tensors[0].device, backend)) else None
    # float32 sent as bfloat16 is rounded inside the compiled pass: no cast copy is made of it
    fused = [cpu_kernels is not None and wire_dtype == torch.bfloat16 and t.dtype == torch.float32 for t in tensors]
    sources = [t.detach().contiguous() if f else wire(t) for t, f in zip(tensors, fused, strict=True)]
    if cpu_kernels is not None and all(f or b.dtype in _MASK_OF_BITS for b, f in zip(sources, fused, strict=True)):
        return cpu_kernels.checksum_pairs_cpu([s.contiguous() for s in sources], list(offsets), bf16_of_f32=fused)
    bits = [wire(t) if f else b for t, b, f in zip(tensors, sources, fused, strict=True)]
    return [(checksum(b, o, backend), checksum2(b, o, backend)) for b, o in zip(bits, offsets, strict=True)]


def checksums(tensors: list[torch.Tensor], backend: str = "auto") -> list[int]:
    """Checksums of a parameter set with a single host sync."""
    if not tensors:
        return []
    if not _use_triton(tensors[0].device, backend):
        return [checksum_ref(_bits(t)) for t in tensors]
    sums = torch.stack([_checksum_device(t, 0) for t in tensors])
    return [int(v) & MASK64 for v in sums.tolist()]


# ------------------------------------------------------------------------------------- diff/extract


def _check_pair(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor) -> None:
    if old_bits_N.dtype != new_bits_N.dtype or old_bits_N.numel() != new_bits_N.numel():
        raise KernelError(f"diff needs two bits tensors of one dtype and size, got {old_bits_N.dtype}[{old_bits_N.numel()}]"
                          f" and {new_bits_N.dtype}[{new_bits_N.numel()}]")
    if old_bits_N.dtype not in _MASK_OF_BITS:
        raise KernelError(f"diff works on wire bits (int16/int32/uint8 views, see as_bits), got {old_bits_N.dtype}")
    if old_bits_N.numel() > _DIFF_MAX_ELEMENTS:
        raise KernelError(f"diff chunk of {old_bits_N.numel()} elements exceeds 2^31 - 1; step in chunks "
                          "(chunked_step max_elements)")


class PackedGroup:
    """Where the members of a packed group sit in a staging buffer, as the diff reads them.

    Member m (``sizes[m]`` elements, element ``offsets[m]`` of its tensor first) starts at
    ``starts[m]``, a multiple of ``block`` (the diff kernel's block; 1 for the torch reference), so
    no diff block holds two members; the elements between members are padding the diff never reads.
    On a GPU the diff reads three small tables (each block's member, each member's packed end and
    ``offsets[m] - starts[m]``), made at the first use and kept with the group, which the sink
    reuses step after step.
    """

    def __init__(self, sizes: list[int], offsets: list[int], block: int):
        if not sizes or min(sizes) < 1 or len(offsets) != len(sizes):
            raise KernelError(f"a packed group needs one positive size and one offset per member, got sizes {sizes} "
                              f"and offsets {offsets}")
        self.sizes, self.offsets, self.block = list(sizes), list(offsets), block
        self.starts, at = [], 0
        for size in self.sizes:
            self.starts.append(at)
            at += -(-size // block) * block
        self.padded = at  # staging elements the group needs
        self.n = self.starts[-1] + self.sizes[-1]  # the diff's extent: up to the last member's last element
        self._tables: tuple[torch.Tensor, ...] | None = None
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block's member int32, member's packed end int64, member's index offset int64) on ``device``."""
        if self._tables is None:
            blocks = np.repeat(np.arange(len(self.sizes), dtype=np.int32), [-(-z // self.block) for z in self.sizes])
            ends = np.array(self.starts, dtype=np.int64) + np.array(self.sizes, dtype=np.int64)
            shift = np.array(self.offsets, dtype=np.int64) - np.array(self.starts, dtype=np.int64)
            self._tables = tuple(torch.from_numpy(a).to(device) for a in (blocks, ends, shift))
        return self._tables

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each member's slice of a staging buffer of at least :attr:`padded` elements (made once per
        buffer and dtype: the sink asks for them every step)."""
        key = (buffer.data_ptr(), buffer.dtype, buffer.numel())
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [buffer[a:a + z] for a, z in zip(self.starts, self.sizes, strict=True)]
        return views


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    # many members: one multi-tensor copy; one (a large parameter alone): the plain copy, which
    # streams a large tensor faster than the multi-tensor kernel
    if len(targets) == 1:
        targets[0].copy_(sources[0].reshape(-1))
    else:
        torch._foreach_copy_(targets, [t if t.dim() == 1 else t.reshape(-1) for t in sources])


@dataclass
class ChunkChanges:
    """The changes one ``ChangeSink.append`` recorded (views into the sink's host buffers)."""

    key: Any
    idx_C: torch.Tensor  # int64, absolute element indices of the tensor, ascending
    new_C: torch.Tensor  # int32 unsigned wire bits
    old_C: torch.Tensor  # int32 unsigned wire bits
    checksum_change: int


class ChangeSink:
    """Host buffers that diff/extract appends changes to, chunk after chunk, without a host sync.

    On CUDA the buffers are pinned and the gather kernel writes into them directly; where each
    chunk starts and its checksum change stay on the device until :meth:`finish` copies them
    (asynchronously) and :meth:`collect` waits for that copy. ``outputs="device"`` keeps the
    changes in device memory instead, for a consumer on the same device (the GPU encoder): only
    the chunk starts and checksum changes cross to the host. On CPU it runs the torch reference.
    ``capacity`` bounds the changes of one step: more raise :class:`ChangeCapacityError` at collect.
    """

    def __init__(self, capacity: int, max_chunk_elements: int, max_chunks: int,
                 device: torch.device | str = "cpu", backend: str = "auto", outputs: str = "host",
                 fuse_adamw: str | bool = "auto"):
        if capacity < 1 or max_chunk_elements < 1 or max_chunks < 1:
            raise KernelError(f"ChangeSink needs positive sizes, got capacity={capacity}, "
                              f"max_chunk_elements={max_chunk_elements}, max_chunks={max_chunks}")
        if max_chunk_elements > _DIFF_MAX_ELEMENTS:
            raise KernelError(f"max_chunk_elements {max_chunk_elements} exceeds 2^31 - 1")
        self.device = torch.device(device)
        self.capacity, self.max_chunk_elements, self.max_chunks = capacity, max_chunk_elements, max_chunks
        if outputs not in ("host", "device"):
            raise KernelError(f"ChangeSink outputs must be 'host' or 'device', got {outputs!r}")
        self.triton = _use_triton(self.device, backend)
        pin = self.device.type == "cuda"
        where = dict(device=self.device) if outputs == "device" else dict(pin_memory=pin)
        self.idx = torch.empty(capacity, dtype=torch.int64, **where)
        self.new = torch.empty(capacity, dtype=torch.int32, **where)
        self.old = torch.empty(capacity, dtype=torch.int32, **where)
        self._start_dev = torch.zeros(max_chunks + 1, dtype=torch.int64, device=self.device)
        self._checksum_dev = torch.zeros(max_chunks, dtype=torch.int64, device=self.device)
        self._start_host = torch.zeros(max_chunks + 1, dtype=torch.int64, pin_memory=pin)
        self._checksum_host = torch.zeros(max_chunks, dtype=torch.int64, pin_memory=pin)
        self._scratch = None  # the diff's device scratch (triton_kernels.DiffScratch), made at the first append
        self._groups: dict[tuple, PackedGroup] = {}
        self._staging: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # bits dtype -> (old, new)
        # fuse_adamw: whether adamw_append may step fused AdamW updates itself (diff pass 1 inside the
        # update). "auto": on CUDA, where it reproduces torch's fused kernel bit for bit; True also
        # under the interpreter (tests), whose arithmetic is the same but whose torch AdamW is not.
        if fuse_adamw not in ("auto", True, False):
            raise KernelError(f"ChangeSink fuse_adamw must be 'auto', True or False, got {fuse_adamw!r}")
        self.fuse_adamw = self.triton and (fuse_adamw is True or (fuse_adamw == "auto" and self.device.type == "cuda"))
        # (id(group), first parameter's address, wire dtype) -> (pointers, plan or None[, host rows])
        self._adamw_plans: dict[tuple, tuple] = {}
        self._event = None
        self._total = 0  # changes of the last collected step
        self.keys: list[Any] = []

    def reset(self) -> None:
        """Start a new step (buffers are reused)."""
        self.keys = []
        self._event = None
        if self.triton:
            self._checksum_dev.zero_()  # the diff adds each chunk's checksum change into its slot
            if self._scratch is not None:
                self._scratch.reset()  # and each block's count into its chunk's tile counters
        else:
            self._start_host.zero_()

    def _diff_scratch(self, n: int = 0):
        if self._scratch is None or self._scratch.count_P.numel() * _triton().diff_block() < n:
            self._scratch = _triton().DiffScratch(max(n, self.max_chunk_elements), self.device, self.max_chunks)
        return self._scratch

    # ------------------------------------------------------------------------ packed groups

    def group(self, sizes: list[int], offsets: list[int]) -> PackedGroup:
        """The packed layout of chunks of these sizes (each element ``offsets[m]`` of its tensor first),
        made once and reused: several small tensors are diffed by one launch instead of one each."""
        key = (tuple(sizes), tuple(offsets))
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = PackedGroup(list(sizes), list(offsets),
                                                    _triton().diff_block() if self.triton else 1)
        return group

    def _buffers(self, dtype: torch.dtype, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        bits = dtype if dtype in _MASK_OF_BITS else bits_dtype(dtype)
        pair = self._staging.get(bits)
        if pair is None or pair[0].numel() < elements:
            size = max(elements, self.max_chunk_elements)
            pair = self._staging[bits] = (torch.empty(size, dtype=bits, device=self.device),
                                          torch.empty(size, dtype=bits, device=self.device))
        return pair

    def stage(self, group: PackedGroup, sources: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Copy the members' values before the update (``sources``: one chunk per member, cast to the
        wire ``dtype``) into the old staging buffer, in one (multi-tensor) copy."""
        old, _ = self._buffers(dtype, group.padded)
        _copy_all(group.views(old.view(dtype)), sources)

    def append_staged(self, group: PackedGroup, sources: list[torch.Tensor], dtype: torch.dtype,
                      keys: list[Any]) -> None:
        """Record the changes of the members since :meth:`stage` (``sources``: the same chunks after the
        update); member m becomes the chunk of ``keys[m]``. No host sync; on a GPU, one diff for the
        whole group (a lone member in its wire dtype is diffed in place, without staging its new values)."""
        if len(keys) != len(group.sizes) or len(sources) != len(keys):
            raise KernelError(f"a group of {len(group.sizes)} members needs as many sources and keys, got "
                              f"{len(sources)} and {len(keys)}")
        old, new = self._buffers(dtype, group.padded)
        olds = group.views(old)
        if len(keys) == 1 and sources[0].dtype == dtype:
            self.append(olds[0], as_bits(sources[0].detach().reshape(-1)), group.offsets[0], keys[0])
            return
        _copy_all(group.views(new.view(dtype)), sources)
        if not self.triton:
            for o, n, offset, key in zip(olds, group.views(new), group.offsets, keys, strict=True):
                self.append(o, n, offset, key)
            return
        k = len(self.keys)
        if k + len(keys) > self.max_chunks:
            raise KernelError(f"more than max_chunks={self.max_chunks} chunks in one step; count in max_chunks "
                              "every chunk of the step")
        self.keys.extend(keys)
        _triton().diff_extract_launch(old, new, 0, _MASK_OF_BITS[old.dtype], self._diff_scratch(group.padded),
                                      self._start_dev, k, (self.idx, self.new, self.old), self.capacity,
                                      self._checksum_dev, group=group)

    def adamw_append(self, group: PackedGroup, update, dtype: torch.dtype, keys: list[Any]) -> bool:
        """Step a fused AdamW update (``update``: a :class:`rltune.sync.chunked.AdamWUpdate` whose members
        are the group's) and record its changes, with pass 1 of the diff inside the update: the old
        values are never staged before it and never read again after it, only the changed rows'.
        Returns False, having done nothing, where it cannot (then stage, step and append as usual):
        the sink does not fuse, a tensor is not contiguous on the sink's device, or the dtypes are not
        a parameter's own 16-bit wire or float32 parameters on a bfloat16 or float32 wire."""
        if not self.fuse_adamw:
            return False
        lists = (update.params, update.grads, update.exp_avgs, update.exp_avg_sqs)
        plan = self._adamw_plan(group, lists, dtype)
        if plan is None:
            return False
        table, align, wire, in_place = plan
        k = len(self.keys)
        if k + len(keys) > self.max_chunks:
            raise KernelError(f"more than max_chunks={self.max_chunks} chunks in one step; count in max_chunks "
                              "every chunk of the step")
        powers = update.advance()
        old, new = self._buffers(dtype, group.padded)
        new = as_bits(lists[0][0]) if in_place else new
        scratch = self._diff_scratch(group.padded)
        self.keys.extend(keys)
        tk = _triton()
        tk.adamw_diff_launch(tuple(lst[0] for lst in lists), table, powers, align, update.hyper,
                             (old, None if in_place else new), scratch, self._start_dev, k, group, wire)
        tk.diff_expand_launch(old, new, 0, _MASK_OF_BITS[old.dtype], scratch, self._start_dev, k,
                              (self.idx, self.new, self.old), self.capacity, self._checksum_dev, group=group)
        return True

    def _adamw_plan(self, group: PackedGroup, lists, dtype: torch.dtype) -> tuple | None:
        # (member table, alignment, wire bits, new bits read in place) of an update, or None when it
        # cannot be fused; kept while its tensors stay where they are (a tensor's dtype and size go
        # with its storage), remade when one moves (a gradient freed and allocated again)
        ptrs = tuple(t.data_ptr() for lst in lists for t in lst)
        key = (id(group), ptrs[0], dtype)  # updates of equal sizes share a group, not a first parameter
        hit = self._adamw_plans.get(key)
        if hit is not None and hit[0] == ptrs:
            return hit[1]
        params = lists[0]
        p_dtype = params[0].dtype
        wire = fmt.wire_dtype(dtype).bits if (p_dtype, dtype) in _ADAMW_WIRES else None
        # torch's fused AdamW itself refuses other layouts (its tensors must share dtype, device and strides)
        laid_out = all(t.dtype == p_dtype and t.device == self.device and t.is_contiguous()
                       for lst in lists for t in lst)
        if wire is None or not laid_out or len(params) != len(group.sizes) \
                or any(t.numel() != z for t, z in zip(params, group.sizes, strict=True)):
            self._adamw_plans[key] = (ptrs, None)
            return None
        item = params[0].element_size()
        rows = [[(lst[m].data_ptr() - lst[0].data_ptr()) // item for lst in lists] + [m, group.starts[m]]
                for m in range(len(params))]
        vector = 16 // item  # elements per 16-byte load: the kernel's loads vectorise when every offset is a multiple
        aligned = all(p % 16 == 0 for p in ptrs) and all(v % vector == 0 for row in rows for v in row[:4])
        rows = torch.tensor(rows, dtype=torch.int64)
        if self.device.type == "cuda":  # a pageable copy would wait for the GPU to drain: pinned, queued
            rows = rows.pin_memory()
        # a lone member on its own wire: pass 2 reads the new bits from the parameter itself
        plan = (rows.to(self.device, non_blocking=True), vector if aligned else 1, wire,
                len(params) == 1 and p_dtype == dtype)
        self._adamw_plans[key] = (ptrs, plan, rows)  # the host rows stay until the copy is long done
        return plan

    def append(self, old_bits_N: torch.Tensor, new_bits_N: torch.Tensor, offset: int, key: Any) -> None:
        """Record the changes of a chunk holding elements ``[offset, offset + N)`` of the tensor ``key``."""
        old_bits_N, new_bits_N = old_bits_N.reshape(-1), new_bits_N.reshape(-1)
        _check_pair(old_bits_N, new_bits_N)
        if old_bits_N.numel() > self.max_chunk_elements:
            raise KernelError(f"chunk of {old_bits_N.numel()} elements exceeds the sink's max_chunk_elements "
                              f"{self.max_chunk_elements}")
        k = len(self.keys)
        if k >= self.max_chunks:
            raise KernelError(f"more than max_chunks={self.max_chunks} chunks in one step; count in max_chunks "
                              "every chunk of the step")
        self.keys.append(key)
        if not self.triton:
            idx, new, old, change = diff_extract_ref(old_bits_N, new_bits_N, offset)
            start = int(self._start_host[k])
            stop = start + idx.numel()
            keep = max(0, min(stop, self.capacity) - start)
            self.idx[start:start + keep] = idx[:keep]
            self.new[start:start + keep] = new[:keep]
            self.old[start:start + keep] = old[:keep]
            self._start_host[k + 1] = stop
            self._checksum_host[k] = change - (1 << 64) if change >= 1 << 63 else change
            return
        _triton().diff_extract_launch(old_bits_N, new_bits_N, offset, _MASK_OF_BITS[old_bits_N.dtype],
                                      self._diff_scratch(), self._start_dev, k, (self.idx, self.new, self.old),
                                      self.capacity, self._checksum_dev)

    def finish(self) -> None:
        """Queue the copy of chunk starts and checksums to the host (no sync)."""
        if self.triton:
            n = len(self.keys)
            self._start_host[:n + 1].copy_(self._start_dev[:n + 1], non_blocking=True)
            self._checksum_host[:n].copy_(self._checksum_dev[:n], non_blocking=True)
            if self.device.type == "cuda":
                self._event = torch.cuda.Event()
                self._event.record()

    def collect(self) -> list[ChunkChanges]:
        """Wait for the step's kernels and return each chunk's changes (views; copy before the next step)."""
        spans = self.collect_spans()
        sizes = [b - a for _, a, b, _ in spans]  # the chunks follow one another: one split per buffer
        views = (t[:self._total].split(sizes) for t in (self.idx, self.new, self.old))
        return [ChunkChanges(key, idx, new, old, change)
                for (key, _, _, change), idx, new, old in zip(spans, *views, strict=True)]

    def collect_spans(self) -> list[tuple[Any, int, int, int]]:
        """As :meth:`collect`, each chunk as ``(key, start, stop, checksum_change)``: its changes are
        ``[start, stop)`` of :meth:`step_changes`."""
        if self._event is not None:
            self._event.synchronize()
        elif self.triton and self.device.type == "cuda":
            raise KernelError("ChangeSink.collect() before finish(); call finish() after the last append")
        n = len(self.keys)
        starts = self._start_host[:n + 1].tolist()
        if starts[n] > self.capacity:
            raise ChangeCapacityError(f"the step changed {starts[n]} elements but the change sink holds {self.capacity}; "
                                      "publish a full checkpoint for this step and raise the sink capacity "
                                      "(capacity_fraction)")
        self._total = starts[n]
        return [(key, a, b, c & MASK64) for key, a, b, c in zip(self.keys, starts[:-1], starts[1:],
                                                               self._checksum_host[:n].tolist(), strict=True)]

    def step_changes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After :meth:`collect` or :meth:`collect_spans`: the step's (idx, new, old) for all its
        chunks, one after another in append order (views, like each chunk's)."""
        return self.idx[:self._total], self.new[:self._total], self.old[:self._total]


def diff_extract(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor, offset: int = 0,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Changed elements of one chunk, as :func:`~rltune.sync.kernels.reference.diff_extract_ref` (syncs
    once; CPU bits through the compiled passes of :mod:`.cpu_kernels`)."""
    old_bits_N, new_bits_N = old_bits_N.reshape(-1), new_bits_N.reshape(-1)
    _check_pair(old_bits_N, new_bits_N)
    if not _use_triton(old_bits_N.device, backend):
        cpu_kernels = _cpu_kernels() if old_bits_N.device.type == "cpu" else None
        if cpu_kernels is not None:
            return cpu_kernels.diff_extract_cpu(old_bits_N, new_bits_N, offset)
        return diff_extract_ref(old_bits_N, new_bits_N, offset)
    n = old_bits_N.numel()
    dev = old_bits_N.device
    tk = _triton()
    scratch = tk.DiffScratch(n, dev)
    out = (torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, dtype=torch.int32, device=dev),
           torch.empty(n, dtype=torch.int32, device=dev))
    start = torch.zeros(2, dtype=torch.int64, device=dev)
    change = torch.zeros(1, dtype=torch.int64, device=dev)
    tk.diff_extract_launch(old_bits_N, new_bits_N, offset, _MASK_OF_BITS[old_bits_N.dtype], scratch, start, 0, out, n,
                           change)
    count, change = torch.stack([start[1], change[0]]).tolist()
    return out[0][:count], out[1][:count], out[2][:count], change & MASK64


# --------------------------------------------------------------------------------------- fused apply


def strided_layout(target: int, shape: tuple[int, ...] | list[int], base: int = 0,
                   rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                   row_stride: int | None = None, col_stride: int = 1) -> dict:
    """Layout of a checkpoint tensor held at ``base + r * row_stride + c * col_stride`` for ``r`` in
    ``rows`` and ``c`` in ``cols`` (checkpoint coordinates); defaults: the whole tensor, row-major."""
    if len(shape) <= 1:
        n_rows, ncols = 1, int(np.prod(shape)) if len(shape) else 1
    else:
        n_rows, ncols = int(shape[0]), int(np.prod(shape[1:]))
    rows = rows or (0, n_rows)
    cols = cols or (0, ncols)
    return dict(target=target, ncols=max(1, ncols), base=base,
                row_stride=(cols[1] - cols[0]) * col_stride if row_stride is None else row_stride,
                col_stride=col_stride, row_window=tuple(rows), col_window=tuple(cols))


def table_layout(target: int, ncols: int, row_offsets: torch.Tensor, col_offsets: torch.Tensor,
                 base: int = 0) -> dict:
    """Layout with per-row and per-column offset tables (int64, -1 = not held): ``base + rows[r] + cols[c]``."""
    return dict(target=target, ncols=ncols, base=base, row_stride=0, col_stride=0, row_window=(0, 0),
                col_window=(0, 0), row_table=torch.as_tensor(row_offsets, dtype=torch.int64),
                col_table=torch.as_tensor(col_offsets, dtype=torch.int64))


def _strided_from_runs(runs, target: int, n_rows: int, ncols: int) -> dict | None:
    """A strided layout for runs that hold a row window, a column window or both (one parameter),
    found from the runs alone (O(runs), no per-element arrays); None if the runs are not such a window."""
    cs, ln, ps = runs.ckpt_start, runs.length, runs.param_start
    order = np.argsort(cs, kind="stable")
    cs, ln, ps = cs[order], ln[order], ps[order]
    # merge runs contiguous in both the checkpoint and the parameter
    joined = (cs[1:] == cs[:-1] + ln[:-1]) & (ps[1:] == ps[:-1] + ln[:-1])
    heads = np.flatnonzero(np.concatenate(([True], ~joined)))
    cs, ps = cs[heads], ps[heads]
    ln = np.add.reduceat(ln, heads)
    if len(cs) == 1 and cs[0] % ncols == 0 and ln[0] % ncols == 0:  # whole rows [r0, r1)
        r0 = int(cs[0]) // ncols
        return strided_layout(target, [n_rows, ncols], base=int(ps[0]) - r0 * ncols, rows=(r0, r0 + int(ln[0]) // ncols))
    width = int(ln[0])
    c0 = int(cs[0]) % ncols
    r = cs // ncols
    if (np.all(ln == width) and np.all(cs % ncols == c0) and c0 + width <= ncols and np.all(np.diff(r) == 1)
            and np.all(ps == ps[0] + (r - r[0]) * width)):  # columns [c0, c0 + width) of rows [r0, r1)
        r0 = int(r[0])
        return strided_layout(target, [n_rows, ncols], base=int(ps[0]) - r0 * width - c0, rows=(r0, r0 + len(cs)),
                              cols=(c0, c0 + width))
    return None


def layouts_from_index_map(index_map, shapes: dict[str, list[int]]) -> tuple[list[str], list[dict]]:
    """Layouts of a recorded :class:`~rltune.sync.indexmap.IndexMap` (runs) for the fused kernel.

    Returns the checkpoint names in layout order and their layouts; ``target`` is the index into
    ``index_map.param_names``. Row and column windows become strided layouts (the kernel's fast
    path); other placements become row/column offset tables. Raises :class:`LayoutError` when a
    tensor's elements go to more than one parameter or its positions are not ``rows[r] + cols[c]``.
    """
    names, layouts = [], []
    for name, runs in index_map.tensors.items():
        shape = list(shapes[name])
        n_rows = int(shape[0]) if len(shape) > 1 else 1
        ncols = max(1, runs.numel // max(1, n_rows))
        names.append(name)
        if runs.held == 0:
            layouts.append(strided_layout(0, [n_rows, ncols], rows=(0, 0), cols=(0, 0)))
            continue
        params = np.unique(runs.param)
        if len(params) != 1:
            raise LayoutError(f"{name}: elements go to {len(params)} parameters; the fused apply needs one "
                              "parameter per checkpoint tensor (use apply_mapped_delta per run)")
        strided = _strided_from_runs(runs, int(params[0]), n_rows, ncols)
        if strided is not None:
            layouts.append(strided)
            continue
        ckpt = np.concatenate([np.arange(s, s + n) for s, n in zip(runs.ckpt_start, runs.length, strict=True)])
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(runs.param_start, runs.length, strict=True)])
        r, c = ckpt // ncols, ckpt % ncols
        held_rows, held_cols = np.unique(r), np.unique(c)
        if len(ckpt) != len(held_rows) * len(held_cols):
            raise LayoutError(f"{name}: the held elements are not a product of rows and columns")
        row_tab = np.full(n_rows, -1, dtype=np.int64)
        col_tab = np.full(ncols, -1, dtype=np.int64)
        first_row = r == held_rows[0]
        col_tab[c[first_row]] = pos[first_row]
        first_col = c == held_cols[0]
        row_tab[r[first_col]] = pos[first_col] - col_tab[held_cols[0]]
        if not np.array_equal(row_tab[r] + col_tab[c], pos):
            raise LayoutError(f"{name}: positions are not rows[r] + cols[c]; the layout needs a per-element map")
        layouts.append(table_layout(int(params[0]), ncols, torch.from_numpy(row_tab), torch.from_numpy(col_tab)))
    return names, layouts


@dataclass
class ApplyResult:
    """Per delta entry: running-checksum change (int64 bits, mod 2**64), changes written and, when the
    apply computed them, the two checksum2 lane changes (int64 sums; the lanes are these mod P).

    The rows live in one ``[2, E]`` (or ``[4, E]``) host tensor. On a GPU it is the plan's pinned
    buffer, filled by a copy queued behind the kernel: reading it waits for ``stream`` once. The
    buffer is reused by the plan's next apply: read a result before applying again.
    """

    both_2E: torch.Tensor
    stream: Any = None  # the CUDA stream the copy runs on; None once the sums are on the host

    @property
    def checksum_E(self) -> torch.Tensor:
        return self.to_tensor()[0]

    @property
    def written_E(self) -> torch.Tensor:
        return self.to_tensor()[1]

    @property
    def has_checksum2(self) -> bool:
        return self.both_2E.shape[0] == 4

    def to_host(self) -> tuple[list[int], list[int]]:
        """(checksum changes mod 2**64, changes written) per entry, with one host sync."""
        host = self.to_numpy()
        return host[0].view(np.uint64).tolist(), host[1].tolist()

    def to_tensor(self) -> torch.Tensor:
        """The ``[2, E]`` (``[4, E]`` with checksum2) int64 sums on the host (waits for the copy once)."""
        if self.stream is not None:
            self.stream.synchronize()
            self.stream = None
        return self.both_2E

    def to_numpy(self) -> np.ndarray:
        """The int64 sums as a host array; view row 0 as uint64 for mod 2**64."""
        return self.to_tensor().numpy()

    def checksums(self) -> list[int]:
        return self.to_host()[0]

    def written(self) -> list[int]:
        return self.to_host()[1]

    def checksums2(self) -> list[int]:
        """Packed checksum2 change per entry (the apply must have been asked for them: ``mix=True``)."""
        if not self.has_checksum2:
            raise KernelError("this apply did not compute checksum2 changes; call plan.apply(..., mix=True)")
        host = self.to_numpy()
        return [checksum2_pack(int(a), int(b)) for a, b in zip(host[2].tolist(), host[3].tolist(), strict=True)]


def _host_result(out: tuple[list[int], ...], mix: bool) -> ApplyResult:
    sums, written = out[0], out[1]
    rows = [[s - (1 << 64) if s >= 1 << 63 else s for s in sums], written]
    if mix:
        rows += [[m >> 32 for m in out[2]], [m & 0xFFFFFFFF for m in out[2]]]
    return ApplyResult(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1))


@dataclass
class StagedPatch:
    """A delta read against the targets but not written (:meth:`ApplyPlan.stage`): per change the target
    position (-1: not held) and the bits to store, and the apply's result, computed from those reads."""

    entry_tensor_E: torch.Tensor
    entry_offsets_E1: torch.Tensor
    pos_C: torch.Tensor
    new_C: torch.Tensor
    result: ApplyResult


class ApplyPlan:
    """Device tables of one index map for the fused apply kernel; built, and its kernel compiled, once.

    ``params``: this worker's parameters (patched in place through wire-bit views). ``layouts[t]``:
    where checkpoint tensor ``t`` lives (:func:`strided_layout`, :func:`table_layout`). The first
    call of the kernel happens here, so no delta compiles it inside the engine pause.
    """

    def __init__(self, params: list[torch.Tensor], layouts: list[dict], backend: str = "auto"):
        if not params:
            raise KernelError("ApplyPlan needs at least one parameter")
        self.device = params[0].device
        self.targets = [as_bits(p.data if isinstance(p, torch.nn.Parameter) else p) for p in params]
        self.layouts = layouts
        # "numba": the compiled CPU pass (kernels.cpu_kernels), for CPU engines whose pause matters
        self.numba = backend == "numba"
        if self.numba and self.device.type != "cpu":
            raise KernelBackendError("backend='numba' applies to CPU parameters; use 'auto' or 'triton' on a GPU")
        self.triton = False if self.numba else _use_triton(self.device, backend)
        widths = [_WIDTH_OF_BITS[t.dtype] for t in self.targets]
        self.widths = sorted({widths[lay["target"]] for lay in layouts}) or [16]
        rows, tables, cursor = [], [], 0
        for t, lay in enumerate(layouts):
            if not 0 <= lay["target"] < len(self.targets):
                raise KernelError(f"layout {t}: target {lay['target']} outside the {len(self.targets)} parameters")
            row_tab = col_tab = -1
            if lay.get("row_table") is not None:
                rt, ct = lay["row_table"].reshape(-1), lay["col_table"].reshape(-1)
                if ct.numel() != lay["ncols"]:
                    raise KernelError(f"layout {t}: column table has {ct.numel()} entries for {lay['ncols']} columns")
                row_tab, col_tab = cursor, cursor + rt.numel()
                tables += [rt, ct]
                cursor += rt.numel() + ct.numel()
            rows.append([lay["target"], lay["ncols"], lay["base"], lay["row_stride"], lay["col_stride"],
                         *lay["row_window"], *lay["col_window"], row_tab, col_tab, widths[lay["target"]]])
        self.layout_T = torch.tensor(rows, dtype=torch.int64, device=self.device).reshape(-1, 12)
        self.tables = (torch.cat(tables).to(self.device) if tables
                       else torch.zeros(1, dtype=torch.int64, device=self.device))
        self.addresses = torch.tensor([t.data_ptr() for t in self.targets], dtype=torch.int64, device=self.device)
        # The kernel adds per-entry sums into _sums (checksum changes, counts, then the two checksum2
        # lanes, each row padded to an even length so every row stays 16-byte aligned, as the compiled
        # kernel expects); they are zeroed again right after each apply's copy into _host (pinned on a
        # GPU), so nothing runs before the kernel in the pause.
        rows = len(layouts) + len(layouts) % 2
        self._sums = torch.zeros(4 * rows, dtype=torch.int64, device=self.device)
        self._host = torch.zeros(4 * rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if self.triton:
            for width in self.widths:  # compile now, outside any pause
                for add in (True, False):
                    for mix in (True, False):
                        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
                        none = self._sums[:0]
                        _triton().apply_deltas_launch(empty, torch.zeros(0, dtype=torch.int32, device=self.device),
                                                      torch.zeros(1, dtype=torch.int64, device=self.device), empty,
                                                      self.layout_T, self.tables, self.addresses, none, none, width,
                                                      add, none if mix else None, none if mix else None)

    def apply(self, entry_tensor_E: torch.Tensor, entry_offsets_E1: torch.Tensor, idx_C: torch.Tensor,
              val_C: torch.Tensor, add: bool = True, mix: bool = False) -> ApplyResult:
        """Patch one delta in place (see ``apply_deltas_ref``); returns per-entry checksum change and count,
        and with ``mix`` the checksum2 lane changes too (:meth:`ApplyResult.checksums2`)."""
        self._check_changes(entry_tensor_E, entry_offsets_E1, idx_C, val_C)
        if not self.triton:
            if self.numba:
                from rltune.sync.kernels.cpu_kernels import apply_deltas_cpu

                out = apply_deltas_cpu(self.targets, self.layouts, entry_tensor_E, entry_offsets_E1, idx_C, val_C, add,
                                       mix=mix)
            else:
                out = apply_deltas_ref(self.targets, self.layouts, entry_tensor_E, entry_offsets_E1, idx_C, val_C, add,
                                       mix=mix)
            return _host_result(out, mix)
        dev = self.device
        entry_tensor_E = entry_tensor_E.to(dev, torch.int64)
        entry_offsets_E1 = entry_offsets_E1.to(dev, torch.int64)
        idx_C, val_C = idx_C.to(dev), val_C.to(dev)
        n_entries = entry_tensor_E.numel()
        rows = n_entries + n_entries % 2
        if 4 * rows > self._sums.numel():  # more entries than checkpoint tensors (split entries)
            self._sums = torch.zeros(4 * rows, dtype=torch.int64, device=dev)
            self._host = torch.zeros(4 * rows, dtype=torch.int64, pin_memory=dev.type == "cuda")
        n_rows = 4 if mix else 2
        sums, host = self._sums[:n_rows * rows], self._host[:n_rows * rows]
        if n_entries:
            lanes = (sums[2 * rows:3 * rows], sums[3 * rows:]) if mix else (None, None)
            for width in self.widths:  # one launch per element width the plan holds (usually one)
                _triton().apply_deltas_launch(idx_C, val_C, entry_offsets_E1, entry_tensor_E, self.layout_T,
                                              self.tables, self.addresses, sums[:rows], sums[rows:2 * rows], width,
                                              add, *lanes)
            host.copy_(sums, non_blocking=True)
            sums.zero_()  # queued after the copy: ready for the next apply, off its critical path
        host_2E = host.view(n_rows, rows)[:, :n_entries]
        return ApplyResult(host_2E, torch.cuda.current_stream(dev) if dev.type == "cuda" else None)

    def stage(self, entry_tensor_E: torch.Tensor, entry_offsets_E1: torch.Tensor, idx_C: torch.Tensor,
              val_C: torch.Tensor, add: bool = True, mix: bool = False, threads: int | None = None) -> StagedPatch:
        """:meth:`apply`'s reads and sums without its writes (the compiled CPU pass only); :meth:`store`
        makes the writes. The pair equals :meth:`apply` bit for bit while the targets stay as they were
        between the two calls, so a CPU engine stages a delta while it serves and its pause holds only
        the stores (each change's cache miss, nothing else). ``threads``: as :func:`cpu_kernels.apply_threads`."""
        if not self.numba:
            raise KernelBackendError("stage/store is the compiled CPU pass's (backend='numba'); use apply")
        self._check_changes(entry_tensor_E, entry_offsets_E1, idx_C, val_C)
        from rltune.sync.kernels.cpu_kernels import stage_deltas_cpu

        out, pos_C, new_C = stage_deltas_cpu(self.targets, self.layouts, entry_tensor_E, entry_offsets_E1, idx_C, val_C,
                                             add, threads=threads, mix=mix)
        return StagedPatch(entry_tensor_E, entry_offsets_E1, pos_C, new_C, _host_result(out, mix))

    def store(self, patch: StagedPatch) -> ApplyResult:
        """Write what :meth:`stage` staged; returns the result :meth:`apply` would have returned."""
        if not self.numba:
            raise KernelBackendError("stage/store is the compiled CPU pass's (backend='numba'); use apply")
        from rltune.sync.kernels.cpu_kernels import store_staged_cpu

        store_staged_cpu(self.targets, self.layouts, patch.entry_tensor_E, patch.entry_offsets_E1, patch.pos_C,
                         patch.new_C)
        return patch.result

    @staticmethod
    def _check_changes(entry_tensor_E, entry_offsets_E1, idx_C, val_C) -> None:
        if entry_offsets_E1.numel() != entry_tensor_E.numel() + 1:
            raise KernelError(f"entry_offsets needs {entry_tensor_E.numel() + 1} values (entries + 1), "
                              f"got {entry_offsets_E1.numel()}")
        if idx_C.numel() != val_C.numel():
            raise KernelError(f"{idx_C.numel()} indices but {val_C.numel()} values")


def apply_deltas(plan: ApplyPlan, entry_tensor_E: torch.Tensor, entry_offsets_E1: torch.Tensor,
                 idx_C: torch.Tensor, val_C: torch.Tensor, add: bool = True, mix: bool = False) -> ApplyResult:
    """Fused multi-tensor apply through a prebuilt plan (the function form of :meth:`ApplyPlan.apply`)."""
    return plan.apply(entry_tensor_E, entry_offsets_E1, idx_C, val_C, add, mix)


def apply_mapped_delta(target_bits_N: torch.Tensor, pos_C: torch.Tensor, diff_C: torch.Tensor,
                       ckpt_idx_C: torch.Tensor, backend: str = "auto") -> int:
    """Kernel form of :func:`rltune.sync.ops.apply_mapped_delta_ref` (same signature; a receiver ``apply_fn``)."""
    from rltune.sync.ops import apply_mapped_delta_ref  # ops imports this package's reference module

    target_bits_N = target_bits_N.reshape(-1)
    if not _use_triton(target_bits_N.device, backend):
        return apply_mapped_delta_ref(target_bits_N, pos_C, diff_C, ckpt_idx_C)
    if pos_C.numel() == 0:
        return 0
    dev = target_bits_N.device
    partial_P = _triton().apply_positions_launch(target_bits_N, pos_C.to(dev), diff_C.to(dev), ckpt_idx_C.to(dev),
                                                 _MASK_OF_BITS[target_bits_N.dtype])
    return int(partial_P.sum()) & MASK64


__all__ = [
    "ApplyPlan",
    "ApplyResult",
    "StagedPatch",
    "ChangeCapacityError",
    "ChangeSink",
    "ChunkChanges",
    "KernelBackendError",
    "KernelError",
    "LayoutError",
    "apply_deltas",
    "apply_mapped_delta",
    "bits_dtype",
    "checksum",
    "checksum2",
    "checksum2_span_changes",
    "checksum_pair",
    "checksum_pairs",
    "checksums",
    "diff_extract",
    "layouts_from_index_map",
    "strided_layout",
    "table_layout",
]
