"""Codec: round trips (property-based), edge cases, golden bytes, validation and compression."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltune.sync import codec
from rltune.sync.format import CodecError


def _roundtrip(idx, diff, bits, start, stop, mode="auto"):
    blob = codec.encode(idx, diff, bits, start, stop, mode=mode)
    i2, d2 = codec.decode(blob, start, stop, bits)
    assert np.array_equal(i2, idx) and np.array_equal(d2, diff)
    return blob


@st.composite
def changes(draw):
    bits = draw(st.sampled_from([8, 16, 32]))
    start = draw(st.integers(0, 1000))
    numel = draw(st.integers(1, 3000))
    k = draw(st.integers(1, numel))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    idx = np.sort(rng.choice(numel, size=k, replace=False)).astype(np.int64) + start
    lim = 1 << (bits - 1)
    small = rng.choice([-1, 1], size=k) * rng.geometric(draw(st.floats(0.05, 0.95)), size=k)
    wild = rng.integers(-lim, lim, size=k)
    diff = np.where(rng.random(k) < draw(st.floats(0, 0.3)), wild, small)
    diff = np.clip(diff, -lim, lim - 1)
    diff[diff == 0] = 1
    return idx, diff.astype(np.int64), bits, start, start + numel


@settings(max_examples=60, deadline=None)
@given(changes(), st.sampled_from(["auto", "sparse", "dense", "plain"]))
def test_round_trip_is_exact_for_any_changes(case, mode):
    _roundtrip(*case, mode=mode)


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_extreme_values_and_edges_round_trip(bits):
    lim = 1 << (bits - 1)
    idx = np.array([0, 1, 63, 64, 999], dtype=np.int64)
    diff = np.array([-lim, lim - 1, 63, -64, 1], dtype=np.int64)
    _roundtrip(idx, diff, bits, 0, 1000)
    _roundtrip(np.array([999], np.int64), np.array([-1], np.int64), bits, 0, 1000)  # one change, last element


def test_block_boundaries_and_huge_gaps_round_trip():
    n = codec.BLOCK_CHANGES
    for k in (n - 1, n, n + 1, 2 * n + 3):
        idx = np.arange(k, dtype=np.int64) * 3 + 5
        diff = np.where(np.arange(k) % 7 == 0, -1, 1).astype(np.int64)
        blob = _roundtrip(idx, diff, 16, 0, 3 * k + 10, mode="sparse")
        assert int.from_bytes(blob[4:8], "little") == -(-k // n)
    # gaps far beyond the Rice escape, up to the 2^40 element cap
    idx = np.array([0, 1, 2**39, 2**40 - 1], dtype=np.int64)
    _roundtrip(idx, np.array([1, -1, 5, -300], np.int64), 16, 0, 2**40)


def test_dense_tensor_goes_dense_and_sparse_tensor_stays_sparse():
    rng = np.random.default_rng(0)
    n = 20000
    full = np.arange(n, dtype=np.int64)
    d = rng.choice([-1, 1], size=n).astype(np.int64)
    assert _roundtrip(full, d, 16, 0, n)[0] == codec.MODE_DENSE
    few = np.sort(rng.choice(n, 100, replace=False)).astype(np.int64)
    assert _roundtrip(few, d[:100], 16, 0, n)[0] == codec.MODE_SPARSE


def test_golden_bytes_of_a_small_stream():
    # Freezes the wire format: a change to the layout must change this test and the spec together.
    blob = codec.encode(np.array([2, 3, 10], np.int64), np.array([1, -1, 2], np.int64), 16, 0, 16, mode="sparse")
    assert blob.hex() == GOLDEN


GOLDEN = ("01100000010000000300000000000000000000000000000010000000000000000000000000000000290000000000000003000000"
          "020000000000000001010f0500ac55aa5500aa55010000001c0000000004000000ae32820d")


def test_golden_bytes_of_a_small_plain_stream():
    blob = codec.encode(np.array([2, 3, 10], np.int64), np.array([1, -1, 2], np.int64), 16, 0, 16, mode="plain")
    header = "03100000" "00000000" "0300000000000000" "0000000000000000" "1000000000000000"
    assert blob.hex() == header + "02000000" "03000000" "0a000000" + "0100" "ffff" "0200"


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_a_plain_stream_is_fixed_width_and_takes_u64_offsets_only_past_a_u32_range(bits):
    lim = 1 << (bits - 1)
    idx, diff = np.array([0, 7, 2**32 - 1], np.int64), np.array([-lim, lim - 1, 1], np.int64)
    assert len(_roundtrip(idx, diff, bits, 0, 2**32, mode="plain")) == 32 + 3 * (4 + bits // 8)
    far = np.array([5, 2**32 + 5], np.int64)  # no buffer the size of the range is made either way
    assert len(_roundtrip(far, diff[:2], bits, 0, 2**33, mode="plain")) == 32 + 2 * (8 + bits // 8)


def test_decode_refuses_a_damaged_plain_stream():
    blob = bytearray(codec.encode(np.array([1, 5, 9], np.int64), np.array([1, 2, -3], np.int64), 16, 0, 10, mode="plain"))
    values_at, offsets_at = 32 + 12, 32

    def refused(data: bytes, match: str) -> None:
        with pytest.raises(CodecError, match=match):
            codec.decode(data, 0, 10, bits=16)

    for cut in (10, 32, len(blob) - 1):
        refused(bytes(blob[:cut]), "shorter than|must be")
    refused(bytes(blob) + b"\0", "must be 50 bytes")
    blocks = bytearray(blob)
    blocks[4] = 1
    refused(bytes(blocks), "0 blocks")
    inflated = bytearray(blob)
    inflated[8:16] = (2**40).to_bytes(8, "little")
    refused(bytes(inflated), "values for range")
    for at, value, match in ((offsets_at + 4, 1, "ascending"), (offsets_at + 8, 10, "ascending"),
                             (values_at + 2, 0, "zero difference")):
        bad = bytearray(blob)
        bad[at:at + 2] = value.to_bytes(2, "little")
        refused(bytes(bad), match)


def test_near_entropy_on_bernoulli_positions_and_geometric_values():
    rng = np.random.default_rng(3)
    n = 2_000_000
    for density in (0.005, 0.02, 0.2):
        k = int(n * density)
        idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        diff = (rng.choice([-1, 1], size=k) * rng.geometric(0.75, size=k)).astype(np.int64)
        blob = codec.encode(idx, diff, 16, 0, n)
        ratio = len(blob) / codec.order0_bound_bytes(n, diff)
        assert 0.97 < ratio < 1.03, (density, ratio)  # measured 1.005-1.012 on this CPU


def test_order0_bound_matches_a_hand_computed_value():
    # 4 of 8 elements change (H = 1 bit each), values +1/-1 equally (1 bit each): 8 + 4 = 12 bits.
    assert codec.order0_bound_bytes(8, np.array([1, -1, 1, -1])) == pytest.approx(12 / 8)
    assert codec.order0_bound_bytes(8, np.zeros(0, np.int64)) == 0.0


@pytest.mark.parametrize("bad", [
    dict(idx=[3, 3], diff=[1, 1]), dict(idx=[5, 2], diff=[1, 1]), dict(idx=[10], diff=[1]),
    dict(idx=[1], diff=[0]), dict(idx=[1], diff=[40000]),
])
def test_encode_refuses_invalid_changes(bad):
    with pytest.raises(ValueError):
        codec.encode(np.array(bad["idx"], np.int64), np.array(bad["diff"], np.int64), 16, 0, 10)


def test_decode_refuses_truncated_mislabelled_and_inflated_streams():
    blob = codec.encode(np.array([1, 5, 9], np.int64), np.array([1, 2, -3], np.int64), 16, 0, 10)
    for cut in (0, 10, len(blob) - 1):
        with pytest.raises(CodecError):
            codec.decode(blob[:cut], 0, 10)
    with pytest.raises(CodecError):
        codec.decode(blob, 0, 11)  # range differs from its entry
    with pytest.raises(CodecError):
        codec.decode(blob, 0, 10, bits=32)
    inflated = bytearray(blob)
    inflated[8:16] = (2**40).to_bytes(8, "little")  # n_changes far beyond the range: refused before allocating
    with pytest.raises(CodecError):
        codec.decode(bytes(inflated), 0, 10)


@pytest.mark.parametrize("mode", ["auto", "plain"])
def test_every_single_byte_flip_is_refused_or_changes_the_output(mode):
    idx = np.array([1, 5, 9, 200, 201], np.int64)
    diff = np.array([1, 2, -3, 100, -1], np.int64)
    blob = codec.encode(idx, diff, 16, 0, 300, mode=mode)
    silent = 0
    for pos in range(len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        try:
            i2, d2 = codec.decode(bytes(bad), 0, 300)
        except CodecError:
            continue
        silent += np.array_equal(i2, idx) and np.array_equal(d2, diff)
    # No flip decodes to the original changes: the stream has no ignored bits (padding must be zero).
    # Flips that decode to *other* changes are left to the entry CRC and the tensor checksum.
    assert silent == 0


def test_encode_many_gives_encode_bytes_for_every_job_on_any_thread_count(monkeypatch):
    rng = np.random.default_rng(5)
    jobs = []
    for k, numel, bits in ((3, 10, 16), (2 * codec.BLOCK_CHANGES + 17, 10 * codec.BLOCK_CHANGES, 16),
                           (9000, 12000, 8), (70000, 80000, 32), (1, 1, 16)):
        idx = np.sort(rng.choice(numel, size=k, replace=False)).astype(np.int64) + 100
        lim = 1 << (bits - 1)
        diff = rng.integers(-lim, lim, size=k).astype(np.int64)
        diff[diff == 0] = 1
        jobs.append((idx, diff, bits, 100, 100 + numel))
    want = [codec.encode(*job) for job in jobs]
    assert codec.decode(want[3], 100, 80100, 32)[0].shape[0] == 70000  # dense-or-sparse, several blocks
    plain = [codec.encode(*job, mode="plain") for job in jobs]
    for threads in (1, 2, 7):
        assert codec.encode_many(jobs, threads=threads) == want
        assert codec.encode_many(jobs, threads=threads, mode="plain") == plain
    monkeypatch.setenv("RLTUNE_ENCODE_THREADS", "3")
    assert codec.encode_threads() == 3 and codec.encode_many(jobs) == want
    assert codec.encode_many([]) == []
    monkeypatch.setenv("RLTUNE_ENCODE_THREADS", "many")
    with pytest.raises(ValueError, match="RLTUNE_ENCODE_THREADS"):
        codec.encode_threads()


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_decode_many_gives_decode_of_every_stream_and_each_bad_one_its_error_in_place(threads):
    rng = np.random.default_rng(9)
    jobs = []
    for k, numel, mode in ((3, 10, "auto"), (2 * codec.BLOCK_CHANGES + 5, 4 * codec.BLOCK_CHANGES, "sparse"),
                           (900, 1000, "dense"), (5000, 90000, "plain")):
        idx = np.sort(rng.choice(numel, size=k, replace=False)).astype(np.int64) + 50
        diff = rng.integers(-100, 100, size=k).astype(np.int64)
        diff[diff == 0] = 1
        jobs.append((codec.encode(idx, diff, 16, 50, 50 + numel, mode=mode), 50, 50 + numel, 16))
    bad = (jobs[1][0][:-3], *jobs[1][1:])  # truncated
    got = codec.decode_many([jobs[0], bad, *jobs[1:]], threads=threads)
    want = [codec.decode(*job) for job in jobs]
    assert isinstance(got[1], CodecError)
    for (i1, d1), (i2, d2) in zip([got[0], *got[2:]], want, strict=True):
        assert np.array_equal(i1, i2) and np.array_equal(d1, d2)
    assert codec.decode_many([], threads=threads) == []


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_many_into_fills_each_slot_with_decode_of_its_stream_as_int32_differences(threads):
    # what the fused apply reads: positions as int64, differences sign-wrapped to int32, every mode and
    # width, each stream in its own slot of two shared arrays; a bad stream is its error in its place
    rng = np.random.default_rng(11)
    jobs, want = [], []
    for k, numel, bits, mode in ((3, 10, 16, "plain"), (5000, 90000, 8, "plain"), (4000, 2**33, 32, "plain"),
                                 (2 * codec.BLOCK_CHANGES + 5, 4 * codec.BLOCK_CHANGES, 16, "sparse"),
                                 (900, 1000, 32, "dense"), (700, 800, 16, "auto")):
        idx = np.sort(rng.choice(min(numel, 10**6), size=k, replace=False)).astype(np.int64) * (numel // 10**6 or 1) + 7
        lim = 1 << (bits - 1)
        diff = rng.integers(-lim, lim, size=k).astype(np.int64)
        diff[diff == 0] = -lim  # the extremes of each width too
        jobs.append((codec.encode(idx, diff, bits, 7, 7 + numel, mode=mode), 7, 7 + numel, bits))
        want.append((idx, diff))
    slots, at = [], 0
    for idx, _ in want:
        slots.append((at, at + len(idx)))
        at += len(idx)
    idx_out, val_out = np.full(at, -1, np.int64), np.zeros(at, np.int32)
    assert codec.decode_many_into(jobs, idx_out, val_out, slots, threads=threads) == [None] * len(jobs)
    for (a, b), (idx, diff) in zip(slots, want, strict=True):
        assert np.array_equal(idx_out[a:b], idx)
        assert np.array_equal(val_out[a:b], diff.astype(np.int32)) and np.array_equal(val_out[a:b].astype(np.int64), diff)
    # a truncated stream and a slot of the wrong size: each its error, in its place; the others still decode
    bad = [(jobs[1][0][:-3], *jobs[1][1:]), jobs[3], jobs[0]]
    bad_slots = [slots[1], slots[3], (slots[0][0], slots[0][1] - 1)]
    got = codec.decode_many_into(bad, idx_out, val_out, bad_slots, threads=threads)
    assert isinstance(got[0], CodecError) and got[1] is None and isinstance(got[2], CodecError)
    assert "decodes to 3 changes, its entry says 2" in str(got[2])
    assert codec.decode_many_into([], idx_out, val_out, [], threads=threads) == []


def test_a_plain_stream_is_checked_as_it_is_written():
    for idx, diff, match in (([2, 1], [1, 1], "ascending"), ([1, 1], [1, 1], "ascending"), ([1, 10], [1, 1], "inside"),
                             ([1, 2], [0, 1], "non-zero"), ([1, 2], [1, 1 << 15], "inside"), ([1], [1, 2], "equal-length")):
        with pytest.raises(ValueError, match=match):
            codec.encode(np.array(idx, np.int64), np.array(diff, np.int64), 16, 0, 10, mode="plain")
    assert codec.decode(codec.encode(np.array([0, 9], np.int64), np.array([-(1 << 15), (1 << 15) - 1], np.int64), 16, 0,
                                     10, mode="plain"), 0, 10)[1].tolist() == [-(1 << 15), (1 << 15) - 1]


def test_encode_many_refuses_an_invalid_job_before_encoding_any():
    good = (np.array([1, 2], np.int64), np.array([1, -1], np.int64), 16, 0, 10)
    bad = (np.array([2, 1], np.int64), np.array([1, 1], np.int64), 16, 0, 10)
    with pytest.raises(ValueError, match="ascending"):
        codec.encode_many([good, bad], threads=2)
