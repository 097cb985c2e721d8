"""Near-entropy codec for one tensor's changes: (flat indices, wire-bit differences) <-> bytes.

The byte layout is specified in docs/delta-format.md ("Codec stream"). Per block of up to 65536
changes: index gaps are Rice-coded (near-optimal for the geometric gaps of Bernoulli positions) and
zigzagged value differences are rANS-coded with the block's own static frequency table over up to
32 interleaved lanes. Blocks are independent and lanes decode in parallel, which is what a GPU
decoder needs. A tensor whose changed fraction makes a *dense* stream (a value for every element,
no positions) smaller goes dense.

A *plain* stream (``mode="plain"``) is the same changes without entropy coding: each change's
position as a fixed-width offset and its difference as a ``bits``-wide integer, ~6 B a change for
bf16 against ~1.2 B when 1-3 % of the elements change, but written and read at memory speed instead
of ~30 ns a change each way. It is for engines on the trainer's host, where the bytes sit in the
page cache and the coder's time is most of the cost.

The coder loops run under numba (``@njit(cache=True, nogil=True)``); the block framing is plain Python.
Because blocks are independent and the coder releases the GIL, :func:`encode_many` encodes the
blocks of many tensors on a thread pool (``RLTUNE_ENCODE_THREADS``, default: the CPUs this process
may use, at most 32), with the same bytes as :func:`encode` of each.

Example::

    import numpy as np
    from rltune.sync import codec
    idx = np.array([3, 10, 11], dtype=np.int64)          # flat indices, ascending, unique
    diff = np.array([1, -1, 2], dtype=np.int64)          # (new - old) wire bits, signed
    blob = codec.encode(idx, diff, bits=16, start=0, stop=100)
    idx2, diff2 = codec.decode(blob, start=0, stop=100)  # validated against the range
    bound = codec.order0_bound_bytes(100, diff)           # the entropy bound the codec is measured against
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from rltune.sync.format import CodecError

MODE_SPARSE = 1
MODE_DENSE = 2
MODE_PLAIN = 3
MODES = ("auto", "sparse", "dense", "plain")
BLOCK_CHANGES = 65536
MAX_LANES = 32
SYMBOLS_PER_LANE = 2048  # fewer lanes for small blocks, so lane headers stay negligible
SCALE_BITS = 15
RANS_L = 1 << 23
N_DIRECT = 64  # zigzag values below this are their own symbol
N_SYMBOLS_MAX = N_DIRECT + 26  # + one bucket per bit length 7..32
RICE_ESCAPE_Q = 32
RICE_RAW_BITS = 40
_STREAM = struct.Struct("<BBHIQQQ")  # mode, bits, reserved, n_blocks, n_changes, start, stop
_BLOCK_FIXED = struct.Struct("<IQBBBB")  # count, first, rice_k, n_lanes, scale_bits, n_symbols


# ----------------------------------------------------------------------------------------------
# numba kernels (int64 everywhere: numba promotes mixed uint64/int64 to float)


@numba.njit(cache=True, nogil=True)
def _put_bits(buf, pos, value, nbits):
    while nbits > 0:
        off = pos & 7
        take = min(8 - off, nbits)
        buf[pos >> 3] |= np.uint8((value & ((np.int64(1) << take) - 1)) << off)
        value >>= take
        pos += take
        nbits -= take
    return pos


@numba.njit(cache=True, nogil=True)
def _get_bits(buf, pos, nbits):
    value = np.int64(0)
    shift = 0
    while nbits > 0:
        off = pos & 7
        take = min(8 - off, nbits)
        value |= ((np.int64(buf[pos >> 3]) >> off) & ((np.int64(1) << take) - 1)) << shift
        shift += take
        pos += take
        nbits -= take
    return value


@numba.njit(cache=True, nogil=True)
def _rice_cost_bits(gaps, k):
    total = np.int64(0)
    for g in gaps:
        q = g >> k
        total += (RICE_ESCAPE_Q + RICE_RAW_BITS) if q >= RICE_ESCAPE_Q else q + 1 + k
    return total


@numba.njit(cache=True, nogil=True)
def _append_bits(buf, out, acc, pending, value, nbits):
    # ``value`` (already masked to nbits <= 40) goes above the ``pending`` bits of ``acc``; whole
    # bytes are stored at buf[out...]. At most 7 + 40 bits are held: far from the sign bit.
    acc |= value << pending
    pending += nbits
    while pending >= 8:
        buf[out] = np.uint8(acc & 0xFF)
        out += 1
        acc >>= 8
        pending -= 8
    return out, acc, pending


@numba.njit(cache=True, nogil=True)
def _rice_encode(gaps, k, buf):
    # The bits _put_bits would write (LSB first), gathered in a 64-bit accumulator, stored a byte at a time.
    acc = np.int64(0)
    pending = np.int64(0)
    out = np.int64(0)
    low = (np.int64(1) << k) - 1
    for g in gaps:
        q = g >> k
        if q >= RICE_ESCAPE_Q:
            out, acc, pending = _append_bits(buf, out, acc, pending, (np.int64(1) << RICE_ESCAPE_Q) - 1, RICE_ESCAPE_Q)
            out, acc, pending = _append_bits(buf, out, acc, pending, g & ((np.int64(1) << RICE_RAW_BITS) - 1),
                                             RICE_RAW_BITS)
        else:
            # q ones and the terminating zero, then the k low bits
            out, acc, pending = _append_bits(buf, out, acc, pending, (np.int64(1) << q) - 1, q + 1)
            out, acc, pending = _append_bits(buf, out, acc, pending, g & low, k)
    if pending > 0:
        buf[out] = np.uint8(acc & 0xFF)
        out += 1
    return out


@numba.njit(cache=True, nogil=True)
def _rice_decode(buf, n_gaps, k, first, stop, out):
    """Fill out[0..n_gaps] with indices; return 0, or a negative error code."""
    total_bits = np.int64(buf.shape[0]) * 8
    pos = np.int64(0)
    prev = first
    out[0] = first
    for j in range(1, n_gaps + 1):
        q = 0
        while True:
            if pos >= total_bits:
                return -1
            bit = (buf[pos >> 3] >> (pos & 7)) & 1
            pos += 1
            if bit == 0:
                break
            q += 1
            if q == RICE_ESCAPE_Q:
                break
        if q == RICE_ESCAPE_Q:
            if pos + RICE_RAW_BITS > total_bits:
                return -1
            g = _get_bits(buf, pos, RICE_RAW_BITS)
            pos += RICE_RAW_BITS
        else:
            if pos + k > total_bits:
                return -1
            g = (np.int64(q) << k) | _get_bits(buf, pos, k)
            pos += k
        prev = prev + g + 1
        if prev >= stop:
            return -2
        out[j] = prev
    if (pos + 7) >> 3 != buf.shape[0] or _get_bits(buf, pos, (8 - (pos & 7)) & 7) != 0:
        return -3  # the stream must end in its last byte, padded with zero bits
    return 0


@numba.njit(cache=True, nogil=True)
def _symbolize(zz, syms, extra):
    """Symbols of zigzag values; large values' low bits go to the ``extra`` bit stream."""
    pos = np.int64(0)
    for j in range(zz.shape[0]):
        z = zz[j]
        if z < N_DIRECT:
            syms[j] = z
        else:
            nb = 0
            t = z
            while t > 0:
                nb += 1
                t >>= 1
            syms[j] = N_DIRECT + nb - 7
            pos = _put_bits(extra, pos, z - (np.int64(1) << (nb - 1)), nb - 1)
    return (pos + 7) >> 3


@numba.njit(cache=True, nogil=True)
def _desymbolize(syms, extra, zz):
    total_bits = np.int64(extra.shape[0]) * 8
    pos = np.int64(0)
    for j in range(syms.shape[0]):
        s = np.int64(syms[j])
        if s < N_DIRECT:
            zz[j] = s
        else:
            nb = s - N_DIRECT + 7
            if pos + nb - 1 > total_bits:
                return -1
            zz[j] = (np.int64(1) << (nb - 1)) | _get_bits(extra, pos, nb - 1)
            pos += nb - 1
    if (pos + 7) >> 3 != extra.shape[0] or _get_bits(extra, pos, (8 - (pos & 7)) & 7) != 0:
        return -3
    return 0


@numba.njit(cache=True, nogil=True)
def _rans_encode(syms, n_lanes, freq, cum, scale_bits, out, lane_lens):
    n = syms.shape[0]
    per_lane = (n + n_lanes - 1) // n_lanes
    tmp = np.empty(per_lane * 2 + 8, dtype=np.uint8)
    o = 0
    x_max_unit = (RANS_L >> scale_bits) << 8
    for lane in range(n_lanes):
        x = np.int64(RANS_L)
        p = tmp.shape[0]
        j = lane + ((n - 1 - lane) // n_lanes) * n_lanes
        while j >= lane:
            s = syms[j]
            f = np.int64(freq[s])
            x_max = x_max_unit * f
            while x >= x_max:
                p -= 1
                tmp[p] = x & 0xFF
                x >>= 8
            x = ((x // f) << scale_bits) + (x % f) + cum[s]
            j -= n_lanes
        p -= 4
        tmp[p] = x & 0xFF
        tmp[p + 1] = (x >> 8) & 0xFF
        tmp[p + 2] = (x >> 16) & 0xFF
        tmp[p + 3] = (x >> 24) & 0xFF
        size = tmp.shape[0] - p
        out[o:o + size] = tmp[p:]
        lane_lens[lane] = size
        o += size
    return o


@numba.njit(cache=True, nogil=True)
def _rans_decode(buf, lane_lens, n, n_lanes, freq, cum, lookup, scale_bits, out):
    mask = (np.int64(1) << scale_bits) - 1
    off = np.int64(0)
    for lane in range(n_lanes):
        end = off + lane_lens[lane]
        if lane_lens[lane] < 4 or end > buf.shape[0]:
            return -1
        x = (np.int64(buf[off]) | (np.int64(buf[off + 1]) << 8) | (np.int64(buf[off + 2]) << 16)
             | (np.int64(buf[off + 3]) << 24))
        p = off + 4
        j = lane
        while j < n:
            slot = x & mask
            s = lookup[slot]
            x = np.int64(freq[s]) * (x >> scale_bits) + slot - cum[s]
            while x < RANS_L:
                if p >= end:
                    return -1
                x = (x << 8) | np.int64(buf[p])
                p += 1
            out[j] = s
            j += n_lanes
        if p != end or x != RANS_L:
            return -4
        off = end
    if off != buf.shape[0]:
        return -3
    return 0


# ----------------------------------------------------------------------------------------------
# numpy helpers


def zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64, copy=False)
    return (d << 1) ^ (d >> 63)


def unzigzag(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.int64, copy=False)
    return (z >> 1) ^ -(z & 1)


def normalize_freqs_rows(counts_BS: np.ndarray, scale_bits: int) -> np.ndarray:
    """Each row's symbol counts scaled to sum to ``2**scale_bits`` (every used symbol keeps >= 1); the
    largest symbol (the first, on ties) absorbs the rounding (<= 90 units). Also the GPU encoder's."""
    counts_BS = counts_BS.astype(np.int64)
    m = 1 << scale_bits
    f = np.where(counts_BS > 0, np.maximum(1, (counts_BS * m) // counts_BS.sum(axis=1, keepdims=True)), 0)
    f[np.arange(f.shape[0]), np.argmax(f, axis=1)] += m - f.sum(axis=1)
    return f


def rice_candidates(mean_gap: float, hi: int = RICE_RAW_BITS - 1) -> range:
    """The Rice parameters worth costing for gaps of this mean (the block coder's and the dense
    estimate's, which allows ``hi`` past the raw width). Also the GPU encoder's."""
    k0 = max(0, int(math.log2(mean_gap + 1.0)))
    return range(max(0, k0 - 1), min(hi, k0 + 2) + 1)


def _varint(values: np.ndarray) -> bytes:
    out = bytearray()
    for v in values.tolist():
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _read_varints(data: memoryview, pos: int, count: int) -> tuple[np.ndarray, int]:
    vals = np.zeros(count, dtype=np.int64)
    for i in range(count):
        v = shift = 0
        while True:
            if pos >= len(data) or shift > 21:
                raise CodecError("frequency table runs past its block or holds a value over 2^21")
            b = data[pos]
            pos += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        vals[i] = v
    return vals, pos


def _encode_block(first: int, gaps: np.ndarray | None, zz: np.ndarray) -> bytes:
    count = zz.shape[0]
    rice_k, gap_bytes = 0, b""
    if gaps is not None and gaps.shape[0]:
        rice_k = min(rice_candidates(float(gaps.mean())), key=lambda k: _rice_cost_bits(gaps, k))
        buf = np.zeros((_rice_cost_bits(gaps, rice_k) + 7) // 8 + 8, dtype=np.uint8)
        gap_bytes = buf[:_rice_encode(gaps, rice_k, buf)].tobytes()
    syms = np.empty(count, dtype=np.uint8)
    extra = np.zeros(count * 4 + 8, dtype=np.uint8)
    extra_bytes = extra[:_symbolize(zz, syms, extra)].tobytes()
    counts = np.bincount(syms, minlength=1)
    freq = normalize_freqs_rows(counts[None, :], SCALE_BITS)[0]
    cum = np.concatenate(([0], np.cumsum(freq)[:-1])).astype(np.int64)
    n_lanes = max(1, min(MAX_LANES, count // SYMBOLS_PER_LANE))
    out = np.empty(count * 2 + 8 * n_lanes, dtype=np.uint8)
    lane_lens = np.zeros(n_lanes, dtype=np.uint32)
    used = _rans_encode(syms, n_lanes, freq, cum, SCALE_BITS, out, lane_lens)
    return b"".join((
        _BLOCK_FIXED.pack(count, first, rice_k, n_lanes, SCALE_BITS, freq.shape[0]),
        _varint(freq),
        struct.pack("<I", len(gap_bytes)), gap_bytes,
        struct.pack("<I", len(extra_bytes)), extra_bytes,
        lane_lens.astype("<u4").tobytes(), out[:used].tobytes(),
    ))


def _block_bytes(task: tuple) -> bytes:
    mode, idx_seg, zz_seg, first = task
    if mode == MODE_SPARSE:
        return _encode_block(int(idx_seg[0]), np.diff(idx_seg) - 1, zz_seg)
    return _encode_block(first, None, zz_seg)


def _frame(mode: int, bits: int, start: int, stop: int, n: int, blocks: list[bytes]) -> bytes:
    offsets = np.zeros(len(blocks) + 1, dtype="<u8")
    offsets[1:] = np.cumsum([len(b) for b in blocks])
    return b"".join([_STREAM.pack(mode, bits, 0, len(blocks), n, start, stop), offsets.tobytes(), *blocks])


def _plain_index_dtype(start: int, stop: int) -> str:
    """A plain stream's offset width: u32 while the range fits, else u64 (the reader derives the same)."""
    return "<u4" if stop - start <= 1 << 32 else "<u8"


@numba.njit(cache=True, nogil=True)
def _plain_pack(idx, diff, start, stop, lim, offsets_out, values_out):
    # one pass: check what _checked checks (0: fine, 1: positions, 2: differences) and write both arrays
    prev = start - 1
    for j in range(idx.shape[0]):
        i = idx[j]
        d = diff[j]
        if i <= prev or i >= stop:
            return 1
        if d == 0 or d < -lim or d >= lim:
            return 2
        offsets_out[j] = i - start
        values_out[j] = d
        prev = i
    return 0


_BAD_INDICES = "indices must be unique, ascending and inside [start, stop)"
_BAD_DIFFERENCES = "differences must be non-zero and inside [-2^{b}, 2^{b})"
_PLAIN_CHECK_ERRORS = {1: _BAD_INDICES, 2: _BAD_DIFFERENCES}


def _plain_stream(idx: np.ndarray, diff: np.ndarray, bits: int, start: int, stop: int) -> bytes:
    """A plain stream, checked as :func:`_checked` checks and written in one compiled pass into the
    stream's own buffer (the numpy form, a pass per check and per cast, cost ~4 ns a change)."""
    idx, diff = _change_arrays(idx, diff, bits)
    n = idx.shape[0]
    index_dtype, value_dtype = np.dtype(_plain_index_dtype(start, stop)), np.dtype(f"<i{bits // 8}")
    out = np.empty(_STREAM.size + n * (index_dtype.itemsize + value_dtype.itemsize), dtype=np.uint8)
    _STREAM.pack_into(out, 0, MODE_PLAIN, bits, 0, 0, n, start, stop)
    values_at = _STREAM.size + n * index_dtype.itemsize
    offsets = out[_STREAM.size:values_at].view(index_dtype)
    values = out[values_at:].view(value_dtype)
    err = _plain_pack(idx, diff, np.int64(start), np.int64(stop), np.int64(1 << (bits - 1)), offsets, values)
    if err:
        raise ValueError(_PLAIN_CHECK_ERRORS[err].format(b=bits - 1))
    return out.tobytes()


def _change_arrays(idx: np.ndarray, diff: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous int64 positions and differences of one range, of a width a stream can code (ValueError)."""
    if bits not in (8, 16, 32):
        raise ValueError(f"bits must be 8, 16 or 32, got {bits}")
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    diff = np.ascontiguousarray(diff, dtype=np.int64)
    if idx.shape != diff.shape or idx.ndim != 1 or idx.shape[0] == 0:
        raise ValueError("encode needs equal-length, non-empty 1-D idx and diff")
    return idx, diff


def _checked(idx: np.ndarray, diff: np.ndarray, bits: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """One range's changes as contiguous int64 arrays, checked (ValueError) as every mode needs them."""
    idx, diff = _change_arrays(idx, diff, bits)
    if idx[0] < start or idx[-1] >= stop or (idx.shape[0] > 1 and np.any(np.diff(idx) <= 0)):
        raise ValueError(_BAD_INDICES)
    lim = 1 << (bits - 1)
    if np.any(diff == 0) or diff.min() < -lim or diff.max() >= lim:
        raise ValueError(_BAD_DIFFERENCES.format(b=bits - 1))
    return idx, diff


def _plan_stream(idx: np.ndarray, diff: np.ndarray, bits: int, start: int, stop: int,
                 mode: str) -> tuple[tuple[int, int, int, int, int], list[tuple]]:
    """Check one range's changes and cut them into block tasks; returns (frame header args, tasks)."""
    idx, diff = _checked(idx, diff, bits, start, stop)
    zz = zigzag(diff)
    if mode == "auto":
        mode = "dense" if _dense_is_smaller(idx, zz, stop - start) else "sparse"
    if mode == "sparse":
        n = zz.shape[0]
        tasks = [(MODE_SPARSE, idx[b0:b0 + BLOCK_CHANGES], zz[b0:b0 + BLOCK_CHANGES], 0)
                 for b0 in range(0, n, BLOCK_CHANGES)]
        return (MODE_SPARSE, bits, start, stop, n), tasks
    dense_zz = np.zeros(stop - start, dtype=np.int64)
    dense_zz[idx - start] = zz
    n = dense_zz.shape[0]
    tasks = [(MODE_DENSE, None, dense_zz[b0:b0 + BLOCK_CHANGES], start + b0) for b0 in range(0, n, BLOCK_CHANGES)]
    return (MODE_DENSE, bits, start, stop, n), tasks


def encode(idx: np.ndarray, diff: np.ndarray, bits: int, start: int, stop: int, mode: str = "auto") -> bytes:
    """Encode changes of one tensor range ``[start, stop)``.

    ``idx``: ascending unique int64 flat indices inside the range; ``diff``: the signed wire-bit
    difference ``new - old`` of each (``rltune.sync.ops.wire_diff``). ``mode``: "sparse", "dense" or
    "auto" (the smaller of the two when the changed fraction makes dense plausible), all entropy
    coded; or "plain" (fixed-width positions and values, no coder).
    """
    return encode_many([(idx, diff, bits, start, stop)], threads=1, mode=mode)[0]


_POOL: ThreadPoolExecutor | None = None
_POOL_THREADS = 0


def encode_threads() -> int:
    """Threads :func:`encode_many` uses: ``RLTUNE_ENCODE_THREADS`` or the CPUs this process may use (<= 32)."""
    env = os.environ.get("RLTUNE_ENCODE_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"RLTUNE_ENCODE_THREADS must be a positive integer, got {env!r}") from None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, cpus))


def _pool(threads: int) -> ThreadPoolExecutor:
    """The codec's thread pool, rebuilt when the thread count changes."""
    global _POOL, _POOL_THREADS
    if _POOL is None or _POOL_THREADS != threads:
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL, _POOL_THREADS = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rltune-codec"), threads
    return _POOL


def encode_many(jobs: Sequence[tuple[np.ndarray, np.ndarray, int, int, int]], threads: int | None = None,
                mode: str = "auto") -> list[bytes]:
    """:func:`encode` of each ``(idx, diff, bits, start, stop)``, every block of every job on a thread pool.

    Blocks are independent and the coder releases the GIL, so a step's encoding scales with the
    host's cores; the bytes equal ``[encode(*job) for job in jobs]``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "plain":  # no coder: each job checked and copied out in one pass at memory speed
        return [_plain_stream(*job) for job in jobs]
    threads = encode_threads() if threads is None else max(1, threads)
    if threads == 1 or len(jobs) < 2 and sum(len(job[0]) for job in jobs) <= BLOCK_CHANGES:
        planned = [_plan_stream(*job, mode=mode) for job in jobs]
        blocks = [_block_bytes(t) for _, job_tasks in planned for t in job_tasks]
    else:
        pool = _pool(threads)
        # checks and zigzag per job, then the blocks of all jobs: both on the pool
        planned = list(pool.map(lambda job: _plan_stream(*job, mode=mode), jobs))
        blocks = list(pool.map(_block_bytes, [t for _, job_tasks in planned for t in job_tasks]))
    out, at = [], 0
    for header, job_tasks in planned:
        out.append(_frame(*header, blocks[at:at + len(job_tasks)]))
        at += len(job_tasks)
    return out


def _entropy_bits(counts: np.ndarray) -> float:
    counts = counts[counts > 0]
    total = counts.sum()
    return float(-(counts * np.log2(counts / total)).sum())


def _dense_is_smaller(idx: np.ndarray, zz: np.ndarray, numel: int) -> bool:
    """Estimate both streams' sizes (entropy of their symbols + Rice bits) instead of coding both."""
    k = idx.shape[0]
    if k * 16 < numel:  # below 1/16 changed the positions are far cheaper than coding every zero
        return False
    syms = np.minimum(zz, N_DIRECT)  # large values cost the same extra bits either way
    counts = np.bincount(syms, minlength=N_DIRECT + 1)
    gaps = np.diff(idx) - 1
    rice = min(_rice_cost_bits(gaps, kk) for kk in rice_candidates(float(gaps.mean()), hi=99)) if gaps.shape[0] else 0
    return dense_beats_sparse(counts, rice, numel, k)


def dense_beats_sparse(counts: np.ndarray, rice_bits: int, numel: int, changes: int) -> bool:
    """The sparse/dense choice from the symbol counts of the changes (``min(zz, N_DIRECT)``, N_DIRECT + 1
    bins) and their Rice bits. Also the GPU encoder's."""
    counts = counts.astype(np.int64)
    sparse_bits = rice_bits + _entropy_bits(counts)
    counts[0] = numel - changes
    dense_bits = _entropy_bits(counts)
    return dense_bits * 1.04 < sparse_bits  # dense pays more block headers and some rANS rounding


def _stream_header(data: memoryview, start: int, stop: int, bits: int | None) -> tuple[int, int, int, int]:
    """(mode, bits, blocks, changes) of a stream's header, checked against its entry's range and bits."""
    if len(data) < _STREAM.size:
        raise CodecError(f"stream of {len(data)} bytes is shorter than its {_STREAM.size}-byte header")
    mode, wbits, reserved, n_blocks, n_changes, s_start, s_stop = _STREAM.unpack_from(data, 0)
    if mode not in (MODE_SPARSE, MODE_DENSE, MODE_PLAIN) or wbits not in (8, 16, 32) or reserved != 0:
        raise CodecError(f"stream header: mode {mode}, bits {wbits}, reserved {reserved} invalid")
    if bits is not None and wbits != bits:
        raise CodecError(f"stream codes {wbits}-bit values, the tensor has {bits}-bit elements")
    if (s_start, s_stop) != (start, stop):
        raise CodecError(f"stream covers [{s_start}, {s_stop}), its entry says [{start}, {stop})")
    if n_changes == 0 or n_changes > stop - start or (mode == MODE_DENSE and n_changes != stop - start):
        raise CodecError(f"stream holds {n_changes} values for range [{start}, {stop}) (mode {mode})")
    return mode, wbits, n_blocks, n_changes


def decode(data: bytes | memoryview, start: int, stop: int, bits: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode a stream into (ascending int64 indices, int64 signed differences).

    Every count and offset is checked against the stream's length and the expected element range
    ``[start, stop)`` before a buffer is allocated; any violation raises :class:`CodecError`.
    """
    data = memoryview(data).cast("B")
    mode, wbits, n_blocks, n_changes = _stream_header(data, start, stop, bits)
    if mode == MODE_PLAIN:
        idx, diff = np.empty(n_changes, dtype=np.int64), np.empty(n_changes, dtype=np.int64)
        _decode_plain(data, wbits, n_blocks, n_changes, start, stop, idx, diff)
        return idx, diff
    if n_blocks != -(-n_changes // BLOCK_CHANGES):
        raise CodecError(f"{n_blocks} blocks cannot hold {n_changes} values")
    table_end = _STREAM.size + 8 * (n_blocks + 1)
    if table_end > len(data):
        raise CodecError("block table runs past the end of the stream")
    offsets = np.frombuffer(data[_STREAM.size:table_end], dtype="<u8").astype(np.int64)
    if offsets[0] != 0 or np.any(np.diff(offsets) <= 0) or table_end + offsets[-1] != len(data):
        raise CodecError("block offsets are not increasing or do not end at the stream's end")
    idx = np.empty(n_changes, dtype=np.int64)
    zz = np.empty(n_changes, dtype=np.int64)
    filled = 0
    for b in range(n_blocks):
        block = data[table_end + offsets[b]:table_end + offsets[b + 1]]
        count = _decode_block(block, mode, start, stop, idx[filled:], zz[filled:], n_changes - filled)
        filled += count
    if filled != n_changes:
        raise CodecError(f"blocks hold {filled} values, header says {n_changes}")
    if mode == MODE_SPARSE:
        if n_blocks > 1 and np.any(np.diff(idx) <= 0):
            raise CodecError("indices of consecutive blocks are not ascending")
        return idx, unzigzag(zz)
    expect = np.arange(start, stop, dtype=np.int64)
    if not np.array_equal(idx, expect):
        raise CodecError("dense blocks do not tile the range in order")
    nz = np.nonzero(zz)[0]
    return idx[nz], unzigzag(zz[nz])


def decode_into(data: bytes | memoryview, start: int, stop: int, bits: int | None, idx_out: np.ndarray,
                val_out: np.ndarray) -> None:
    """:func:`decode` into given arrays: ``idx_out`` (int64) and ``val_out`` (int32: each difference as a
    sign-wrapped 32-bit integer, what the fused apply adds) must hold exactly the stream's changes. A
    plain stream goes through one compiled pass, with no array of its own."""
    data = memoryview(data).cast("B")
    if idx_out.shape[0] != val_out.shape[0]:
        raise ValueError(f"decode_into: {idx_out.shape[0]} positions but {val_out.shape[0]} values to fill")
    mode, wbits, n_blocks, n_changes = _stream_header(data, start, stop, bits)
    if mode == MODE_PLAIN:
        if n_changes != idx_out.shape[0]:
            raise CodecError(f"stream decodes to {n_changes} changes, its entry says {idx_out.shape[0]}")
        _decode_plain(data, wbits, n_blocks, n_changes, start, stop, idx_out, val_out)
        return
    idx, diff = decode(data, start, stop, bits)
    if idx.shape[0] != idx_out.shape[0]:
        raise CodecError(f"stream decodes to {idx.shape[0]} changes, its entry says {idx_out.shape[0]}")
    idx_out[:] = idx
    val_out[:] = ((diff + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def decode_many_into(streams: Sequence[tuple[bytes | memoryview, int, int, int | None]], idx_out: np.ndarray,
                     val_out: np.ndarray, slots: Sequence[tuple[int, int]],
                     threads: int | None = None) -> list[CodecError | None]:
    """:func:`decode_into` of each stream into its slot ``[a, b)`` of ``idx_out`` / ``val_out``: plain streams
    on the calling thread (at memory speed a task on the pool cost more than the stream: 1.6 M changes in
    135 streams took 2.3 ms on one thread, 4-6 ms on two), entropy-coded ones on the encoder's thread
    pool. A stream that does not decode comes back as its :class:`CodecError`, in its place (None for
    the others)."""
    def one(j: int) -> CodecError | None:
        a, b = slots[j]
        try:
            decode_into(*streams[j], idx_out[a:b], val_out[a:b])
        except CodecError as exc:
            return exc
        return None

    threads = encode_threads() if threads is None else max(1, threads)
    coded = [j for j, (data, *_) in enumerate(streams) if len(data) == 0 or memoryview(data)[0] != MODE_PLAIN]
    out: list[CodecError | None] = [None] * len(streams)
    pooled = set(coded) if threads > 1 and len(coded) > 1 else set()
    for j, got in zip(sorted(pooled), _pool(threads).map(one, sorted(pooled)) if pooled else [], strict=True):
        out[j] = got
    for j in range(len(streams)):
        if j not in pooled:
            out[j] = one(j)
    return out


def decode_many(streams: Sequence[tuple[bytes | memoryview, int, int, int | None]],
                threads: int | None = None) -> list[tuple[np.ndarray, np.ndarray] | CodecError]:
    """:func:`decode` of each ``(data, start, stop, bits)``, the streams spread over the encoder's
    thread pool (:func:`encode_threads`; the coder releases the GIL). A stream that does not decode
    comes back as its :class:`CodecError`, in its place, so the caller can name its entry."""
    def one(job):
        try:
            return decode(*job)
        except CodecError as exc:
            return exc

    threads = encode_threads() if threads is None else max(1, threads)
    if threads == 1 or len(streams) < 2:
        return [one(job) for job in streams]
    order = sorted(range(len(streams)), key=lambda j: -len(streams[j][0]))  # the longest first: a short tail
    out: list = [None] * len(streams)
    for j, got in zip(order, _pool(threads).map(one, [streams[j] for j in order]), strict=True):
        out[j] = got
    return out


@numba.njit(cache=True, nogil=True)
def _plain_unpack(offsets_in, values_in, start, span, idx_out, val_out):
    # one pass: positions ascending inside [0, span) (1 otherwise), differences non-zero (2 otherwise)
    prev = np.int64(-1)
    for j in range(offsets_in.shape[0]):
        o = np.int64(offsets_in[j])  # a u64 offset past 2**63 turns negative: not above prev
        d = values_in[j]
        if o <= prev or o >= span:
            return 1
        if d == 0:
            return 2
        idx_out[j] = start + o
        val_out[j] = d
        prev = o
    return 0


def _decode_plain(data: memoryview, bits: int, n_blocks: int, n: int, start: int, stop: int,
                  idx_out: np.ndarray, val_out: np.ndarray) -> None:
    """A plain stream's changes into ``idx_out`` (int64 positions) and ``val_out`` (its differences, in an
    integer dtype at least ``bits`` wide), checked in the same compiled pass."""
    index_dtype = np.dtype(_plain_index_dtype(start, stop))
    value_bytes = bits // 8
    expect = _STREAM.size + n * (index_dtype.itemsize + value_bytes)
    if n_blocks != 0 or len(data) != expect:
        raise CodecError(f"plain stream of {n} changes must be {expect} bytes with 0 blocks, "
                         f"got {len(data)} bytes and {n_blocks} blocks")
    values_at = _STREAM.size + n * index_dtype.itemsize
    offsets = np.frombuffer(data, dtype=index_dtype, count=n, offset=_STREAM.size)
    values = np.frombuffer(data, dtype=f"<i{value_bytes}", count=n, offset=values_at)
    err = _plain_unpack(offsets, values, np.int64(start), np.int64(stop - start), idx_out, val_out)
    if err == 1:
        raise CodecError(f"plain stream positions are not ascending inside [{start}, {stop})")
    if err == 2:
        raise CodecError("plain stream holds a zero difference (a change that changes nothing)")


def _decode_block(block: memoryview, mode: int, start: int, stop: int, idx_out: np.ndarray,
                  zz_out: np.ndarray, remaining: int) -> int:
    if len(block) < _BLOCK_FIXED.size:
        raise CodecError("block shorter than its fixed header")
    count, first, rice_k, n_lanes, scale_bits, n_symbols = _BLOCK_FIXED.unpack_from(block, 0)
    if not 1 <= count <= min(BLOCK_CHANGES, remaining):
        raise CodecError(f"block count {count} outside 1..{min(BLOCK_CHANGES, remaining)}")
    if not (start <= first < stop) or (mode == MODE_DENSE and first + count > stop):
        raise CodecError(f"block first index {first} outside [{start}, {stop})")
    if not 1 <= n_lanes <= min(MAX_LANES, count) or not 10 <= scale_bits <= 15:
        raise CodecError(f"block lanes {n_lanes} / scale_bits {scale_bits} invalid")
    if not 1 <= n_symbols <= N_SYMBOLS_MAX or rice_k >= RICE_RAW_BITS or (mode == MODE_DENSE and rice_k):
        raise CodecError(f"block n_symbols {n_symbols} / rice_k {rice_k} invalid")
    freq, pos = _read_varints(block, _BLOCK_FIXED.size, n_symbols)
    if freq.sum() != 1 << scale_bits:
        raise CodecError(f"frequencies sum to {int(freq.sum())}, not 2^{scale_bits}")
    sections = []
    for _ in range(2):
        if pos + 4 > len(block):
            raise CodecError("block ends inside a section length")
        (size,) = struct.unpack_from("<I", block, pos)
        pos += 4
        if pos + size > len(block):
            raise CodecError("block section runs past the block")
        sections.append(np.frombuffer(block[pos:pos + size], dtype=np.uint8))
        pos += size
    gap_buf, extra_buf = sections
    if pos + 4 * n_lanes > len(block):
        raise CodecError("lane table runs past the block")
    lane_lens = np.frombuffer(block[pos:pos + 4 * n_lanes], dtype="<u4").astype(np.int64)
    pos += 4 * n_lanes
    lanes = np.frombuffer(block[pos:], dtype=np.uint8)
    if int(lane_lens.sum()) != lanes.shape[0]:
        raise CodecError("lane lengths do not add up to the block's remaining bytes")
    if mode == MODE_SPARSE:
        err = _rice_decode(gap_buf, count - 1, rice_k, first, stop, idx_out)
        if err:
            raise CodecError(f"Rice gap stream invalid (code {err}): truncated, padded or an index past {stop}")
    else:
        if gap_buf.shape[0]:
            raise CodecError("dense block carries a gap stream")
        idx_out[:count] = np.arange(first, first + count, dtype=np.int64)
    cum = np.concatenate(([0], np.cumsum(freq)[:-1])).astype(np.int64)
    lookup = np.repeat(np.arange(n_symbols, dtype=np.uint8), freq)
    syms = np.empty(count, dtype=np.uint8)
    err = _rans_decode(lanes, lane_lens, count, n_lanes, freq, cum, lookup, scale_bits, syms)
    if err:
        raise CodecError(f"rANS lanes invalid (code {err}): damaged stream")
    err = _desymbolize(syms, extra_buf, zz_out[:count])
    if err:
        raise CodecError(f"extra-bit stream invalid (code {err})")
    return count


def order0_bound_bytes(numel: int, diff: np.ndarray) -> float:
    """Order-0 entropy bound of a tensor's changes, in bytes.

    Positions as independent Bernoulli draws at the observed density, plus each change's value
    drawn from the empirical distribution of the differences: ``numel * H(k/numel) + k * H(values)``
    bits. A codec that treats positions and values as independent cannot beat it on average.
    """
    k = int(diff.shape[0])
    if k == 0 or numel == 0:
        return 0.0
    p = k / numel
    h_pos = 0.0 if p >= 1.0 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    _, counts = np.unique(diff, return_counts=True)
    q = counts / k
    h_val = float(-(q * np.log2(q)).sum())
    return (numel * h_pos + k * h_val) / 8.0
