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

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch

from rltune.sync import codec as C
from rltune.sync.kernels import encode_kernels as EK

_SYMBOLS = C.N_SYMBOLS_MAX


def _zigzag(d: torch.Tensor) -> torch.Tensor:
    return (d << 1) ^ (d >> 63)


def _bit_length(z: torch.Tensor) -> torch.Tensor:
    """Bits needed for each non-negative int64 below 2^63 (0 for 0), exactly, by binary search."""
    nb = torch.zeros_like(z)
    t = z.clone()
    for s in (32, 16, 8, 4, 2, 1):
        big = (t >> s) > 0
        nb += big * s
        t = torch.where(big, t >> s, t)
    return nb + (t > 0)


def _segment_sum(values: torch.Tensor, segment: torch.Tensor, segments: int) -> torch.Tensor:
    out = torch.zeros(segments, dtype=torch.int64, device=values.device)
    return out.index_add_(0, segment, values.to(torch.int64))


def _exclusive_in_segments(lengths: torch.Tensor, segment: torch.Tensor, segments: int) -> torch.Tensor:
    """Each item's offset inside its segment (the items of a segment are contiguous, segments in order)."""
    before = torch.cumsum(lengths, 0) - lengths
    first_of_segment = torch.zeros(segments, dtype=torch.int64, device=lengths.device)
    counts = torch.bincount(segment, minlength=segments)
    starts = torch.cumsum(counts, 0) - counts  # index of each segment's first item
    nonempty = counts > 0
    first_of_segment[nonempty] = before[starts[nonempty]]
    return before - first_of_segment[segment]


def _rice_costs(gaps: torch.Tensor, segment: torch.Tensor, k_SK: torch.Tensor) -> torch.Tensor:
    """Rice bits of each segment's gaps for each of its candidate parameters ``k_SK`` [segments, K]."""
    out = torch.zeros_like(k_SK)
    for j in range(k_SK.shape[1]):
        k = k_SK[segment, j]
        q = gaps >> k
        bits = torch.where(q >= C.RICE_ESCAPE_Q, C.RICE_ESCAPE_Q + C.RICE_RAW_BITS, q + 1 + k)
        out[:, j].index_add_(0, segment, bits)
    return out


def _k_window(gap_sum: int, n_gaps: int, hi: int) -> list[int]:
    # exactly the host codec's candidates: numpy's mean of int64 gaps is sum / n in float64
    k0 = max(0, int(math.log2(float(gap_sum) / n_gaps + 1.0)))
    return list(range(max(0, k0 - 1), min(hi, k0 + 2) + 1))


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
    n_jobs = len(jobs)
    counts_J = torch.tensor(counts, dtype=torch.int64, device=dev)
    total = sum(counts)
    idx_C = torch.cat([j[0].reshape(-1).to(torch.int64) for j in jobs])
    diff_C = torch.cat([j[1].reshape(-1).to(torch.int64) for j in jobs])
    job_C = torch.repeat_interleave(torch.arange(n_jobs, device=dev), counts_J, output_size=total)
    job_start = np.cumsum([0] + counts)
    start_J = torch.tensor([m[1] for m in meta], dtype=torch.int64, device=dev)
    stop_J = torch.tensor([m[2] for m in meta], dtype=torch.int64, device=dev)
    lim_J = torch.tensor([1 << (m[0] - 1) for m in meta], dtype=torch.int64, device=dev)
    first_C = torch.zeros(total, dtype=torch.bool, device=dev)
    first_C[torch.as_tensor(job_start[:-1], device=dev)] = True

    # --- checks, zigzag, gaps (all jobs at once) and the sums the host decides from (read 1)
    prev = torch.cat([idx_C[:1], idx_C[:-1]])
    bad_idx = (idx_C < start_J[job_C]) | (idx_C >= stop_J[job_C]) | (~first_C & (idx_C <= prev))
    bad_diff = (diff_C == 0) | (diff_C < -lim_J[job_C]) | (diff_C >= lim_J[job_C])
    zz_C = _zigzag(diff_C)
    gap_C = torch.where(first_C, 0, idx_C - prev - 1)
    # sparse blocks: BLOCK_CHANGES changes of one job each
    rank_C = torch.arange(total, device=dev) - torch.as_tensor(job_start[:-1], device=dev)[job_C]
    blocks_J = [-(-c // C.BLOCK_CHANGES) for c in counts]
    block_base_J = torch.as_tensor(np.cumsum([0] + blocks_J)[:-1], device=dev)
    sblock_C = block_base_J[job_C] + rank_C // C.BLOCK_CHANGES
    n_sblocks = sum(blocks_J)
    in_block_gap_C = (rank_C % C.BLOCK_CHANGES) != 0  # the block's first change carries no gap
    hist_J = _segment_sum(torch.ones_like(zz_C), job_C * (C.N_DIRECT + 1) + torch.clamp(zz_C, max=C.N_DIRECT),
                          n_jobs * (C.N_DIRECT + 1)).view(n_jobs, C.N_DIRECT + 1)
    sums = torch.cat([_segment_sum(bad_idx, job_C, n_jobs), _segment_sum(bad_diff, job_C, n_jobs),
                      _segment_sum(gap_C, job_C, n_jobs),
                      _segment_sum(torch.where(in_block_gap_C, gap_C, 0), sblock_C, n_sblocks),
                      hist_J.reshape(-1)]).cpu().numpy()
    bad_idx_J, bad_diff_J, gap_sum_J = sums[:n_jobs], sums[n_jobs:2 * n_jobs], sums[2 * n_jobs:3 * n_jobs]
    sblock_gap_sum = sums[3 * n_jobs:3 * n_jobs + n_sblocks]
    hist_J = sums[3 * n_jobs + n_sblocks:].reshape(n_jobs, C.N_DIRECT + 1)
    for j in range(n_jobs):
        if bad_idx_J[j]:
            raise ValueError("indices must be unique, ascending and inside [start, stop)")
        if bad_diff_J[j]:
            raise ValueError(f"differences must be non-zero and inside [-2^{meta[j][0] - 1}, 2^{meta[j][0] - 1})")

    # --- Rice candidates: per job where dense might win (the host's estimate), per sparse block (read 2)
    candidates_J = {j: _k_window(int(gap_sum_J[j]), counts[j] - 1, C.RICE_RAW_BITS + 10)[:4]
                    for j in range(n_jobs) if mode == "auto" and counts[j] > 1 and counts[j] * 16 >= meta[j][2] - meta[j][1]}
    block_counts = [min(C.BLOCK_CHANGES, counts[j] - r) for j in range(n_jobs) for r in range(0, counts[j], C.BLOCK_CHANGES)]
    candidates_B = [_k_window(int(sblock_gap_sum[b]), block_counts[b] - 1, C.RICE_RAW_BITS - 1) if block_counts[b] > 1
                    else [0] for b in range(n_sblocks)]
    k_SK = np.zeros((n_sblocks + n_jobs, 4), dtype=np.int64)
    for b, ks in enumerate(candidates_B):
        k_SK[b, :len(ks)] = ks
    for j, ks in candidates_J.items():
        k_SK[n_sblocks + j, :len(ks)] = ks
    k_SK_dev = torch.as_tensor(k_SK, device=dev)
    has_gap = ~first_C
    costs_block = _rice_costs(gap_C[in_block_gap_C], sblock_C[in_block_gap_C], k_SK_dev[:n_sblocks].contiguous())
    costs_job = _rice_costs(gap_C[has_gap], job_C[has_gap], k_SK_dev[n_sblocks:].contiguous())
    costs = torch.cat([costs_block, costs_job]).cpu().numpy()

    dense_J = [False] * n_jobs
    for j in range(n_jobs):
        if mode == "dense":
            dense_J[j] = True
        elif j in candidates_J:
            rice = min(int(costs[n_sblocks + j, s]) for s in range(len(candidates_J[j])))
            h = hist_J[j].copy()
            sparse_bits = rice + C._entropy_bits(h)
            h[0] = meta[j][2] - meta[j][1] - counts[j]
            dense_J[j] = C._entropy_bits(h) * 1.04 < sparse_bits
        elif mode == "auto" and counts[j] == 1 and 16 >= meta[j][2] - meta[j][1]:
            # one change in a range of at most 16 elements: no gaps, the host's estimate is symbols only
            h = hist_J[j].copy()
            sparse_bits = C._entropy_bits(h)
            h[0] = meta[j][2] - meta[j][1] - 1
            dense_J[j] = C._entropy_bits(h) * 1.04 < sparse_bits

    # --- the blocks actually coded: sparse blocks of sparse jobs, element blocks of dense jobs
    rice_k_S = [0] * n_sblocks
    for b, ks in enumerate(candidates_B):
        if block_counts[b] > 1:
            rice_k_S[b] = min(range(len(ks)), key=lambda s, b=b: (int(costs[b, s]), s))
            rice_k_S[b] = ks[rice_k_S[b]]
    # blocks: (job, count, first element (dense) or index of the first change (sparse), sparse block or None)
    pieces, blocks = [], []
    sblock_first = np.cumsum([0] + blocks_J)
    for j in range(n_jobs):
        bits, start, stop = meta[j]
        changes = slice(int(job_start[j]), int(job_start[j + 1]))
        if dense_J[j]:
            dense = torch.zeros(stop - start, dtype=torch.int64, device=dev)
            dense[idx_C[changes] - start] = zz_C[changes]
            pieces.append(dense)
            blocks += [(j, min(C.BLOCK_CHANGES, stop - start - b0), start + b0, None)
                       for b0 in range(0, stop - start, C.BLOCK_CHANGES)]
        else:
            pieces.append(zz_C[changes])
            blocks += [(j, block_counts[sblock_first[j] + i], int(job_start[j]) + i * C.BLOCK_CHANGES,
                        int(sblock_first[j]) + i) for i in range(blocks_J[j])]
    zz_N = torch.cat(pieces)
    n_blocks = len(blocks)
    count_B = torch.tensor([b[1] for b in blocks], dtype=torch.int64, device=dev)
    start_B = torch.cumsum(count_B, 0) - count_B
    block_N = torch.repeat_interleave(torch.arange(n_blocks, device=dev), count_B, output_size=zz_N.numel())
    lanes = [max(1, min(C.MAX_LANES, b[1] // C.SYMBOLS_PER_LANE)) for b in blocks]

    # symbols and the extra-bit stream (values of 64 and up keep their low bits there)
    nb_N = _bit_length(zz_N)
    large = zz_N >= C.N_DIRECT
    sym_N = torch.where(large, C.N_DIRECT + nb_N - 7, zz_N).to(torch.int32)
    extra_bits_N = torch.where(large, nb_N - 1, 0)
    extra_val_N = torch.where(large, zz_N - (torch.ones_like(zz_N) << torch.clamp(nb_N - 1, min=0)), 0)

    # Rice fields of the sparse blocks coded sparse: two per gap (the unary part, the low bits)
    coded_of_sblock = np.full(n_sblocks, -1, dtype=np.int64)
    for i, blk in enumerate(blocks):
        if blk[3] is not None:
            coded_of_sblock[blk[3]] = i
    coded_of_sblock_dev = torch.as_tensor(coded_of_sblock, device=dev)
    gap_sel = in_block_gap_C & (coded_of_sblock_dev[sblock_C] >= 0)
    g = gap_C[gap_sel]
    g_block = coded_of_sblock_dev[sblock_C[gap_sel]]
    k = torch.as_tensor(np.asarray(rice_k_S, dtype=np.int64), device=dev)[sblock_C[gap_sel]]
    q = g >> k
    escape = q >= C.RICE_ESCAPE_Q
    a_bits = torch.where(escape, C.RICE_ESCAPE_Q, q + 1)
    a_val = torch.where(escape, (1 << C.RICE_ESCAPE_Q) - 1, (torch.ones_like(q) << torch.clamp(q, max=62)) - 1)
    b_bits = torch.where(escape, C.RICE_RAW_BITS, k)

    # per-block symbol counts, stream lengths and first indices (read 3)
    hist_BS = _segment_sum(torch.ones_like(block_N), block_N * _SYMBOLS + sym_N.to(torch.int64), n_blocks * _SYMBOLS)
    first_change = torch.as_tensor([b[2] if b[3] is not None else 0 for b in blocks], device=dev)
    small = torch.cat([hist_BS, _segment_sum(extra_bits_N, block_N, n_blocks),
                       _segment_sum(a_bits + b_bits, g_block, n_blocks), idx_C[first_change]]).cpu().numpy()
    hist_BS = small[:n_blocks * _SYMBOLS].reshape(n_blocks, _SYMBOLS)
    extra_total, gap_total, firsts = small[n_blocks * _SYMBOLS:].reshape(3, n_blocks)
    freq_BS = np.zeros((n_blocks, _SYMBOLS), dtype=np.int64)
    n_symbols = []
    for b in range(n_blocks):
        used = int(np.flatnonzero(hist_BS[b]).max()) + 1
        freq_BS[b, :used] = C._normalize_freqs(hist_BS[b, :used], C.SCALE_BITS)
        n_symbols.append(used)
    cum_BS = np.cumsum(freq_BS, axis=1) - freq_BS

    # the bit streams, each block's starting at a 64-bit word
    def stream(total_bits: np.ndarray, value, nbits, at_in_block, block) -> tuple[torch.Tensor, np.ndarray]:
        words = (total_bits + 63) // 64
        base = np.cumsum(words) - words
        out = torch.zeros(int(words.sum()) + 1, dtype=torch.int64, device=dev)
        EK.write_fields(out, value, nbits, torch.as_tensor(base * 64, device=dev)[block] + at_in_block)
        return out, base * 8

    extra_words, extra_base = stream(extra_total, extra_val_N, extra_bits_N,
                                     _exclusive_in_segments(extra_bits_N, block_N, n_blocks), block_N)
    at = _exclusive_in_segments(a_bits + b_bits, g_block, n_blocks)
    gap_words, gap_base = stream(gap_total, torch.cat([a_val, g]), torch.cat([a_bits, b_bits]), torch.cat([at, at + a_bits]),
                                 torch.cat([g_block, g_block]))

    # rANS lanes: each block's lanes get room for two bytes per symbol and the final state (read 4)
    counts_B = np.asarray([b[1] for b in blocks], dtype=np.int64)
    lanes_B = np.asarray(lanes, dtype=np.int64)
    room_B = 2 * (-(-counts_B // lanes_B)) + 8
    region_B = np.cumsum(lanes_B * room_B) - lanes_B * room_B
    rans = torch.empty(int((lanes_B * room_B).sum()), dtype=torch.uint8, device=dev)
    begin_BL = torch.zeros((n_blocks, EK.LANES), dtype=torch.int64, device=dev)
    EK.rans_lanes(sym_N, start_B, count_B, torch.as_tensor(lanes_B, device=dev), torch.as_tensor(region_B, device=dev),
                  torch.as_tensor(room_B, device=dev), torch.as_tensor(freq_BS, device=dev),
                  torch.as_tensor(cum_BS, device=dev), rans, begin_BL, C.SCALE_BITS, C.RANS_L)
    begin = begin_BL.cpu().numpy()
    lane_ok = np.arange(EK.LANES)[None, :] < lanes_B[:, None]
    lane_len = np.where(lane_ok, room_B[:, None] - begin, 0)
    src = (region_B[:, None] + np.arange(EK.LANES)[None, :] * room_B[:, None] + begin)[lane_ok]
    lens = lane_len[lane_ok]
    dst = np.cumsum(lens) - lens
    gather = torch.repeat_interleave(torch.as_tensor(src - dst, device=dev), torch.as_tensor(lens, device=dev),
                                     output_size=int(lens.sum())) + torch.arange(int(lens.sum()), device=dev)
    rans_host = rans[gather].cpu().numpy()  # lanes in order, each lane's bytes in order
    gap_host = gap_words.cpu().numpy().view(np.uint8)
    extra_host = extra_words.cpu().numpy().view(np.uint8)

    # --- framing (host): the same layout as codec._encode_block / codec._frame
    out_blocks: list[list[bytes]] = [[] for _ in range(n_jobs)]
    at = 0
    for b, (j, count, first, s) in enumerate(blocks):
        gap_len = (int(gap_total[b]) + 7) // 8
        extra_len = (int(extra_total[b]) + 7) // 8
        lens = lane_len[b, :lanes[b]].astype("<u4")
        used = int(lens.sum())
        out_blocks[j].append(b"".join((
            C._BLOCK_FIXED.pack(count, int(firsts[b]) if s is not None else first,
                                rice_k_S[s] if s is not None else 0, lanes[b], C.SCALE_BITS, n_symbols[b]),
            C._varint(freq_BS[b, :n_symbols[b]]),
            struct.pack("<I", gap_len), gap_host[gap_base[b]:gap_base[b] + gap_len].tobytes(),
            struct.pack("<I", extra_len), extra_host[extra_base[b]:extra_base[b] + extra_len].tobytes(),
            lens.tobytes(), rans_host[at:at + used].tobytes(),
        )))
        at += int(lane_len[b].sum())
    return [C._frame(C.MODE_DENSE if dense_J[j] else C.MODE_SPARSE, meta[j][0], meta[j][1], meta[j][2],
                     meta[j][2] - meta[j][1] if dense_J[j] else counts[j], out_blocks[j]) for j in range(n_jobs)]

