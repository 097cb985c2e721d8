"""The codec's encoder on the GPU: the same bytes as :func:`rltune.sync.codec.encode_many`.

The changes of a step are already on the GPU when the optimizer has written them, so the bulk of
encoding runs there, over all tensors at once: checks, zigzag, symbols, the extra-bit and Rice bit
streams (fields packed by :mod:`rltune.sync.kernels.encode_kernels`), each block's symbol counts and
its rANS lanes. The host keeps what is small and must match the host codec exactly: the choice of
each block's Rice parameter and of sparse or dense coding (from per-block sums the GPU computes),
the normalised frequency tables, and the framing. Four small device-to-host reads per call, then one
copy of the coded bytes.

API::

    blobs = encode_many_gpu([(idx_C, diff_C, bits, start, stop), ...], mode="auto")
    # idx_C: int64 ascending flat indices, diff_C: int64 signed wire-bit differences, both on one
    # device; blobs[i] == codec.encode(idx_C.cpu().numpy(), diff_C.cpu().numpy(), bits, start, stop)

On a CPU it needs ``TRITON_INTERPRET=1`` (as the kernel tests run it).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from rltune.sync import codec as C
from rltune.sync.kernels import encode_kernels as EK

_SYMBOLS = C.N_SYMBOLS_MAX


def _zigzag(d: torch.Tensor) -> torch.Tensor:
    return (d << 1) ^ (d >> 63)


def _symbols(zz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host's _symbolize: (symbol, extra bits, extra value) per zigzag value."""
    nb = torch.frexp(zz.to(torch.float64)).exponent.to(torch.int64)  # bit length, exact below 2^53
    large = zz >= C.N_DIRECT
    sym = torch.where(large, C.N_DIRECT + nb - 7, zz).to(torch.int32)
    extra_bits = torch.where(large, nb - 1, 0)
    extra_val = torch.where(large, zz - (torch.ones_like(zz) << torch.clamp(nb - 1, min=0)), 0)
    return sym, extra_bits, extra_val


def _padded_cumsum(values: torch.Tensor) -> torch.Tensor:
    c = torch.cumsum(values.to(torch.int64), 0)
    return torch.cat([c.new_zeros(1), c])


def _segment_sums(values: torch.Tensor, bounds_S1: torch.Tensor) -> torch.Tensor:
    """Sums over contiguous segments ``bounds[s] .. bounds[s + 1]`` (no atomics: a cumsum and two reads)."""
    c = _padded_cumsum(values)
    return c[bounds_S1[1:]] - c[bounds_S1[:-1]]


def _offsets_in_segments(lengths: torch.Tensor, segment: torch.Tensor, bounds_S1: torch.Tensor) -> torch.Tensor:
    """Each item's exclusive prefix of ``lengths`` inside its contiguous segment."""
    c = _padded_cumsum(lengths)
    return c[:-1] - c[bounds_S1[:-1]][segment]


def _rice_fields(gaps: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each gap's two Rice fields: (unary part or escape: its value, its bits; low or raw bits: their count)."""
    q = gaps >> k
    escape = q >= C.RICE_ESCAPE_Q
    a_val = torch.where(escape, (1 << C.RICE_ESCAPE_Q) - 1, (torch.ones_like(q) << torch.clamp(q, max=62)) - 1)
    return a_val, torch.where(escape, C.RICE_ESCAPE_Q, q + 1), torch.where(escape, C.RICE_RAW_BITS, k)


def _k_window(gap_sum: int, n_gaps: int, hi: int) -> list[int]:
    # numpy's mean of int64 gaps is their (exact) sum / n in float64, so the candidates are the host's
    return list(C.rice_candidates(float(gap_sum) / n_gaps, hi))


def encode_many_gpu(jobs: Sequence[tuple[torch.Tensor, torch.Tensor, int, int, int]], mode: str = "auto") -> list[bytes]:
    """``codec.encode_many`` of changes held on a device (see the module doc); the same bytes."""
    if not jobs:
        return []
    if mode not in ("auto", "sparse", "dense"):
        raise ValueError(f"mode must be auto, sparse or dense, got {mode!r}")
    dev = jobs[0][0].device
    counts, meta = [], []
    for idx, diff, bits, start, stop in jobs:
        if bits not in (8, 16, 32):
            raise ValueError(f"bits must be 8, 16 or 32, got {bits}")
        if idx.shape != diff.shape or idx.ndim != 1 or idx.shape[0] == 0:
            raise ValueError("encode needs equal-length, non-empty 1-D idx and diff")
        if idx.device != dev or diff.device != dev:
            raise ValueError(f"every job's tensors must be on {dev}")
        counts.append(int(idx.shape[0]))
        meta.append((int(bits), int(start), int(stop)))
    n_jobs, total = len(jobs), sum(counts)
    numel_J = [m[2] - m[1] for m in meta]

    def on_dev(a) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, dtype=np.int64), device=dev)

    # segments over the concatenated changes: jobs, and sparse blocks (BLOCK_CHANGES changes of one job)
    job_b = np.cumsum([0] + counts)
    sb_b = np.concatenate([np.arange(job_b[j], job_b[j + 1], C.BLOCK_CHANGES) for j in range(n_jobs)] + [[total]])
    sb_job = np.concatenate([np.full(-(-counts[j] // C.BLOCK_CHANGES), j) for j in range(n_jobs)])
    n_sb = len(sb_b) - 1
    sb_count = np.diff(sb_b)
    job_b_dev, sb_b_dev = on_dev(job_b), on_dev(sb_b)
    idx_C = torch.cat([j[0].reshape(-1).to(torch.int64) for j in jobs])
    diff_C = torch.cat([j[1].reshape(-1).to(torch.int64) for j in jobs])
    job_C = torch.repeat_interleave(on_dev(range(n_jobs)), on_dev(counts), output_size=total)
    sb_C = torch.repeat_interleave(on_dev(range(n_sb)), on_dev(sb_count), output_size=total)
    job_first = torch.zeros(total, dtype=torch.bool, device=dev)
    job_first[job_b_dev[:-1]] = True
    block_first = torch.zeros(total, dtype=torch.bool, device=dev)
    block_first[sb_b_dev[:-1]] = True

    # --- 1. checks, zigzag, gaps, symbols; per job and per sparse block: the sums the host decides from
    prev = torch.cat([idx_C[:1], idx_C[:-1]])
    bad_idx = (idx_C < on_dev([m[1] for m in meta])[job_C]) | (idx_C >= on_dev([m[2] for m in meta])[job_C]) \
        | (~job_first & (idx_C <= prev))
    lim = on_dev([1 << (m[0] - 1) for m in meta])[job_C]
    bad_diff = (diff_C == 0) | (diff_C < -lim) | (diff_C >= lim)
    zz_C = _zigzag(diff_C)
    gap_C = torch.where(job_first, 0, idx_C - prev - 1)  # gaps of the job (the host's _dense_is_smaller)
    block_gap_C = torch.where(block_first, 0, gap_C)  # gaps inside each block (the host's _encode_block)
    sym_C, extra_bits_C, extra_val_C = _symbols(zz_C)
    sb_hist = EK.segment_histograms(sym_C, sb_b_dev)
    read = torch.cat([_segment_sums(bad_idx, job_b_dev), _segment_sums(bad_diff, job_b_dev),
                      _segment_sums(gap_C, job_b_dev), _segment_sums(block_gap_C, sb_b_dev),
                      sb_hist.reshape(-1).to(torch.int64)]).cpu().numpy()
    bad_idx_J, bad_diff_J, gap_sum_J, rest = read[:n_jobs], read[n_jobs:2 * n_jobs], read[2 * n_jobs:3 * n_jobs], \
        read[3 * n_jobs:]
    sb_gap_sum, sb_hist = rest[:n_sb], rest[n_sb:].reshape(n_sb, EK.HIST_BINS)
    for j in range(n_jobs):
        if bad_idx_J[j]:
            raise ValueError("indices must be unique, ascending and inside [start, stop)")
        if bad_diff_J[j]:
            raise ValueError(f"differences must be non-zero and inside [-2^{meta[j][0] - 1}, 2^{meta[j][0] - 1})")

    # --- 2. Rice costs of the candidate parameters: per sparse block, and per job where dense may win
    dense_candidates = [j for j in range(n_jobs) if mode == "auto" and counts[j] * 16 >= numel_J[j]]
    k_sb = np.zeros((n_sb, 4), dtype=np.int64)
    n_k_sb = np.ones(n_sb, dtype=np.int64)
    for b in range(n_sb):
        if sb_count[b] > 1:
            ks = _k_window(int(sb_gap_sum[b]), int(sb_count[b]) - 1, C.RICE_RAW_BITS - 1)
            k_sb[b, :len(ks)], n_k_sb[b] = ks, len(ks)
    k_job = np.zeros((n_jobs, 4), dtype=np.int64)
    n_k_job = np.zeros(n_jobs, dtype=np.int64)  # no gaps (one change): no Rice bits
    for j in dense_candidates:
        if counts[j] > 1:
            ks = _k_window(int(gap_sum_J[j]), counts[j] - 1, 99)
            k_job[j, :len(ks)], n_k_job[j] = ks, len(ks)
    k_sb_dev, k_job_dev = on_dev(k_sb), on_dev(k_job)
    sb_cost, job_cost = [], []
    for slot in range(4):
        _, a, b = _rice_fields(gap_C, k_sb_dev[sb_C, slot])
        sb_cost.append(_segment_sums(torch.where(block_first, 0, a + b), sb_b_dev))
        if dense_candidates:
            _, a, b = _rice_fields(gap_C, k_job_dev[job_C, slot])
            job_cost.append(_segment_sums(torch.where(job_first, 0, a + b), job_b_dev))
    read = torch.cat([torch.stack(sb_cost, 1).reshape(-1)] + ([torch.stack(job_cost, 1).reshape(-1)]
                                                               if dense_candidates else [])).cpu().numpy()
    sb_cost = read[:4 * n_sb].reshape(n_sb, 4)
    job_cost = read[4 * n_sb:].reshape(-1, 4)
    rice_k_sb = np.array([k_sb[b, min(range(n_k_sb[b]), key=lambda s, b=b: (int(sb_cost[b, s]), s))]
                          for b in range(n_sb)], dtype=np.int64)
    rice_k_sb[sb_count <= 1] = 0

    dense_J = [mode == "dense"] * n_jobs
    for j in dense_candidates:
        hist = np.zeros(C.N_DIRECT + 1, dtype=np.int64)
        for b in np.flatnonzero(sb_job == j):
            hist[:C.N_DIRECT] += sb_hist[b, :C.N_DIRECT]
            hist[C.N_DIRECT] += sb_hist[b, C.N_DIRECT:C.N_SYMBOLS_MAX].sum()
        rice = min((int(job_cost[j, s]) for s in range(n_k_job[j])), default=0)
        dense_J[j] = C.dense_beats_sparse(hist, rice, numel_J[j], counts[j])

    # --- 3. the coded blocks: sparse blocks of sparse jobs, element blocks of dense jobs
    blocks = []  # (job, count, sparse block or -1, first element of a dense block)
    for j in range(n_jobs):
        if dense_J[j]:
            blocks += [(j, min(C.BLOCK_CHANGES, numel_J[j] - e), -1, meta[j][1] + e)
                       for e in range(0, numel_J[j], C.BLOCK_CHANGES)]
        else:
            blocks += [(j, int(sb_count[b]), int(b), 0) for b in np.flatnonzero(sb_job == j)]
    n_blocks = len(blocks)
    count_B = np.asarray([b[1] for b in blocks], dtype=np.int64)
    block_b = np.concatenate([[0], np.cumsum(count_B)])
    block_b_dev = on_dev(block_b)
    if any(dense_J):
        pieces = []
        for j in range(n_jobs):
            changes = slice(int(job_b[j]), int(job_b[j + 1]))
            if dense_J[j]:
                dense = torch.zeros(numel_J[j], dtype=torch.int64, device=dev)
                dense[idx_C[changes] - meta[j][1]] = zz_C[changes]
                pieces.append(dense)
            else:
                pieces.append(zz_C[changes])
        sym_N, extra_bits_N, extra_val_N = _symbols(torch.cat(pieces))
        hist_dev = EK.segment_histograms(sym_N, block_b_dev)
    else:  # every block is a sparse block: the symbols and counts of step 1
        sym_N, extra_bits_N, extra_val_N, hist_dev = sym_C, extra_bits_C, extra_val_C, None
    block_N = torch.repeat_interleave(on_dev(range(n_blocks)), on_dev(count_B), output_size=int(block_b[-1]))

    # Rice fields per change of a sparse-coded job (none for a block's first change)
    coded = torch.as_tensor([not dense_J[j] for j in range(n_jobs)], device=dev)[job_C]
    a_val, a_bits, b_bits = _rice_fields(gap_C, on_dev(rice_k_sb)[sb_C])
    is_gap = coded & ~block_first
    a_bits, b_bits = torch.where(is_gap, a_bits, 0), torch.where(is_gap, b_bits, 0)

    read = [_segment_sums(extra_bits_N, block_b_dev), _segment_sums(a_bits + b_bits, sb_b_dev), idx_C[sb_b_dev[:-1]]]
    if hist_dev is not None:
        read.append(hist_dev.reshape(-1).to(torch.int64))
    read = torch.cat(read).cpu().numpy()
    extra_total, sb_gap_bits, sb_first = read[:n_blocks], read[n_blocks:n_blocks + n_sb], read[n_blocks + n_sb:n_blocks + 2 * n_sb]
    hist_B = read[n_blocks + 2 * n_sb:].reshape(n_blocks, EK.HIST_BINS) if hist_dev is not None else sb_hist
    freq_BS = C.normalize_freqs_rows(hist_B[:, :_SYMBOLS], C.SCALE_BITS)
    n_symbols = [int(u) for u in _SYMBOLS - np.argmax(hist_B[:, _SYMBOLS - 1::-1] > 0, axis=1)]
    cum_BS = np.cumsum(freq_BS, axis=1) - freq_BS

    def stream(total_bits: np.ndarray, value, nbits, at, segment) -> tuple[torch.Tensor, np.ndarray]:
        # each segment's bits start at a 64-bit word; returns the words and each segment's first byte
        words = (total_bits + 63) // 64
        base = np.cumsum(words) - words
        out = torch.zeros(int(words.sum()) + 1, dtype=torch.int64, device=dev)
        EK.write_fields(out, value, nbits, on_dev(base * 64)[segment] + at)
        return out, base * 8

    extra_words, extra_base = stream(extra_total, extra_val_N, extra_bits_N,
                                     _offsets_in_segments(extra_bits_N, block_N, block_b_dev), block_N)
    at = _offsets_in_segments(a_bits + b_bits, sb_C, sb_b_dev)
    gap_words, sb_gap_base = stream(sb_gap_bits, torch.cat([a_val, gap_C]), torch.cat([a_bits, b_bits]),
                                    torch.cat([at, at + a_bits]), torch.cat([sb_C, sb_C]))

    # --- 4. rANS lanes: each lane gets room for two bytes per symbol and the final state
    lanes_B = np.asarray([max(1, min(C.MAX_LANES, n // C.SYMBOLS_PER_LANE)) for n in count_B], dtype=np.int64)
    room_B = 2 * (-(-count_B // lanes_B)) + 8
    region_B = np.cumsum(lanes_B * room_B) - lanes_B * room_B
    rans = torch.empty(int((lanes_B * room_B).sum()), dtype=torch.uint8, device=dev)
    begin_BL = torch.zeros((n_blocks, EK.LANES), dtype=torch.int64, device=dev)
    EK.rans_lanes(sym_N, block_b_dev[:-1], on_dev(count_B), on_dev(lanes_B), on_dev(region_B), on_dev(room_B),
                  on_dev(freq_BS), on_dev(cum_BS), rans, begin_BL, C.SCALE_BITS, C.RANS_L)
    begin = begin_BL.cpu().numpy()
    lane_ok = np.arange(EK.LANES)[None, :] < lanes_B[:, None]
    lane_len = np.where(lane_ok, room_B[:, None] - begin, 0)
    src = (region_B[:, None] + np.arange(EK.LANES)[None, :] * room_B[:, None] + begin)[lane_ok]
    lens = lane_len[lane_ok]
    gather = torch.repeat_interleave(on_dev(src - (np.cumsum(lens) - lens)), on_dev(lens), output_size=int(lens.sum())) \
        + torch.arange(int(lens.sum()), device=dev)
    # one copy into pinned memory: the lanes' bytes (in order), then the gap and extra words
    coded = torch.cat([rans[gather], gap_words.view(torch.uint8), extra_words.view(torch.uint8)])
    host = torch.empty(coded.numel(), dtype=torch.uint8, pin_memory=dev.type == "cuda")
    host.copy_(coded, non_blocking=True)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    host = host.numpy()
    n_rans, n_gap = int(lens.sum()), gap_words.numel() * 8
    rans_host, gap_host, extra_host = host[:n_rans], host[n_rans:n_rans + n_gap], host[n_rans + n_gap:]

    # --- framing (host): the same layout as codec._encode_block / codec._frame
    out_blocks: list[list[bytes]] = [[] for _ in range(n_jobs)]
    at_byte = 0
    for b, (j, count, sb, dense_first) in enumerate(blocks):
        gap_len = (int(sb_gap_bits[sb]) + 7) // 8 if sb >= 0 else 0
        gap_at = int(sb_gap_base[sb]) if sb >= 0 else 0
        extra_len = (int(extra_total[b]) + 7) // 8
        lens_b = lane_len[b, :lanes_B[b]].astype("<u4")
        used = int(lens_b.sum())
        out_blocks[j].append(b"".join((
            C._BLOCK_FIXED.pack(count, int(sb_first[sb]) if sb >= 0 else dense_first,
                                int(rice_k_sb[sb]) if sb >= 0 else 0, int(lanes_B[b]), C.SCALE_BITS, n_symbols[b]),
            C._varint(freq_BS[b, :n_symbols[b]]),
            struct.pack("<I", gap_len), gap_host[gap_at:gap_at + gap_len].tobytes(),
            struct.pack("<I", extra_len), extra_host[extra_base[b]:extra_base[b] + extra_len].tobytes(),
            lens_b.tobytes(), rans_host[at_byte:at_byte + used].tobytes(),
        )))
        at_byte += used
    return [C._frame(C.MODE_DENSE if dense_J[j] else C.MODE_SPARSE, meta[j][0], meta[j][1], meta[j][2],
                     numel_J[j] if dense_J[j] else counts[j], out_blocks[j]) for j in range(n_jobs)]
