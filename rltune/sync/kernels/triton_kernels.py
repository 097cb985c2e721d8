"""Triton kernels of weight sync: full checksum, diff/extract, fused multi-tensor apply, positional apply.

Each kernel has its torch oracle in :mod:`rltune.sync.kernels.reference` and is compared with it
bit for bit. Call them through :mod:`rltune.sync.kernels` (dispatch, argument checks); the launch
helpers here assume checked arguments.

Legend of shape suffixes: ``_N`` one per element of a flat tensor (chunk), ``_C`` one per change,
``_E`` one per delta entry, ``_P`` one per program (grid block).

Conventions every kernel keeps:

- Wire bits are read through a signed integer view and masked to their unsigned value
  (``MASK`` = 0xFF, 0xFFFF or 0xFFFFFFFF); checksums are int64 arithmetic, whose wrap-around is
  exactly the checksum's ring (mod 2**64), so atomics and partial sums in any order give the same
  bits as the reference.
- Sizes, offsets and counts are ``tl.int64`` parameters listed in ``do_not_specialize``: one compile
  per dtype/width, never one per delta, chunk or size (a recompile inside the engine pause took
  0.7-2 s in the seed's runs).
"""

import os

import numpy as np
import torch
import triton
import triton.language as tl

# Launch settings: the fastest of bench/sync_kernels.py's sweep (section 'tune') on the H200.
# Elements per checksum program: BLOCK lanes x TILES tiles. With 16-bit elements the per-lane
# accumulators sum_t u (<= TILES * 2^16) and sum_t t * u (<= 2^16 * TILES^2 / 2) stay below 2^31
# for TILES <= 128, so the inner loop is int32 only.
CHECKSUM_BLOCK = 512
CHECKSUM_TILES = 32
CHECKSUM_WARPS = 4

DIFF_ROWS = 256  # 32-element rows (one change word each) per diff block
DIFF_WARPS = 4
DIFF_COPY = 128  # changes per copy iteration of pass 2
DIFF_TILE = 64  # diff blocks per tile counter (pass 2 sums the counters before its own tile)
APPLY_BLOCK = 512  # the fastest in 4 of the 5 sweeps of 2026-11-30
APPLY_WARPS = 4

# Columns of the per-checkpoint-tensor layout table used by the fused apply kernel.
LAYOUT_FIELDS = ("target", "ncols", "base", "row_stride", "col_stride", "row_lo", "row_hi", "col_lo", "col_hi",
                 "row_table", "col_table", "width")
LAYOUT_COLUMNS = len(LAYOUT_FIELDS)



def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class Launch:
    """A JIT kernel launched straight from its compiled form, looked up once per argument signature.

    Triton's launch binds and specialises every argument on every call: 56 us of host time for the
    fused apply's 16 arguments on the H200's host, against 7 us for torch's ``index_put_``, and all
    of it inside the engine pause before the kernel starts. This keeps the compiled kernel per
    signature that Triton specialises these kernels on (the device, each tensor's dtype and 16-byte
    alignment, the constexpr values, the launch options) and runs it directly; a new signature goes through
    Triton's launch once (which compiles if it must). Every other parameter must be an annotated
    integer in the kernel's ``do_not_specialize``, so its value never changes the compiled code:
    checked here. Under the interpreter it is Triton's launch.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.constexpr: list[bool] | None = None
        if _interpreted():  # an interpreted function: nothing is compiled
            return
        self.constexpr = [p.is_constexpr for p in kernel.params]
        loose = [p.name for p in kernel.params
                 if not p.is_constexpr and p.annotation and not p.do_not_specialize]
        if loose:
            raise TypeError(f"{kernel.__name__}: {loose} would be specialised on their values; "
                            "list them in do_not_specialize")

    def __call__(self, grid: tuple[int, ...], *args, **options):
        if self.constexpr is None:
            return self.kernel[grid](*args, **options)
        # the current device first: a compiled kernel is loaded on one device, as Triton's own cache keys it
        key = (torch.cuda.current_device(),) + tuple(
            value if constexpr else (value.dtype, value.data_ptr() % 16 == 0)
            if isinstance(value, torch.Tensor) else type(value)
            for value, constexpr in zip(args, self.constexpr, strict=True)) + tuple(options.items())
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](*args, **options)
        else:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args)


# ------------------------------------------------------------------------------------------ checksum


@triton.jit(do_not_specialize=["n", "offset"])
def _checksum_kernel(bits_ptr, partial_P_ptr, n: tl.int64, offset: tl.int64, MASK: tl.constexpr,
                     BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * TILES)
    lane = tl.arange(0, BLOCK)
    left = n - base
    ptr = bits_ptr + base
    if MASK <= 0xFFFF:
        # weight of element (t, j) = (offset + base + 1) + t * BLOCK + j
        acc_u = tl.zeros([BLOCK], dtype=tl.int32)
        acc_tu = tl.zeros([BLOCK], dtype=tl.int32)
        if left >= BLOCK * TILES:
            # a full program: unmasked loads (vectorised; a mask on the unspecialised size is not)
            for t in tl.static_range(TILES):
                u = tl.load(ptr + t * BLOCK + lane).to(tl.int32) & MASK
                acc_u += u
                acc_tu += t * u
        else:
            for t in range(TILES):
                offs = t * BLOCK + lane
                u = tl.load(ptr + offs, mask=offs < left, other=0).to(tl.int32) & MASK
                acc_u += u
                acc_tu += t * u
        acc_u64 = acc_u.to(tl.int64)
        total = (offset + base + 1) * tl.sum(acc_u64, axis=0) + BLOCK * tl.sum(acc_tu.to(tl.int64), axis=0) \
            + tl.sum(lane.to(tl.int64) * acc_u64, axis=0)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for t in range(TILES):
            offs = t * BLOCK + lane
            u = tl.load(ptr + offs, mask=offs < left, other=0).to(tl.int64) & MASK
            acc += (offset + base + 1 + offs) * u
        total = tl.sum(acc, axis=0)
    tl.store(partial_P_ptr + pid, total)


_CHECKSUM = Launch(_checksum_kernel)


def checksum_partials(bits_N: torch.Tensor, offset: int, mask: int) -> torch.Tensor:
    """Per-program partial checksums (int64, on the tensor's device); their wrapped sum is the checksum."""
    n = bits_N.numel()
    per_program = CHECKSUM_BLOCK * CHECKSUM_TILES
    programs = max(1, triton.cdiv(n, per_program))
    partial_P = torch.empty(programs, dtype=torch.int64, device=bits_N.device)
    _CHECKSUM((programs,), bits_N, partial_P, n, offset, mask, CHECKSUM_BLOCK, CHECKSUM_TILES, num_warps=CHECKSUM_WARPS)
    return partial_P


# ----------------------------------------------------------------------------------- checksum2
#
# The second checksum (reference: kernels.reference.checksum2_ref): each element weighed by a hash of
# its position, two lanes modulo P = 2**31 - 1. A GPU has no 64-bit integer ALU: every 64-bit
# operation is several 32-bit instructions and a 64-bit remainder a long emulated sequence, which
# made these kernels ALU-bound. So the hash is uint32 arithmetic (as it is defined), a weight times
# a value is one 32 x 32 -> 64-bit product, no remainder is ever taken (P is a Mersenne prime:
# 2**31 = 1 mod P, so x = (x & P) + (x >> 31) mod P by shifts and adds), and a sum is reduced as
# late as its bound allows. Each lane is the same residue mod P as the reference's.

P31 = tl.constexpr((1 << 31) - 1)
_SHIFT_BY_MULTIPLY = tl.constexpr(not _interpreted())


@triton.jit
def _shr(x, S: tl.constexpr):
    # x >> S of uint32 x; on a GPU the high word of x * 2**(32 - S) (mul.hi). The hash's xors and
    # shifts all queue for the integer ALU while the multiply pipe, with its two products, is idle
    # more than half the time (sm_90 SASS of the full pass on bf16, per element: 19 ALU and 8
    # multiply-pipe instructions with shifts, 15 and 13 with mul.hi). Inline asm, as LLVM turns a
    # multiply-high by a power of two back into a shift.
    if _SHIFT_BY_MULTIPLY:
        return tl.inline_asm_elementwise("mul.hi.u32 $0, $1, $2;", "=r,r,r",
                                         [x, tl.full(x.shape, 1 << (32 - S), tl.uint32)], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        return x >> S


@triton.jit
def _mix32(x):
    # uint32 values: the products wrap mod 2**32, as the finaliser is defined
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * 0x846CA68B
    return x ^ _shr(x, 16)


@triton.jit
def _weights2(idx):
    # (wa, wb) in [1, 2**30] (uint32) of flat positions idx >= 0 (int64): its low and high words
    h = _mix32(idx.to(tl.uint32) ^ ((idx >> 32).to(tl.uint32) * 0x9E3779B9))
    return (h & 0x3FFFFFFF) + 1, (_mix32(h ^ 0x5BD1E995) & 0x3FFFFFFF) + 1


@triton.jit
def _fold(x):
    # a uint32 congruent to x mod P, for 0 <= x < 2**62: (x & P) + (x >> 31) < 2**31 + 2**31
    return (x & P31).to(tl.uint32) + (x >> 31).to(tl.uint32)


@triton.jit
def _mod_p(x):
    # x mod P for 0 <= x < 2**62: a fold to below 2**32, a second in 32 bits to <= P, one subtraction
    f = _fold(x)
    f = (f & P31) + (f >> 31)
    return tl.where(f >= P31, f - P31, f)


@triton.jit
def _checksum2_tile(raw, idx, acc_a, acc_b, MASK: tl.constexpr):
    # adds the lane terms of one tile (raw: the elements' signed bit views, 0 past the end) at positions idx
    u = (raw.to(tl.int32).to(tl.uint32, bitcast=True) & MASK).to(tl.uint64)
    wa, wb = _weights2(idx)
    if MASK <= 0xFFFF:  # u < 2**16: w * u < 2**46, summed as it is
        acc_a += wa.to(tl.uint64) * u
        acc_b += wb.to(tl.uint64) * u
    else:  # u < 2**32 (congruent to u mod P, all a lane needs): w * u < 2**62, folded below 2**32
        acc_a += _fold(wa.to(tl.uint64) * u)
        acc_b += _fold(wb.to(tl.uint64) * u)
    return acc_a, acc_b


@triton.jit(do_not_specialize=["n", "offset", "programs"])
def _checksum2_kernel(bits_ptr, partial_2P_ptr, n: tl.int64, offset: tl.int64, programs: tl.int64,
                      MASK: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
    # Unreduced uint64 lane sums: a term is below 2**46 (16-bit or narrower elements) or 2**32 (folded
    # 32-bit ones), so a program's BLOCK * TILES <= 2**16 terms stay below 2**62 and never wrap; each
    # program stores its lanes mod P.
    tl.static_assert(BLOCK * TILES <= 1 << 16)
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * TILES)
    lane = tl.arange(0, BLOCK)
    left = n - base
    ptr = bits_ptr + base
    first = offset + base
    acc_a = tl.zeros([BLOCK], dtype=tl.uint64)
    acc_b = tl.zeros([BLOCK], dtype=tl.uint64)
    if left >= BLOCK * TILES:  # a full program: unmasked (vectorised) loads
        for t in tl.static_range(TILES):
            acc_a, acc_b = _checksum2_tile(tl.load(ptr + t * BLOCK + lane), first + t * BLOCK + lane, acc_a, acc_b,
                                           MASK)
    else:
        for t in range(TILES):
            offs = t * BLOCK + lane
            acc_a, acc_b = _checksum2_tile(tl.load(ptr + offs, mask=offs < left, other=0), first + offs, acc_a, acc_b,
                                           MASK)
    tl.store(partial_2P_ptr + pid, _mod_p(tl.sum(acc_a, axis=0)).to(tl.int64))
    tl.store(partial_2P_ptr + programs + pid, _mod_p(tl.sum(acc_b, axis=0)).to(tl.int64))


CHECKSUM2_BLOCK = 512
CHECKSUM2_TILES = 16
CHECKSUM2_WARPS = 4
_CHECKSUM2 = Launch(_checksum2_kernel)


def checksum2_partials(bits_N: torch.Tensor, offset: int, mask: int) -> torch.Tensor:
    """Per-program lanes (int64 ``[2, programs]``, each in ``[0, P)``); their sums mod P are the lanes."""
    n = bits_N.numel()
    programs = max(1, triton.cdiv(n, CHECKSUM2_BLOCK * CHECKSUM2_TILES))
    partial_2P = torch.empty(2 * programs, dtype=torch.int64, device=bits_N.device)
    _CHECKSUM2((programs,), bits_N, partial_2P, n, offset, programs, mask, CHECKSUM2_BLOCK, CHECKSUM2_TILES,
               num_warps=CHECKSUM2_WARPS)
    return partial_2P.view(2, programs)


# ------------------------------------------------------------------------------------- diff/extract
#
# Two passes per chunk. Pass 1 reads every element of old and new once and stores, per block of
# ROWS x 32 elements, one 32-bit word per row (its change flags) and the block's count, and adds
# the count to its tile's counter (TILE blocks per tile): per element a compare, a shift and a sum,
# so it runs at read bandwidth. Pass 2 finds where its block's changes start in the output from
# those counts alone (the tiles before its own plus its tile's blocks before it, at most TILES +
# TILE loads), so no prefix-sum kernel runs between the passes. It expands the block's words into
# positions, the lowest set bit of every row at a time (as many rounds as the block's densest row
# has changes), into the block's scratch, then gathers old and new there and writes (index, new,
# old) at the block's offset: contiguous writes, which also suit pinned host memory.
#
# Measured on the H200 (1 GiB, 1 % changed, 64 M-element chunks, same runs): 0.93-0.96 ms, against
# 0.96-1.06 ms with a torch prefix sum between the passes (git 3e614a7); 0.895 ms in the benchmark
# record of git 57febe3. Dropped after measuring: ranking every element in pass 1 and storing its
# position (1.17 ms, git a881989) or its values too (2.2-28 ms); one pass with a decoupled
# look-back (1.39-1.75 ms, git bbb35a1); pass 2 on a second stream (1.0-1.05: pass 1 holds every
# SM), or interleaved with the next chunk's pass 1 in one grid (1.36-1.5); positions found in
# registers by a binary search of the rows' counts instead of the scratch round trip (0.97); more
# rows or fewer warps per pass-2 program (0.92-1.0, within the noise); the expansion moved into
# pass 1 (0.96) or per-row values kept there to skip gathers (0.98): pass 1 sits at read bandwidth
# and each extra reduction slows it more than pass 2 gains. Pass 1 alone takes 0.51-0.60 ms, pass 2
# 0.24-0.29 ms, 0.19 ms of it without any gather (docs/BENCHMARKS.md).


@triton.jit
def _popcount(x, ASM: tl.constexpr):
    # bits set in each int32 of x: the hardware popc on a GPU, SWAR arithmetic in the interpreter
    if ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        v = x.to(tl.int64) & 0xFFFFFFFF
        v = v - ((v >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        return (((v * 0x01010101) & 0xFFFFFFFF) >> 24).to(tl.int32)


@triton.jit
def _block_limit(pid, base, n, block_member_ptr, member_end_ptr, GROUPED: tl.constexpr):
    # elements of this block that belong to its chunk (a packed group's member ends where its padding starts)
    if GROUPED:
        return tl.load(member_end_ptr + tl.load(block_member_ptr + pid)) - base
    else:
        return n - base


@triton.jit(do_not_specialize=["n"])
def _diff_mask_kernel(old_ptr, new_ptr, n: tl.int64, words_ptr, count_P_ptr, tile_T_ptr, block_member_ptr,
                      member_end_ptr, ROWS: tl.constexpr, TILE: tl.constexpr, ASM: tl.constexpr,
                      GROUPED: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (ROWS * 32)
    row = tl.arange(0, ROWS)
    col = tl.arange(0, 32)
    local = row[:, None] * 32 + col[None, :]
    limit = _block_limit(pid, base, n, block_member_ptr, member_end_ptr, GROUPED)
    if limit >= ROWS * 32:  # a full block: unmasked (vector) loads
        old = tl.load(old_ptr + base + local)
        new = tl.load(new_ptr + base + local)
    else:
        valid = local < limit
        old = tl.load(old_ptr + base + local, mask=valid, other=0)
        new = tl.load(new_ptr + base + local, mask=valid, other=0)
    changed = (old != new).to(tl.int32)  # padding lanes load 0 on both sides
    # distinct powers of two: their sum is their OR (bit 31 wraps to the sign, as a 32-bit word should)
    word = tl.sum(changed << col[None, :], axis=1)
    tl.store(words_ptr + pid.to(tl.int64) * ROWS + row, word)
    count = tl.sum(_popcount(word, ASM), axis=0)
    tl.store(count_P_ptr + pid, count)
    if count > 0:
        tl.atomic_add(tile_T_ptr + pid // TILE, count)


@triton.jit(do_not_specialize=["offset", "chunk", "capacity", "programs", "members"])
def _diff_expand_kernel(old_ptr, new_ptr, words_ptr, count_P_ptr, tile_T_ptr, s_pos_ptr, chunk_start_ptr,
                        chunk: tl.int64, offset: tl.int64, out_idx_ptr, out_new_ptr, out_old_ptr, checksum_K_ptr,
                        capacity: tl.int64, programs: tl.int64, block_member_ptr, member_offset_ptr,
                        members: tl.int64, MASK: tl.constexpr, ROWS: tl.constexpr, COPY: tl.constexpr,
                        TILE: tl.constexpr, TILES: tl.constexpr, ASM: tl.constexpr, GROUPED: tl.constexpr):
    # ``start`` is where this chunk (or group) begins in the output (written by the previous one's
    # pass 2, on device). Element i of the chunk is element offset + i of its tensor; each block adds
    # its sum (offset + i + 1) * (new - old) to its chunk's checksum change. A group's member m is
    # output chunk ``chunk + m``, has its own offset, and its first block writes where it starts.
    pid = tl.program_id(0)
    count = tl.load(count_P_ptr + pid)
    tile = pid // TILE
    t = tl.arange(0, TILES)
    b = tile * TILE + tl.arange(0, TILE)
    before = tl.sum(tl.load(tile_T_ptr + t, mask=t < tile, other=0).to(tl.int64), axis=0) \
        + tl.sum(tl.load(count_P_ptr + b, mask=b < pid, other=0).to(tl.int64), axis=0)
    start = tl.load(chunk_start_ptr + chunk)
    if GROUPED:
        member = tl.load(block_member_ptr + pid)
        offset = tl.load(member_offset_ptr + member)
        if member > 0:
            if tl.load(block_member_ptr + pid - 1) != member:
                tl.store(chunk_start_ptr + chunk + member, start + before)
        checksum_ptr = checksum_K_ptr + chunk + member
    else:
        checksum_ptr = checksum_K_ptr + chunk
    if count > 0:
        base = pid.to(tl.int64) * (ROWS * 32)
        row = tl.arange(0, ROWS)
        word = tl.load(words_ptr + pid.to(tl.int64) * ROWS + row)
        per_row = _popcount(word, ASM)
        slot = tl.cumsum(per_row, axis=0) - per_row  # row r's changes go to its exclusive prefix, lowest bit first
        bits = word.to(tl.int64) & 0xFFFFFFFF
        for _ in range(0, tl.max(per_row, axis=0)):
            lowest = bits & -bits
            position = row * 32 + _popcount((lowest - 1).to(tl.int32), ASM)
            tl.store(s_pos_ptr + base + slot, position.to(tl.int16), mask=bits != 0)
            slot += 1
            bits = bits & (bits - 1)
        tl.debug_barrier()  # the positions are read below by other threads of the block
        dst0 = start + before
        lane = tl.arange(0, COPY)
        total = tl.zeros([COPY], dtype=tl.int64)
        for k in range(0, count, COPY):
            j = k + lane
            inside = j < count
            dst = dst0 + j
            fits = inside & (dst < capacity)
            i = base + tl.load(s_pos_ptr + base + j, mask=inside, other=0).to(tl.int64)
            new = tl.load(new_ptr + i, mask=inside, other=0).to(tl.int64) & MASK
            old = tl.load(old_ptr + i, mask=inside, other=0).to(tl.int64) & MASK
            tl.store(out_idx_ptr + dst, i + offset, mask=fits)
            tl.store(out_new_ptr + dst, new.to(tl.int32), mask=fits)
            tl.store(out_old_ptr + dst, old.to(tl.int32), mask=fits)
            total += tl.where(inside, (offset + i + 1) * (new - old), 0)
        tl.atomic_add(checksum_ptr, tl.sum(total, axis=0))
    if pid == programs - 1:
        tl.store(chunk_start_ptr + chunk + members, start + before + count)


_DIFF_MASK = Launch(_diff_mask_kernel)
_DIFF_EXPAND = Launch(_diff_expand_kernel)


def diff_block() -> int:
    """Elements per diff block: a packed group's members start at multiples of it."""
    return DIFF_ROWS * 32


def diff_programs(n: int) -> int:
    return max(1, triton.cdiv(n, diff_block()))


class DiffScratch:
    """Device scratch of diffs over up to ``chunks`` chunks (or packed groups) of up to ``n`` elements
    each: the block's positions (int16, 2 bytes per element), the rows' change words, the blocks'
    counts (reused by every chunk) and one row of tile counters per chunk, which pass 1 adds into:
    zero them with :meth:`reset` before a chunk index is used again."""

    def __init__(self, n: int, device, chunks: int = 1):
        programs = diff_programs(n)
        self.rows, self.tile = DIFF_ROWS, DIFF_TILE
        self.tiles = triton.next_power_of_2(triton.cdiv(programs, DIFF_TILE))
        self.s_pos = torch.empty(programs * diff_block(), dtype=torch.int16, device=device)
        self.words = torch.empty(programs * DIFF_ROWS, dtype=torch.int32, device=device)
        self.count_P = torch.empty(programs, dtype=torch.int32, device=device)
        self.tile_KT = torch.zeros(chunks, self.tiles, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.tile_KT.zero_()


def _diff_tables(n: int, scratch: DiffScratch, chunk_start: torch.Tensor, chunk: int, group, device):
    # (programs, members, block_member, member_end, member_offset) of one diff, its scratch checked
    programs = diff_programs(n)
    members = 1 if group is None else len(group.sizes)
    if scratch.rows != DIFF_ROWS or scratch.tile != DIFF_TILE or programs > scratch.count_P.numel() \
            or chunk >= scratch.tile_KT.shape[0] or chunk + members >= chunk_start.numel():
        raise ValueError(f"diff scratch made for {scratch.count_P.numel()} blocks of {scratch.rows} rows and "
                         f"{scratch.tile_KT.shape[0]} chunks cannot hold chunk {chunk} of {n} elements "
                         f"({programs} blocks of {DIFF_ROWS} rows, {members} members)")
    if group is None:
        return programs, members, scratch.count_P, scratch.count_P, scratch.count_P  # tables unread
    if group.block != diff_block():
        raise ValueError(f"packed group aligned to {group.block} elements, the diff's blocks hold {diff_block()}")
    return (programs, members) + group.tables(device)


def diff_extract_launch(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor, offset: int, mask: int,
                        scratch: DiffScratch, chunk_start: torch.Tensor, chunk: int,
                        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], capacity: int,
                        checksum_K: torch.Tensor, group=None) -> None:
    """Both passes of chunk ``chunk``: writes ``chunk_start[chunk + 1]`` and adds the chunk's checksum
    change to ``checksum_K[chunk]`` (int64, zeroed by the caller), all on device, no host sync. The
    chunk's tile counters (``scratch.tile_KT[chunk]``) must be zero.

    With ``group`` (a :class:`rltune.sync.kernels.PackedGroup` aligned to :func:`diff_block`), ``old_bits_N``
    and ``new_bits_N`` are staging buffers packed as it says (``offset`` is unused) and its members are
    output chunks ``chunk .. chunk + members - 1``: each gets its start, its checksum change and its
    tensor's indices."""
    n = old_bits_N.numel() if group is None else group.n
    programs, _, block_member, member_end, _ = _diff_tables(n, scratch, chunk_start, chunk, group, old_bits_N.device)
    _DIFF_MASK((programs,), old_bits_N, new_bits_N, n, scratch.words, scratch.count_P, scratch.tile_KT[chunk],
               block_member, member_end, DIFF_ROWS, DIFF_TILE, not _interpreted(), group is not None,
               num_warps=DIFF_WARPS)
    diff_expand_launch(old_bits_N, new_bits_N, offset, mask, scratch, chunk_start, chunk, out, capacity, checksum_K,
                       group)


def diff_expand_launch(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor, offset: int, mask: int,
                       scratch: DiffScratch, chunk_start: torch.Tensor, chunk: int,
                       out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], capacity: int,
                       checksum_K: torch.Tensor, group=None) -> None:
    """Pass 2 alone, after a pass 1 (the diff's own or the fused AdamW step's) left the chunk's change
    words, block counts and tile counters in ``scratch``; arguments as :func:`diff_extract_launch`.
    Reads the old and new bits at the changed positions only."""
    n = old_bits_N.numel() if group is None else group.n
    programs, members, block_member, _, member_offset = _diff_tables(n, scratch, chunk_start, chunk, group,
                                                                     old_bits_N.device)
    _DIFF_EXPAND((programs,), old_bits_N, new_bits_N, scratch.words, scratch.count_P, scratch.tile_KT[chunk],
                 scratch.s_pos, chunk_start, chunk, offset, out[0], out[1], out[2], checksum_K, capacity, programs,
                 block_member, member_offset, members, mask, DIFF_ROWS, DIFF_COPY, DIFF_TILE, scratch.tiles,
                 not _interpreted(), group is not None, num_warps=DIFF_WARPS)


# ----------------------------------------------------------------------------------- AdamW + diff pass 1

ADAMW_SUB = 16  # rows of a diff block the fused step handles at once (512 elements, 4 per thread)
ADAMW_WARPS = 4
ADAMW_MEMBER_FIELDS = ("param", "grad", "exp_avg", "exp_avg_sq", "step", "start")  # the member table's columns
ADAMW_MEMBER_COLUMNS = len(ADAMW_MEMBER_FIELDS)


@triton.jit
def _round_to(x, dtype: tl.constexpr, ASM: tl.constexpr):
    # float32 to a parameter's dtype, to nearest even: the hardware conversion on a GPU; under the
    # interpreter (whose bfloat16 conversion does not round to even) integer arithmetic on the bits
    if dtype == tl.float32:
        return x
    elif dtype == tl.bfloat16 and not ASM:
        bits = x.to(tl.int32, bitcast=True)
        up = bits + 0x7FFF + ((bits >> 16) & 1)  # carries into the upper half when past the half-way point
        up = tl.where(x != x, 0x7FC00000, up)  # a NaN stays a NaN (the carry could make it infinity)
        return (up >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _adamw_block(param_ptr, grad_ptr, avg_ptr, sq_ptr, old_ptr, new_ptr, words_ptr, pid, base, end, lr_decay,
                 beta1, beta2, eps, step_size, bias2_sqrt, ROWS: tl.constexpr, SUB: tl.constexpr,
                 ASM: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr, WIRE: tl.constexpr,
                 STAGE_NEW: tl.constexpr, MASKED: tl.constexpr):
    # the block's rows, SUB at a time; the pointers are at the block's first element (staging: base)
    row = tl.arange(0, SUB)
    col = tl.arange(0, 32)
    local = row[:, None] * 32 + col[None, :]
    count = tl.zeros([SUB], dtype=tl.int32)
    for s in tl.range(0, ROWS // SUB):
        at = s * (SUB * 32) + local
        if MASKED:  # the member's last block: past its end, nothing is read or written
            valid = base + at < end
            raw = tl.load(param_ptr + at, mask=valid, other=0)
            g = tl.load(grad_ptr + at, mask=valid, other=0).to(tl.float32)
            avg = tl.load(avg_ptr + at, mask=valid, other=0).to(tl.float32)
            sq = tl.load(sq_ptr + at, mask=valid, other=0).to(tl.float32)
        else:
            raw = tl.load(param_ptr + at)
            g = tl.load(grad_ptr + at).to(tl.float32)
            avg = tl.load(avg_ptr + at).to(tl.float32)
            sq = tl.load(sq_ptr + at).to(tl.float32)
        p = raw.to(tl.float32)
        if MAXIMIZE:
            g = -g
        if DECAY:
            p = tl.fma(-lr_decay, p, p)
        avg = tl.fma(beta1, avg, tl.fma(-beta1, g, g))
        g2 = g * g
        sq = tl.fma(beta2, sq, tl.fma(-beta2, g2, g2))
        denom = tl.div_rn(tl.sqrt_rn(sq), bias2_sqrt) + eps
        p = p - tl.div_rn(step_size * avg, denom)
        stored = _round_to(p, raw.dtype, ASM)
        if MASKED:
            tl.store(param_ptr + at, stored, mask=valid)
            tl.store(avg_ptr + at, _round_to(avg, raw.dtype, ASM), mask=valid)
            tl.store(sq_ptr + at, _round_to(sq, raw.dtype, ASM), mask=valid)
        else:
            tl.store(param_ptr + at, stored)
            tl.store(avg_ptr + at, _round_to(avg, raw.dtype, ASM))
            tl.store(sq_ptr + at, _round_to(sq, raw.dtype, ASM))
        if WIRE == 16:  # 16-bit wire: the parameter's own bits, or float32 rounded to bfloat16
            if raw.dtype == tl.float32:
                old = _round_to(raw, tl.bfloat16, ASM).to(tl.int16, bitcast=True)
                new = _round_to(stored, tl.bfloat16, ASM).to(tl.int16, bitcast=True)
            else:
                old = raw.to(tl.int16, bitcast=True)
                new = stored.to(tl.int16, bitcast=True)
        else:
            old = raw.to(tl.int32, bitcast=True)
            new = stored.to(tl.int32, bitcast=True)
        changed = (old != new).to(tl.int32)  # past the end both sides hold 0
        word = tl.sum(changed << col[None, :], axis=1)
        tl.store(words_ptr + pid.to(tl.int64) * ROWS + s * SUB + row, word)
        keep = (word != 0)[:, None]  # whole rows: the stores stay vectorised
        if MASKED:
            keep = keep & valid
        tl.store(old_ptr + at, old, mask=keep)
        if STAGE_NEW:
            tl.store(new_ptr + at, new, mask=keep)
        count += _popcount(word, ASM)
    return tl.sum(count, axis=0)


@triton.jit(do_not_specialize=["members"])
def _adamw_diff_kernel(param_ptr, grad_ptr, avg_ptr, sq_ptr, member_M_ptr, power_ptr, members: tl.int64,
                       block_member_ptr, member_end_ptr, old_ptr, new_ptr, words_ptr, count_P_ptr, tile_T_ptr,
                       lr, beta1, beta2, lr_decay, eps, ROWS: tl.constexpr, SUB: tl.constexpr,
                       TILE: tl.constexpr, ASM: tl.constexpr, DECAY: tl.constexpr, MAXIMIZE: tl.constexpr,
                       WIRE: tl.constexpr, ALIGN: tl.constexpr, STAGE_NEW: tl.constexpr, COLUMNS: tl.constexpr):
    # One diff block of one member: AdamW as torch's fused CUDA kernel computes it (float32, the
    # same fused multiply-adds, correctly rounded division and square root), then pass 1 of the diff
    # on the old and new wire bits, which never leave registers: each row's change word, the block's
    # count and its tile's counter, as _diff_mask_kernel writes them. Rows with a change also leave
    # their old and new bits in the staging buffers (the group's packed layout) for pass 2's
    # gathers (the new ones unless STAGE_NEW is off: a lone member on its own wire, read in place);
    # other rows write nothing there. Member m's tensors sit at element offsets
    # member_M[m] from the first member's (any allocation; ALIGN: what every offset is a multiple of).
    pid = tl.program_id(0)
    m = tl.load(block_member_ptr + pid).to(tl.int64)
    row_m = member_M_ptr + m * COLUMNS  # the columns of ADAMW_MEMBER_FIELDS
    step = tl.load(row_m + 4)
    start = tl.multiple_of(tl.load(row_m + 5), ROWS * 32)
    end = tl.load(member_end_ptr + m)
    step_size = tl.div_rn(lr, 1.0 - tl.load(power_ptr + step))  # the bias corrections, as torch's 1 - pow
    bias2_sqrt = tl.sqrt_rn(1.0 - tl.load(power_ptr + members + step))
    base = pid.to(tl.int64) * (ROWS * 32)
    rel = base - start  # the block's first element within its member's chunk
    params = param_ptr + tl.multiple_of(tl.load(row_m + 0), ALIGN) + rel
    grads = grad_ptr + tl.multiple_of(tl.load(row_m + 1), ALIGN) + rel
    avgs = avg_ptr + tl.multiple_of(tl.load(row_m + 2), ALIGN) + rel
    sqs = sq_ptr + tl.multiple_of(tl.load(row_m + 3), ALIGN) + rel
    if end - base >= ROWS * 32:
        total = _adamw_block(params, grads, avgs, sqs, old_ptr + base, new_ptr + base, words_ptr, pid, base, end,
                             lr_decay, beta1, beta2, eps, step_size, bias2_sqrt, ROWS, SUB, ASM, DECAY, MAXIMIZE, WIRE,
                             STAGE_NEW, False)
    else:
        total = _adamw_block(params, grads, avgs, sqs, old_ptr + base, new_ptr + base, words_ptr, pid, base, end,
                             lr_decay, beta1, beta2, eps, step_size, bias2_sqrt, ROWS, SUB, ASM, DECAY, MAXIMIZE, WIRE,
                             STAGE_NEW, True)
    tl.store(count_P_ptr + pid, total)
    if total > 0:
        tl.atomic_add(tile_T_ptr + pid // TILE, total)


_ADAMW_DIFF = Launch(_adamw_diff_kernel)


def adamw_diff_launch(tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], member_M: torch.Tensor,
                      powers: torch.Tensor, align: int, hyper: dict, staging: tuple[torch.Tensor, torch.Tensor],
                      scratch: DiffScratch, chunk_start: torch.Tensor, chunk: int, group, wire_bits: int) -> None:
    """Pass 1 of a packed group's diff fused into its AdamW update (see ``_adamw_diff_kernel``).

    ``tensors``: the first member's parameter, gradient and moments (flat chunks); ``member_M``
    (int64, one row of :data:`ADAMW_MEMBER_FIELDS` per member on the device): each member's element
    offsets from them, its column in ``powers`` (float32 ``[2, steps]``: ``beta**step``)
    and its packed start. ``hyper``: lr, betas, weight_decay, eps, maximize. Pass 2 follows with
    :func:`diff_expand_launch` on ``staging`` (new bits None: not staged, pass 2 reads the parameter)."""
    programs, _, block_member, member_end, _ = _diff_tables(group.n, scratch, chunk_start, chunk, group,
                                                            member_M.device)
    lr, (beta1, beta2), decay = float(hyper["lr"]), hyper["betas"], float(hyper["weight_decay"])
    lr_decay = float(np.float32(lr) * np.float32(decay))  # (lr * wd) in float32, as the fused kernel has it
    stage_new = staging[1] is not None
    _ADAMW_DIFF((programs,), *tensors, member_M, powers, powers.shape[1], block_member, member_end, staging[0],
                staging[1] if stage_new else staging[0], scratch.words, scratch.count_P, scratch.tile_KT[chunk], lr,
                float(beta1), float(beta2), lr_decay, float(hyper["eps"]), DIFF_ROWS, ADAMW_SUB, DIFF_TILE,
                not _interpreted(), decay != 0, bool(hyper["maximize"]), wire_bits, align, stage_new,
                ADAMW_MEMBER_COLUMNS, num_warps=ADAMW_WARPS)


# --------------------------------------------------------------------------------------- fused apply


@triton.jit
def _patch(address, pos, held, val, idx, WIDTH: tl.constexpr, ADD: tl.constexpr, MIX: tl.constexpr):
    # write one block of changes in place; return each change's running-checksum contribution and,
    # with MIX, its two checksum2 lane contributions (each folded below 2**32; zeros without MIX)
    if WIDTH == 8:
        ptr = address.to(tl.pointer_type(tl.uint8)) + pos
    elif WIDTH == 16:
        ptr = address.to(tl.pointer_type(tl.int16)) + pos
    else:
        ptr = address.to(tl.pointer_type(tl.int32)) + pos
    old = tl.load(ptr, mask=held, other=0)
    mask_bits = (1 << WIDTH) - 1
    u_old = old.to(tl.int64) & mask_bits
    if ADD:
        u_new = (u_old + val.to(tl.int64)) & mask_bits
    else:
        u_new = val.to(tl.int64) & mask_bits
    tl.store(ptr, u_new.to(old.dtype), mask=held)
    c1 = tl.where(held, (idx + 1) * (u_new - u_old), 0)
    if MIX:
        v_old = u_old.to(tl.uint32)
        v_new = u_new.to(tl.uint32)
        if WIDTH == 32:  # narrower values are below P already
            v_old = _mod_p(v_old)
            v_new = _mod_p(v_new)
        d = (v_new + (P31 - v_old)).to(tl.uint64)  # in [1, 2P), below 2**32: w * d < 2**62
        wa, wb = _weights2(idx)
        la = tl.where(held, _fold(wa.to(tl.uint64) * d), 0).to(tl.int64)
        lb = tl.where(held, _fold(wb.to(tl.uint64) * d), 0).to(tl.int64)
    else:
        la = c1 * 0
        lb = c1 * 0
    return c1, la, lb


@triton.jit
def _find_entry(entry_offsets_ptr, j, n_entries, search_steps):
    # largest e with entry_offsets[e] <= j (binary search, invariant lo <= e < hi); j scalar or block
    lo = j * 0
    hi = j * 0 + n_entries
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go_right = tl.load(entry_offsets_ptr + mid) <= j
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit(do_not_specialize=["n_changes", "n_entries", "search_steps"])
def _apply_deltas_kernel(idx_C_ptr, val_C_ptr, n_changes: tl.int64, entry_offsets_ptr, entry_tensor_ptr,
                         n_entries: tl.int64, search_steps: tl.int32, layout_ptr, table_ptr, address_ptr,
                         checksum_E_ptr, written_E_ptr, mix_a_E_ptr, mix_b_E_ptr, WIDTH: tl.constexpr,
                         ADD: tl.constexpr, MIX: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr):
    # MIX: also the checksum2 lanes per entry (each block's sum, below BLOCK * 2**32, reduced mod P
    # before its atomic, so an entry's int64 sum stays exact for any number of blocks)
    pid = tl.program_id(0)
    j0 = pid.to(tl.int64) * BLOCK
    j = j0 + tl.arange(0, BLOCK)
    live = j < n_changes
    if j0 + BLOCK <= n_changes:  # a full block: unmasked (vector) loads of indices and values
        idx = tl.load(idx_C_ptr + j).to(tl.int64)
        val = tl.load(val_C_ptr + j)
    else:
        idx = tl.load(idx_C_ptr + j, mask=live, other=0).to(tl.int64)
        val = tl.load(val_C_ptr + j, mask=live, other=0)
    if j0 < n_changes:  # a launch with no changes (the compile at plan build) touches nothing
        # the entries of the block's first and last change, in one search (two lanes, one dependent chain)
        ends = _find_entry(entry_offsets_ptr, j0 + tl.arange(0, 2) * (tl.minimum(j0 + BLOCK, n_changes) - 1 - j0),
                           n_entries, search_steps)
        first = tl.min(ends, axis=0)
        last = tl.max(ends, axis=0)
        row0 = tl.load(entry_tensor_ptr + first) * COLUMNS
        ncols0 = tl.load(layout_ptr + row0 + 1)
        contiguous = (first == last) & (tl.load(layout_ptr + row0 + 9) < 0) & (tl.load(layout_ptr + row0 + 3) == ncols0) \
            & (tl.load(layout_ptr + row0 + 4) == 1) & (tl.load(layout_ptr + row0 + 7) == 0) \
            & (tl.load(layout_ptr + row0 + 8) == ncols0) & (tl.load(layout_ptr + row0 + 11) == WIDTH)
        if contiguous:
            # common case: the whole block is one entry whose held rows are contiguous: no search, no division
            one_base = tl.load(layout_ptr + row0 + 2)
            one_held = live & (idx >= tl.load(layout_ptr + row0 + 5) * ncols0) & (idx < tl.load(layout_ptr + row0 + 6) * ncols0)
            one_address = tl.load(address_ptr + tl.load(layout_ptr + row0 + 0))
            one_contribution, one_a, one_b = _patch(one_address, one_base + idx, one_held, val, idx, WIDTH, ADD, MIX)
            tl.atomic_add(checksum_E_ptr + first, tl.sum(one_contribution, axis=0))
            tl.atomic_add(written_E_ptr + first, tl.sum(one_held.to(tl.int64), axis=0))
            if MIX:
                tl.atomic_add(mix_a_E_ptr + first, _mod_p(tl.sum(one_a, axis=0)).to(tl.int64))
                tl.atomic_add(mix_b_E_ptr + first, _mod_p(tl.sum(one_b, axis=0)).to(tl.int64))
        else:
            entry = _find_entry(entry_offsets_ptr, tl.where(live, j, 0), n_entries, search_steps)
            row = tl.load(entry_tensor_ptr + entry, mask=live, other=0) * COLUMNS
            target = tl.load(layout_ptr + row + 0, mask=live, other=0)
            ncols = tl.load(layout_ptr + row + 1, mask=live, other=1)
            base = tl.load(layout_ptr + row + 2, mask=live, other=0)
            row_table = tl.load(layout_ptr + row + 9, mask=live, other=-1)
            col_table = tl.load(layout_ptr + row + 10, mask=live, other=-1)
            width = tl.load(layout_ptr + row + 11, mask=live, other=0)
            r = idx // ncols
            c = idx - r * ncols
            tabled = row_table >= 0
            strided = live & (row_table < 0)
            # strides: base + r * row_stride + c * col_stride inside the held window
            row_stride = tl.load(layout_ptr + row + 3, mask=strided, other=0)
            col_stride = tl.load(layout_ptr + row + 4, mask=strided, other=0)
            row_lo = tl.load(layout_ptr + row + 5, mask=strided, other=0)
            row_hi = tl.load(layout_ptr + row + 6, mask=strided, other=0)
            col_lo = tl.load(layout_ptr + row + 7, mask=strided, other=0)
            col_hi = tl.load(layout_ptr + row + 8, mask=strided, other=0)
            held_strided = (r >= row_lo) & (r < row_hi) & (c >= col_lo) & (c < col_hi)
            # tables: base + rows[r] + cols[c], -1 = not held
            row_off = tl.load(table_ptr + row_table + r, mask=live & tabled, other=-1)
            col_off = tl.load(table_ptr + col_table + c, mask=live & tabled, other=-1)
            held_tabled = (row_off >= 0) & (col_off >= 0)
            pos = tl.where(tabled, base + row_off + col_off, base + r * row_stride + c * col_stride)
            held = live & (width == WIDTH) & tl.where(tabled, held_tabled, held_strided)
            address = tl.load(address_ptr + target, mask=held, other=0)
            contribution, mix_a, mix_b = _patch(address, pos, held, val, idx, WIDTH, ADD, MIX)
            written = held.to(tl.int64)
            # per-entry reduction: one atomic for the block's first entry, one per change for any other entry
            in_first = live & (entry == first)
            tl.atomic_add(checksum_E_ptr + first, tl.sum(tl.where(in_first, contribution, 0), axis=0))
            tl.atomic_add(written_E_ptr + first, tl.sum(tl.where(in_first, written, 0), axis=0))
            others = live & (entry != first)
            tl.atomic_add(checksum_E_ptr + entry, contribution, mask=others)
            tl.atomic_add(written_E_ptr + entry, written, mask=others)
            if MIX:  # a change's lane value is < 2**32 and an entry is "other" in at most one block
                tl.atomic_add(mix_a_E_ptr + first, _mod_p(tl.sum(tl.where(in_first, mix_a, 0), axis=0)).to(tl.int64))
                tl.atomic_add(mix_b_E_ptr + first, _mod_p(tl.sum(tl.where(in_first, mix_b, 0), axis=0)).to(tl.int64))
                tl.atomic_add(mix_a_E_ptr + entry, mix_a, mask=others)
                tl.atomic_add(mix_b_E_ptr + entry, mix_b, mask=others)


_APPLY_DELTAS = Launch(_apply_deltas_kernel)


def apply_deltas_launch(idx_C: torch.Tensor, val_C: torch.Tensor, entry_offsets_E1: torch.Tensor,
                        entry_tensor_E: torch.Tensor, layout: torch.Tensor, tables: torch.Tensor,
                        addresses: torch.Tensor, checksum_E: torch.Tensor, written_E: torch.Tensor, width: int,
                        add: bool, mix_a_E: torch.Tensor | None = None, mix_b_E: torch.Tensor | None = None) -> None:
    """One fused apply; with ``mix_a_E``/``mix_b_E`` (int64, zeroed) it also adds each entry's checksum2
    lane changes there (sums of values < 2**32; the lanes are those sums mod P)."""
    n_changes = idx_C.numel()
    n_entries = entry_tensor_E.numel()
    steps = max(1, int(n_entries).bit_length())
    programs = max(1, triton.cdiv(n_changes, APPLY_BLOCK))
    mix = mix_a_E is not None
    _APPLY_DELTAS((programs,), idx_C, val_C, n_changes, entry_offsets_E1, entry_tensor_E, n_entries, steps, layout,
                  tables, addresses, checksum_E, written_E, mix_a_E if mix else checksum_E,
                  mix_b_E if mix else checksum_E, width, add, mix, LAYOUT_COLUMNS, APPLY_BLOCK,
                  num_warps=APPLY_WARPS)


# ---------------------------------------------------------------------------------- positional apply


@triton.jit(do_not_specialize=["n_changes"])
def _apply_positions_kernel(target_ptr, pos_C_ptr, diff_C_ptr, ckpt_idx_C_ptr, n_changes: tl.int64,
                            partial_P_ptr, MASK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < n_changes
    pos = tl.load(pos_C_ptr + j, mask=live, other=0)
    old = tl.load(target_ptr + pos, mask=live, other=0)
    u_old = old.to(tl.int64) & MASK
    u_new = (u_old + tl.load(diff_C_ptr + j, mask=live, other=0).to(tl.int64)) & MASK
    tl.store(target_ptr + pos, u_new.to(old.dtype), mask=live)
    weight = tl.load(ckpt_idx_C_ptr + j, mask=live, other=0).to(tl.int64) + 1
    tl.store(partial_P_ptr + pid, tl.sum(tl.where(live, weight * (u_new - u_old), 0), axis=0))


def apply_positions_launch(target_bits_N: torch.Tensor, pos_C: torch.Tensor, diff_C: torch.Tensor,
                           ckpt_idx_C: torch.Tensor, mask: int) -> torch.Tensor:
    n = pos_C.numel()
    programs = max(1, triton.cdiv(n, APPLY_BLOCK))
    partial_P = torch.empty(programs, dtype=torch.int64, device=target_bits_N.device)
    _apply_positions_kernel[(programs,)](target_bits_N, pos_C, diff_C, ckpt_idx_C, n, partial_P, MASK=mask,
                                         BLOCK=APPLY_BLOCK, num_warps=4)
    return partial_P


KERNELS = {
    "checksum": _checksum_kernel,
    "checksum2": _checksum2_kernel,
    "diff_mask": _diff_mask_kernel,
    "diff_expand": _diff_expand_kernel,
    "apply_deltas": _apply_deltas_kernel,
    "apply_positions": _apply_positions_kernel,
}


def compiled_variants(kernel) -> int:
    """How many compiled variants a JIT kernel holds (all devices); 0 under the interpreter."""
    caches = getattr(kernel, "device_caches", None)
    if not caches:
        return 0
    return sum(len(entry[0]) for entry in caches.values())
