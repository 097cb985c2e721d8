"""Triton kernels of the GPU encoder (:mod:`rltune.sync.codec_gpu`): bit-field packing and rANS lanes.

Their oracle is the host codec (:mod:`rltune.sync.codec`): the GPU encoder's bytes are compared
with ``codec.encode`` byte for byte, under ``TRITON_INTERPRET=1`` in CI and at real sizes on a GPU.

Legend of shape suffixes: ``_F`` one per bit field, ``_W`` one per 64-bit word of a bit stream,
``_B`` one per codec block, ``_BL`` one per (block, lane), ``_N`` one per symbol.
"""

import torch
import triton
import triton.language as tl

FIELDS_BLOCK = 1024
HIST_BINS = 128  # >= codec.N_SYMBOLS_MAX; the last bin collects the padding lanes
HIST_CHUNK = 1024
LANES = 32  # codec.MAX_LANES: one vector lane per rANS lane of a block


@triton.jit(do_not_specialize=["n"])
def _write_fields_kernel(words_W_ptr, value_F_ptr, nbits_F_ptr, bitpos_F_ptr, n: tl.int64, BLOCK: tl.constexpr):
    # Each field: ``nbits`` <= 40 low bits of ``value`` at bit ``bitpos`` of a little-endian stream
    # (LSB first, as the host's _put_bits). Fields never overlap, so OR-ing them into the words in any
    # order gives the host's bytes; a field spans at most two 64-bit words.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    nbits = tl.load(nbits_F_ptr + i, mask=live, other=0).to(tl.int64)
    value = tl.load(value_F_ptr + i, mask=live, other=0) & ((tl.full([BLOCK], 1, tl.int64) << nbits) - 1)
    bitpos = tl.load(bitpos_F_ptr + i, mask=live, other=0)
    word = bitpos >> 6
    off = bitpos & 63
    some = live & (nbits > 0)
    tl.atomic_or(words_W_ptr + word, value << off, mask=some)
    spill = some & (off + nbits > 64)
    tl.atomic_or(words_W_ptr + word + 1, value >> tl.where(spill, 64 - off, 0), mask=spill)


def write_fields(words_W, value_F, nbits_F, bitpos_F) -> None:
    """OR every field into ``words_W`` (int64, zeroed by the caller)."""
    n = value_F.numel()
    if n:
        _write_fields_kernel[(triton.cdiv(n, FIELDS_BLOCK),)](words_W, value_F, nbits_F, bitpos_F, n,
                                                              BLOCK=FIELDS_BLOCK, num_warps=4)


@triton.jit
def _segment_histogram_kernel(sym_N_ptr, bounds_S1_ptr, out_S_ptr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    # symbol counts of segment s = symbols bounds[s] .. bounds[s + 1]; one program per segment
    s = tl.program_id(0).to(tl.int64)
    lo = tl.load(bounds_S1_ptr + s)
    hi = tl.load(bounds_S1_ptr + s + 1)
    acc = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(lo, hi, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        acc += tl.histogram(tl.load(sym_N_ptr + i, mask=i < hi, other=BINS - 1), BINS)
    tl.store(out_S_ptr + s * BINS + tl.arange(0, BINS), acc)


def segment_histograms(sym_N, bounds_S1):
    """``[segments, HIST_BINS]`` int32 symbol counts per segment (contiguous, ``bounds_S1`` int64 on the
    device); bin ``HIST_BINS - 1`` is padding, not a symbol."""
    segments = bounds_S1.numel() - 1
    out = torch.empty((max(segments, 0), HIST_BINS), dtype=torch.int32, device=sym_N.device)
    if segments > 0:
        _segment_histogram_kernel[(segments,)](sym_N, bounds_S1, out, BINS=HIST_BINS, CHUNK=HIST_CHUNK, num_warps=4)
    return out


@triton.jit(do_not_specialize=["scale_bits"])
def _rans_lanes_kernel(sym_N_ptr, start_B_ptr, count_B_ptr, lanes_B_ptr, region_B_ptr, room_B_ptr, freq_ptr, cum_ptr,
                       out_ptr, begin_BL_ptr, scale_bits: tl.int64, SYMBOLS: tl.constexpr, LANES: tl.constexpr,
                       RANS_L: tl.constexpr):
    # One program per block, one vector lane per rANS lane: lane l codes symbols l, l + n_lanes, ...
    # from the last to the first (rANS runs backwards), writing its bytes backwards from the end of its
    # room (2 bytes per symbol at most, plus the 4-byte final state, as the host coder's scratch);
    # begin_BL gets where its bytes start inside its room.
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(start_B_ptr + b)
    n = tl.load(count_B_ptr + b)
    n_lanes = tl.load(lanes_B_ptr + b)
    room = tl.load(room_B_ptr + b)
    lane = tl.arange(0, LANES).to(tl.int64)
    active = lane < n_lanes
    per_lane = tl.where(active, (n - 1 - lane) // n_lanes + 1, 0)  # symbols of each lane
    area = out_ptr + tl.load(region_B_ptr + b) + lane * room
    p = tl.zeros([LANES], tl.int64) + room
    x = tl.full([LANES], RANS_L, tl.int64)
    table = b * SYMBOLS
    last = (n - 1) // n_lanes
    for t in range(0, last + 1):
        m = last - t
        live = active & (m < per_lane)
        s = tl.load(sym_N_ptr + start + lane + m * n_lanes, mask=live, other=0).to(tl.int64)
        f = tl.load(freq_ptr + table + s, mask=live, other=1)
        c = tl.load(cum_ptr + table + s, mask=live, other=0)
        x_max = ((RANS_L >> scale_bits) << 8) * f
        for _ in tl.static_range(2):  # x < 2^31 and x_max >= 2^16: at most two bytes out
            emit = live & (x >= x_max)
            p = tl.where(emit, p - 1, p)
            tl.store(area + p, (x & 0xFF).to(tl.uint8), mask=emit)
            x = tl.where(emit, x >> 8, x)
        x = tl.where(live, ((x // f) << scale_bits) + (x % f) + c, x)
    for byte in tl.static_range(4):
        tl.store(area + p - 4 + byte, ((x >> (8 * byte)) & 0xFF).to(tl.uint8), mask=active)
    tl.store(begin_BL_ptr + b * LANES + lane, p - 4, mask=active)


def rans_lanes(sym_N, start_B, count_B, lanes_B, region_B, room_B, freq_BS, cum_BS, out, begin_BL, scale_bits: int,
               rans_l: int) -> None:
    """rANS-code every lane of every block (see the kernel): block b's lane l writes inside
    ``out[region_B[b] + l * room_B[b]:][:room_B[b]]`` (uint8); all int64 tables on the device."""
    blocks = start_B.numel()
    if blocks:
        _rans_lanes_kernel[(blocks,)](sym_N, start_B, count_B, lanes_B, region_B, room_B, freq_BS, cum_BS, out,
                                      begin_BL, scale_bits, SYMBOLS=freq_BS.shape[1], LANES=LANES, RANS_L=rans_l,
                                      num_warps=1)
