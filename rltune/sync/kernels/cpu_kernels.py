"""The fused multi-tensor apply on a CPU: one compiled pass per delta entry (numba, no GIL).

The torch reference (:func:`rltune.sync.kernels.reference.apply_deltas_ref`) builds a dozen
temporaries per entry (row, column, positions, gathers, wrapped sums); on a two-core machine that
is ~1 µs per change. This kernel walks each change once: map the checkpoint index to the target
position (strided window or row/column offset tables, as in the Triton kernel), add the wrapped
difference (or write the new bits), and accumulate the running-checksum change modulo 2^64 in
uint64 and, when asked, the two checksum2 lanes modulo 2^31 - 1. It must equal the torch reference bit for bit (tests/sync/test_kernels.py).
The same pass can also run without its writes (:func:`stage_deltas_cpu`: the sums, and per change
the position and the bits to store) and the writes later on their own (:func:`store_staged_cpu`):
a CPU engine stages while it serves and only stores in its pause.

Shapes: ``idx_C`` int64 checkpoint indices, ``val_C`` int32 (wrapped differences or new bits),
``target_N`` a flat int16 / int32 / uint8 view of the parameter's bits.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from rltune.sync import format as fmt

_P31 = (1 << 31) - 1


@numba.njit(cache=True, nogil=True, inline="always")
def _mix32(x):
    # checksum2's finaliser (kernels.reference.mix32_ref) in uint32 arithmetic: every result is cast
    # back, so products wrap mod 2**32, and in a loop of 32-bit lanes (_hash_weights) the vector
    # multiplies are 32-bit
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(0x7FEB352D))
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * np.uint32(0x846CA68B))
    return np.uint32(x ^ (x >> np.uint32(16)))


@numba.njit(cache=True, nogil=True, inline="always")
def _weights2(i):
    # checksum2's two weights (wa, wb) in [1, 2**30] of flat position i (uint64; kernels.reference), as uint64
    m30 = np.uint32((1 << 30) - 1)
    lo = np.uint32(i & np.uint64(0xFFFFFFFF))
    hi = np.uint32(np.uint32((i >> np.uint64(32)) & np.uint64(0xFFFFFFFF)) * np.uint32(0x9E3779B9))
    h = _mix32(np.uint32(lo ^ hi))
    wa = np.uint64(np.uint32(h & m30)) + np.uint64(1)
    wb = np.uint64(np.uint32(_mix32(np.uint32(h ^ np.uint32(0x5BD1E995))) & m30)) + np.uint64(1)
    return wa, wb


@numba.njit(cache=True, nogil=True, inline="always")
def _fold(x):
    # a value below 2**32 congruent to x mod P = 2**31 - 1, for x < 2**62 (2**31 = 1 mod P)
    return (x & np.uint64(_P31)) + (x >> np.uint64(31))


@numba.njit(cache=True, nogil=True, inline="always")
def _mod_p(u):
    p = np.uint64(_P31)
    v = _fold(u)
    return v - p if v >= p else v


@intrinsic
def _prefetch_for_write(typingctx, array, index):
    """A hint that ``array[index]`` is about to be written (LLVM's ``llvm.prefetch``: write, keep in
    every cache level). It never faults; where a target has no prefetch instruction it is dropped."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]],
                                           wraparound=False, boundscheck=False)
        pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [pointer.type],
                                              ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]))
        builder.call(fn, [pointer, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(array, index), codegen


# Changes ahead whose target the apply prefetches. The loop body of a change (checksum, checksum2
# hash) is long enough that the core's reorder window holds only a few changes' cache misses at
# once; fetching 32 changes ahead keeps ~30 misses in flight (16-64 measured alike, 8 slower).
_PREFETCH_AHEAD = 32


@numba.njit(cache=True, nogil=True, inline="always")
def _target_position(i, contiguous, lo, hi, base, ncols, row_stride, col_stride, r0, r1, c0, c1,
                     row_table, col_table, use_tables):
    # checkpoint index i -> flat position in the target, or -1 when the target holds no such element
    if contiguous:
        return base + i if lo <= i < hi else np.int64(-1)
    r = i // ncols
    c = i - r * ncols
    if use_tables:
        rt = row_table[r]
        ct = col_table[c]
        return base + rt + ct if rt >= 0 and ct >= 0 else np.int64(-1)
    if r < r0 or r >= r1 or c < c0 or c >= c1:
        return np.int64(-1)
    return base + r * row_stride + c * col_stride


@numba.njit(cache=True, nogil=True)
def _apply_entry(target_N, idx_C, val_C, width, ncols, base, row_stride, col_stride, r0, r1, c0, c1,
                 row_table, col_table, use_tables, add, signed, mix, write, pos_out, new_out):
    # write: patch target_N in place; otherwise leave it as it is and record, per change, the target
    # position (-1: not held) and the bits a write would store into pos_out / new_out (a staged patch)
    mask = (np.int64(1) << width) - 1
    half = np.int64(1) << (width - 1)
    full = mask + 1
    checksum = np.uint64(0)
    lane_a = np.uint64(0)
    lane_b = np.uint64(0)
    p = np.uint64(_P31)
    written = 0
    # a whole-row window laid out row-major (a full tensor, a row slice, one half of a fused
    # parameter): the position is base + i, no division
    contiguous = (not use_tables) and c0 == 0 and c1 == ncols and col_stride == 1 and row_stride == ncols
    lo, hi = r0 * ncols, r1 * ncols
    n = idx_C.shape[0]
    for j in range(n):
        if j + _PREFETCH_AHEAD < n:
            ahead = _target_position(idx_C[j + _PREFETCH_AHEAD], contiguous, lo, hi, base, ncols, row_stride,
                                     col_stride, r0, r1, c0, c1, row_table, col_table, use_tables)
            if ahead >= 0:
                _prefetch_for_write(target_N, ahead)
        i = idx_C[j]
        pos = _target_position(i, contiguous, lo, hi, base, ncols, row_stride, col_stride, r0, r1, c0, c1,
                               row_table, col_table, use_tables)
        if pos < 0:
            if not write:
                pos_out[j] = -1
            continue
        old = np.int64(target_N[pos]) & mask
        if add:
            new = (old + np.int64(val_C[j])) & mask
        else:
            new = np.int64(val_C[j]) & mask
        stored = new - full if (signed and new >= half) else new
        if write:
            target_N[pos] = stored
        else:
            pos_out[j] = pos
            new_out[j] = stored
        checksum += np.uint64(i + 1) * np.uint64(new - old)
        written += 1
        if mix:
            wa, wb = _weights2(np.uint64(i))
            d = _mod_p(np.uint64(new)) + p - _mod_p(np.uint64(old))  # in [1, 2P): w * d < 2**62
            # no remainder per change: a lane below 2**33 folds to at most 2**31 + 2 and a term to
            # below 2**32, so the lane stays below 2**33
            lane_a = _fold(lane_a) + _fold(wa * d)
            lane_b = _fold(lane_b) + _fold(wb * d)
    return checksum, written, lane_a % p, lane_b % p


_EMPTY_TABLE = np.zeros(1, dtype=np.int64)
_NO_POS = np.zeros(1, dtype=np.int64)
_NO_NEW = np.zeros(1, dtype=np.int32)


@numba.njit(cache=True, nogil=True)
def _store_entry(target_N, pos_C, new_C):
    # a staged patch's writes: nothing but the stores (each waits on one cache line: prefetched ahead)
    n = pos_C.shape[0]
    for j in range(n):
        if j + _PREFETCH_AHEAD < n:
            ahead = pos_C[j + _PREFETCH_AHEAD]
            if ahead >= 0:
                _prefetch_for_write(target_N, ahead)
        pos = pos_C[j]
        if pos >= 0:
            target_N[pos] = new_C[j]


@numba.njit(cache=True, nogil=True)
def _checksum_bits(bits_N, offset, mask):
    total = np.uint64(0)
    for i in range(bits_N.shape[0]):
        total += np.uint64(offset + i + 1) * np.uint64(np.int64(bits_N[i]) & mask)
    return total


# The pair pass (checksum and checksum2 of every element) in runs of 2**16 positions aligned to the
# absolute position, so a run's positions share their high 32 bits: one hash of them per run, and
# the terms of a run summed unreduced (w * u below 2**46 for elements of 16 bits or fewer; 32-bit
# ones folded below 2**32 first). Inside a run, blocks of _WEIGHT_BLOCK positions: one loop hashes
# their checksum2 weights in 32-bit lanes (16 to an AVX-512 vector), a second one multiplies and
# sums them with the elements in 64-bit lanes. One loop doing both ran every operation in 64-bit
# lanes: ~1 ns an element on one core of the 2-vCPU machine, against ~0.5 ns so.
_CHECKSUM2_RUN = 1 << 16
_WEIGHT_BLOCK = 2048  # two blocks of uint32 weights: 16 KiB, in L1
# what the pair pass reads: wire bits of at most 16 bits (masked), 32-bit wire bits, or float32
# weights whose wire bits are their bfloat16 cast (torch's rounding; no cast tensor is made)
_NARROW_BITS, _WIDE_BITS, _F32_AS_BF16 = 0, 1, 2


@numba.njit(cache=True, nogil=True)
def _hash_weights(lo0, hi_hash, n, wa_out, wb_out):
    # checksum2's weights (kernels.reference.checksum2_weights_ref) of the n positions whose low 32 bits
    # are lo0, lo0 + 1, ... (no carry out of them) and whose high half hashes to hi_hash
    m30 = np.uint32((1 << 30) - 1)
    for r in range(n):
        h = _mix32(np.uint32(np.uint32(lo0 + np.uint32(r)) ^ hi_hash))
        wa_out[r] = np.uint32(np.uint32(h & m30) + np.uint32(1))
        wb_out[r] = np.uint32(np.uint32(_mix32(np.uint32(h ^ np.uint32(0x5BD1E995))) & m30) + np.uint32(1))


@numba.njit(cache=True, nogil=True)
def _sums_narrow(seg, mask, r0, wa, wb):
    # elements of 16 bits or fewer at run positions r0, r0 + 1, ... (< 2**16): sum u, sum r * u (each term
    # below 2**32, a uint32 product) and both lanes' sum w * u
    s_u, s_ru, s_a, s_b = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    for r in range(seg.shape[0]):
        u = np.uint32(np.uint32(seg[r]) & mask)
        s_u += np.uint64(u)
        s_ru += np.uint64(np.uint32(np.uint32(r0 + r) * u))
        s_a += np.uint64(wa[r]) * np.uint64(u)
        s_b += np.uint64(wb[r]) * np.uint64(u)
    return s_u, s_ru, s_a, s_b


@numba.njit(cache=True, nogil=True)
def _sums_f32_as_bf16(seg, r0, wa, wb):
    # float32 bits (int32) -> bfloat16 bits as torch casts on a CPU (round to nearest even; every NaN to
    # 0xFFFF), then as _sums_narrow (a loop of its own: one loop for both behind a constant flag ran the
    # live check ~15 % slower)
    s_u, s_ru, s_a, s_b = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    for r in range(seg.shape[0]):
        x = np.uint32(seg[r])
        rounded = np.uint32(np.uint32(x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        u = np.uint32(0xFFFF) if np.uint32(x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded
        s_u += np.uint64(u)
        s_ru += np.uint64(np.uint32(np.uint32(r0 + r) * u))
        s_a += np.uint64(wa[r]) * np.uint64(u)
        s_b += np.uint64(wb[r]) * np.uint64(u)
    return s_u, s_ru, s_a, s_b


@numba.njit(cache=True, nogil=True)
def _sums_wide(seg, r0, wa, wb):
    # 32-bit elements: r * u below 2**48 (sums wrap mod 2**64, the checksum's ring), w * u below 2**62
    # folded below 2**32
    s_u, s_ru, s_a, s_b = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
    for r in range(seg.shape[0]):
        u = np.uint64(np.uint32(seg[r]))
        s_u += u
        s_ru += np.uint64(r0 + r) * u
        s_a += _fold(np.uint64(wa[r]) * u)
        s_b += _fold(np.uint64(wb[r]) * u)
    return s_u, s_ru, s_a, s_b


@numba.njit(cache=True, nogil=True)
def _pair_lanes(bits_N, offset, kind, mask, table_a, table_b):
    # checksum (mod 2**64) and checksum2's two lanes (kernels.reference) of elements at absolute positions
    # offset, offset + 1, ...: per run, sum (i + 1) * u = (start + 1) * sum u + sum r * u, and the lanes'
    # sums reduced mod P once. Weights of positions below len(table_a) come from the tables
    p = np.uint64(_P31)
    table_n = table_a.shape[0]
    c, a, b = np.uint64(0), np.uint64(0), np.uint64(0)
    wa = np.empty(_WEIGHT_BLOCK, dtype=np.uint32)
    wb = np.empty(_WEIGHT_BLOCK, dtype=np.uint32)
    n = bits_N.shape[0]
    k = 0
    while k < n:
        i = np.uint64(offset + k)
        k1 = min(n, k + np.int64(((i | np.uint64(_CHECKSUM2_RUN - 1)) + np.uint64(1)) - i))
        hi_hash = np.uint32(np.uint32(i >> np.uint64(32)) * np.uint32(0x9E3779B9))
        lo = np.uint32(i & np.uint64(0xFFFFFFFF))
        s_u, s_ru, s_a, s_b = np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0)
        for kb in range(k, k1, _WEIGHT_BLOCK):
            m = min(_WEIGHT_BLOCK, k1 - kb)
            r0 = kb - k
            at = offset + kb
            if at + m <= table_n:
                block_a, block_b = table_a[at:at + m], table_b[at:at + m]
            else:
                _hash_weights(np.uint32(lo + np.uint32(r0)), hi_hash, m, wa, wb)
                block_a, block_b = wa, wb
            seg = bits_N[kb:kb + m]
            if kind == _NARROW_BITS:
                t_u, t_ru, t_a, t_b = _sums_narrow(seg, np.uint32(mask), r0, block_a, block_b)
            elif kind == _F32_AS_BF16:
                t_u, t_ru, t_a, t_b = _sums_f32_as_bf16(seg, r0, block_a, block_b)
            else:
                t_u, t_ru, t_a, t_b = _sums_wide(seg, r0, block_a, block_b)
            s_u += t_u
            s_ru += t_ru
            s_a += t_a
            s_b += t_b
        c += (i + np.uint64(1)) * s_u + s_ru
        a = (a + s_a % p) % p
        b = (b + s_b % p) % p
        k = k1
    return c, a, b


# each bits view's mask and width (rltune.sync.format's table); the narrow pass takes up to 16 bits
_MASKS = {np.dtype(name): fmt.wire_mask(bits) for bits, name in fmt.BITS_INTEGERS.items()}
_WIDTHS = {np.dtype(name): bits for bits, name in fmt.BITS_INTEGERS.items()}
_NARROW_MASK = fmt.wire_mask(16)
_BF16_MASK = fmt.wire_mask(fmt.WIRE_DTYPES["bfloat16"].bits)

# checksum2's weights of positions [0, N), kept for the pair passes: a position's weights never change,
# and every tensor's positions start at 0 (a rank's share at its rows' offset), so a model's live check
# hashes the same positions at every publish. Read back from the caches they cost about half what
# hashing them does (on the 2-vCPU machine, one thread over a 76 M-element model in float32: 27 against
# 46 ms). Capped at 4 Mi positions (32 MiB); positions past the table are hashed as before.
_WEIGHT_TABLE_MAX = 1 << 22
_weight_table: tuple[np.ndarray, np.ndarray] = (np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.uint32))
_weight_table_lock = threading.Lock()


def _weights_table(positions: int) -> tuple[np.ndarray, np.ndarray]:
    """The kept weight tables, grown (once, up to the cap) to cover positions [0, ``positions``)."""
    global _weight_table
    want = min(positions, _WEIGHT_TABLE_MAX)
    with _weight_table_lock:
        if _weight_table[0].shape[0] < want:
            wa, wb = np.empty(want, dtype=np.uint32), np.empty(want, dtype=np.uint32)
            _hash_weights(np.uint32(0), np.uint32(0), want, wa, wb)  # positions below 2**32: high hash 0
            _weight_table = (wa, wb)
        return _weight_table


def checksum_cpu(bits_N: torch.Tensor, offset: int = 0) -> int:
    """:func:`~rltune.sync.kernels.reference.checksum_ref` in one compiled pass over a CPU bits tensor.

    The reference builds int64 temporaries (unsigned value, positions, products) for every element:
    ~30 ns an element on a two-core machine, a 76 M-element model's live check ~2.5 s. This walks
    the bits once and sums modulo 2^64 in uint64 (~0.2 ns an element). Equal to the reference bit
    for bit (tests/sync/test_kernels.py).
    """
    view, mask = _view_and_mask(bits_N, "checksum_cpu")
    return int(_checksum_bits(view, int(offset), mask))


def _view_and_mask(bits_N: torch.Tensor, caller: str) -> tuple[np.ndarray, int]:
    view = bits_N.reshape(-1).numpy()
    mask = _MASKS.get(view.dtype)
    if mask is None:
        raise TypeError(f"{caller} takes int16, int32 or uint8 bits, not {view.dtype}")
    return view, mask


def checksum2_cpu(bits_N: torch.Tensor, offset: int = 0) -> int:
    """:func:`~rltune.sync.kernels.reference.checksum2_ref` in one compiled pass over a CPU bits tensor
    (the reference's int64 temporaries cost as much as the position-weighted sum's)."""
    return checksum_pairs_cpu([bits_N], [offset], threads=1)[0][1]


def checksum_pairs_cpu(bits: list[torch.Tensor], offsets: list[int], threads: int | None = None,
                       bf16_of_f32: list[bool] | None = None) -> list[tuple[int, int]]:
    """``(checksum, checksum2)`` of each CPU bits tensor, both from one compiled pass over it.

    ``bf16_of_f32[j]``: ``bits[j]`` holds float32 weights whose wire bits are their bfloat16 cast (fp32
    master weights sent as bf16): the pass rounds each element as torch's cast does, so no cast copy is
    made (on the 2-vCPU machine, casting a 76 M-element model cost more than checksumming it).
    checksum2's position hash is compute bound here (~0.5 ns an element on one of this machine's cores,
    against ~0.1 ns for checksum alone), so with ``threads`` > 1 the tensors are split between this
    thread and a second one (:func:`apply_threads`); the pass holds no GIL.
    """
    from rltune.sync.kernels.reference import checksum2_pack

    as_bf16 = bf16_of_f32 or [False] * len(bits)
    jobs = []
    for t, f32 in zip(bits, as_bf16, strict=True):
        if f32:
            if t.dtype != torch.float32:
                raise TypeError(f"checksum_pairs_cpu: bf16_of_f32 takes float32 tensors, not {t.dtype}")
            jobs.append((t.detach().reshape(-1).view(torch.int32).numpy(), _F32_AS_BF16, _BF16_MASK))
        else:
            view, mask = _view_and_mask(t, "checksum_pairs_cpu")
            jobs.append((view, _WIDE_BITS if mask > _NARROW_MASK else _NARROW_BITS, mask))
    out: list[tuple[int, int]] = [(0, 0)] * len(jobs)
    sizes = [view.shape[0] for view, _, _ in jobs]
    # only passes worth a second thread keep a table (a few tiny tensors hash faster than one is made)
    reach = max((int(o) + n for o, n in zip(offsets, sizes, strict=True) if int(o) < _WEIGHT_TABLE_MAX), default=0)
    table_a, table_b = _weights_table(reach) if sum(sizes) >= _PARALLEL_MIN_ELEMENTS else _weight_table

    def run(chosen: list[int]) -> None:
        for j in chosen:
            view, kind, mask = jobs[j]
            c, a, b = _pair_lanes(view, int(offsets[j]), kind, mask, table_a, table_b)
            out[j] = (int(c), checksum2_pack(int(a), int(b)))

    _split_two(sizes, run, threads, _PARALLEL_MIN_ELEMENTS)
    return out


@numba.njit(cache=True, nogil=True)
def _span_lanes(idx_C, old_C, new_C, starts, ends, out_a, out_b):
    # per span [start, end) of changes: the sums of fold(w * d), d = (u_new mod P) + P - (u_old mod P)
    # in [1, 2P) (w * d < 2**62, a folded term < 2**32), as kernels.reference.checksum2_contributions_ref;
    # a span of fewer than 2**31 changes sums below 2**63
    p = np.uint64(_P31)
    m32 = np.int64(0xFFFFFFFF)
    for s in range(starts.shape[0]):
        a = np.uint64(0)
        b = np.uint64(0)
        for j in range(starts[s], ends[s]):
            wa, wb = _weights2(np.uint64(idx_C[j]))
            d = _mod_p(np.uint64(np.int64(new_C[j]) & m32)) + p - _mod_p(np.uint64(np.int64(old_C[j]) & m32))
            a += _fold(wa * d)
            b += _fold(wb * d)
        out_a[s] = a % p
        out_b[s] = b % p


def checksum2_span_changes_cpu(idx_C: torch.Tensor, old_C: torch.Tensor, new_C: torch.Tensor,
                               spans: list[tuple[int, int]]) -> list[int]:
    """The packed checksum2 change of each span ``[a, b)`` of one step's changes (CPU tensors: int64
    indices, int32 unsigned old and new bits), as :func:`~rltune.sync.kernels.reference.checksum2_update_ref`
    of each span, in one compiled pass: the reference's int64 temporaries cost ~35-80 ns a change on
    a two-core machine, a publisher's 3 M changes a step 0.1-0.24 s."""
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    ends = np.array([b for _, b in spans], dtype=np.int64)
    out_a, out_b = np.zeros(len(spans), dtype=np.uint64), np.zeros(len(spans), dtype=np.uint64)
    _span_lanes(idx_C.numpy(), old_C.numpy(), new_C.numpy(), starts, ends, out_a, out_b)
    return [(int(a) << 32) | int(b) for a, b in zip(out_a, out_b, strict=True)]


@numba.njit(cache=True, nogil=True)
def _count_changed(old_N, new_N):
    n = 0
    for i in range(old_N.shape[0]):
        n += old_N[i] != new_N[i]
    return n


@numba.njit(cache=True, nogil=True)
def _extract_changed(old_N, new_N, offset, mask, idx_C, new_C, old_C):
    # the changed elements in order: absolute index, new and old unsigned bits (int32 patterns), and
    # sum (idx + 1) * (u_new - u_old) mod 2**64 (kernels.reference.checksum_update_ref)
    j = 0
    change = np.uint64(0)
    for i in range(old_N.shape[0]):
        if old_N[i] != new_N[i]:
            u_old = np.int64(old_N[i]) & mask
            u_new = np.int64(new_N[i]) & mask
            idx_C[j] = offset + i
            new_C[j] = u_new
            old_C[j] = u_old
            change += np.uint64(offset + i + 1) * np.uint64(u_new - u_old)
            j += 1
    return change


def diff_extract_cpu(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor,
                     offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`~rltune.sync.kernels.reference.diff_extract_ref` in two compiled passes over CPU bits (count,
    then extract): the reference's comparison mask, ``nonzero`` and gathers cost ~1-2 ns an element."""
    old_view, mask = _view_and_mask(old_bits_N.contiguous(), "diff_extract_cpu")
    new_view = new_bits_N.reshape(-1).contiguous().numpy()
    n = int(_count_changed(old_view, new_view))
    idx_C, new_C, old_C = np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.int32)
    change = _extract_changed(old_view, new_view, int(offset), mask, idx_C, new_C, old_C)
    return torch.from_numpy(idx_C), torch.from_numpy(new_C), torch.from_numpy(old_C), int(change)


_POOL: ThreadPoolExecutor | None = None
_PARALLEL_MIN_CHANGES = 1 << 16  # below this a second thread costs more than it saves
_PARALLEL_MIN_ELEMENTS = 1 << 20  # the same for the checksums' passes


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rltune-cpu-kernels")
    return _POOL


def apply_threads() -> int:
    """Threads of the compiled passes: ``RLTUNE_APPLY_THREADS``, else two when the machine has two cores."""
    return int(os.environ.get("RLTUNE_APPLY_THREADS", "0")) or min(2, os.cpu_count() or 1)


def _split_two(sizes: list[int], run, threads: int | None, min_total: int) -> None:
    """``run(items)`` over every item, on this thread and the pool's when ``threads`` > 1 and there is
    enough work: each thread takes the largest item left until none is, so a thread whose core other
    work shares takes fewer (two fixed halves made the pass wait for the slower core)."""
    threads = apply_threads() if threads is None else threads
    if threads < 2 or sum(sizes) < min_total or len(sizes) < 2:
        run(list(range(len(sizes))))
        return
    order = sorted(range(len(sizes)), key=lambda j: -sizes[j])
    taken = iter(order)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                j = next(taken, None)
            if j is None:
                return
            run([j])

    second = _pool().submit(work)
    try:
        work()
    finally:
        second.result()


def apply_deltas_cpu(targets: list[torch.Tensor], layouts: list[dict], entry_tensor_E: torch.Tensor,
                     entry_offsets_E1: torch.Tensor, idx_C: torch.Tensor, val_C: torch.Tensor,
                     add: bool, threads: int | None = None, mix: bool = False) -> tuple[list[int], ...]:
    """:func:`~rltune.sync.kernels.reference.apply_deltas_ref`'s contract, compiled: per entry the
    running-checksum change (mod 2^64), the number of changes written and, with ``mix``, the packed
    checksum2 change.

    A sparse patch waits on memory, one cache line per change: each entry's loop prefetches the
    target 32 changes ahead (measured on two cores: ~12 ns a change at 0.5 % density, ~60 ns without
    the prefetch). With ``threads`` > 1 (default: two when the machine has two cores) the entries are
    split between this thread and a second one; the kernel holds no GIL and entries write disjoint
    elements. ``RLTUNE_APPLY_THREADS`` overrides the default (:func:`apply_threads`).
    """
    return _run_entries(targets, layouts, entry_tensor_E, entry_offsets_E1, idx_C, val_C, add, threads, mix, None)


def stage_deltas_cpu(targets: list[torch.Tensor], layouts: list[dict], entry_tensor_E: torch.Tensor,
                     entry_offsets_E1: torch.Tensor, idx_C: torch.Tensor, val_C: torch.Tensor,
                     add: bool, threads: int | None = None,
                     mix: bool = False) -> tuple[tuple[list[int], ...], torch.Tensor, torch.Tensor]:
    """:func:`apply_deltas_cpu` without its writes: the same sums, from the same reads, and per change
    the target position (-1 where this worker holds no such element) and the bits the write stores.

    :func:`store_staged_cpu` then makes the writes. Together they equal :func:`apply_deltas_cpu` bit for
    bit as long as the targets do not change in between and no two changes of the delta land on one
    element (an index map gives every checkpoint element one place and every place one element).
    A CPU engine stages while it serves, so that its pause holds only the stores.
    """
    n = idx_C.numel()
    pos_C, new_C = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int32)
    sums = _run_entries(targets, layouts, entry_tensor_E, entry_offsets_E1, idx_C, val_C, add, threads, mix,
                        (pos_C, new_C))
    return sums, torch.from_numpy(pos_C), torch.from_numpy(new_C)


def store_staged_cpu(targets: list[torch.Tensor], layouts: list[dict], entry_tensor_E: torch.Tensor,
                     entry_offsets_E1: torch.Tensor, pos_C: torch.Tensor, new_C: torch.Tensor,
                     threads: int | None = None) -> None:
    """The writes of a patch :func:`stage_deltas_cpu` staged (entries split over two threads as the apply's)."""
    pos, new = pos_C.numpy(), new_C.numpy()
    offsets = entry_offsets_E1.tolist()
    views = [t.reshape(-1).numpy() for t in targets]
    entries = entry_tensor_E.tolist()

    def run(chosen: list[int]) -> None:
        for e in chosen:
            a, b = offsets[e], offsets[e + 1]
            _store_entry(views[layouts[entries[e]]["target"]], pos[a:b], new[a:b])

    _split_two([offsets[e + 1] - offsets[e] for e in range(len(entries))], run, threads, _PARALLEL_MIN_CHANGES)


def _run_entries(targets, layouts, entry_tensor_E, entry_offsets_E1, idx_C, val_C, add, threads, mix, staged):
    idx = idx_C.to(torch.int64).numpy()
    val = val_C.to(torch.int32).numpy()
    offsets = entry_offsets_E1.tolist()
    views = [t.reshape(-1).numpy() for t in targets]
    widths = [_WIDTHS[v.dtype] for v in views]
    entries = entry_tensor_E.tolist()
    checksums, written, mixes = [0] * len(entries), [0] * len(entries), [0] * len(entries)
    write = staged is None

    def run(chosen: list[int]) -> None:
        for e in chosen:
            lay = layouts[entries[e]]
            target = lay["target"]
            tables = lay.get("row_table") is not None
            rt = lay["row_table"].numpy() if tables else _EMPTY_TABLE
            ct = lay["col_table"].numpy() if tables else _EMPTY_TABLE
            a, b = offsets[e], offsets[e + 1]
            pos_out, new_out = (_NO_POS, _NO_NEW) if write else (staged[0][a:b], staged[1][a:b])
            s, n, la, lb = _apply_entry(views[target], idx[a:b], val[a:b], widths[target], lay["ncols"], lay["base"],
                                        lay["row_stride"], lay["col_stride"], lay["row_window"][0],
                                        lay["row_window"][1], lay["col_window"][0], lay["col_window"][1], rt, ct,
                                        tables, add, views[target].dtype != np.uint8, mix, write, pos_out, new_out)
            checksums[e], written[e], mixes[e] = int(s), int(n), (int(la) << 32) | int(lb)

    _split_two([offsets[e + 1] - offsets[e] for e in range(len(entries))], run, threads, _PARALLEL_MIN_CHANGES)
    return (checksums, written, mixes) if mix else (checksums, written)
