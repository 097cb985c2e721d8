"""The GPU encoder writes exactly the host codec's bytes (interpreter here, real sizes on a GPU)."""

import os

import numpy as np
import pytest
import torch

from rltune.sync import codec

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="the Triton kernels need a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _encode_gpu(jobs, mode="auto"):
    from rltune.sync.codec_gpu import encode_many_gpu

    return encode_many_gpu([(torch.from_numpy(i).to(DEVICE), torch.from_numpy(d).to(DEVICE), *rest)
                            for i, d, *rest in jobs], mode=mode)


def _changes(rng, numel, k, bits, spread=300):
    idx = np.sort(rng.choice(numel, k, replace=False)).astype(np.int64)
    lim = 1 << (bits - 1)
    diff = rng.integers(-spread, spread, k)
    diff[diff == 0] = 1
    return idx, np.clip(diff, -lim, lim - 1).astype(np.int64)


@pytest.mark.parametrize("numel,k,bits", [(1, 1, 16), (17, 1, 8), (5000, 50, 16), (3000, 900, 16), (20, 18, 8),
                                          (4097, 4097, 32), (100, 7, 32), (16, 1, 16)])
def test_bytes_equal_the_host_codec_over_sizes_widths_and_densities(numel, k, bits):
    rng = np.random.default_rng(numel + k)
    idx, diff = _changes(rng, numel, k, bits, spread=5000 if bits == 32 else 300)
    jobs = [(idx + 11, diff, bits, 11, 11 + numel)]
    assert _encode_gpu(jobs) == [codec.encode(*jobs[0])]


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_forced_modes_equal_the_host_codec(mode):
    rng = np.random.default_rng(3)
    jobs = [(*_changes(rng, 2000, 300, 16), 16, 0, 2000), (*_changes(rng, 700, 10, 8), 8, 0, 700)]
    assert _encode_gpu(jobs, mode=mode) == [codec.encode(*j, mode=mode) for j in jobs]


def test_rice_escapes_and_the_widest_values_equal_the_host_codec():
    # gaps past 2^32 * 2^k take the escape code; 32-bit differences at both limits carry 31 extra bits
    idx = np.array([0, 1, 2, 3, 1 << 36, (1 << 36) + 1], dtype=np.int64)
    diff = np.array([-(1 << 31), (1 << 31) - 1, 1, -1, 64, -65], dtype=np.int64)
    jobs = [(idx, diff, 32, 0, 1 << 37)]
    assert _encode_gpu(jobs) == [codec.encode(*jobs[0])]


def test_the_longest_unary_code_is_not_an_escape():
    # with k = 0, a gap of 31 is 31 ones and a zero (32 bits, like the escape's prefix); 32 escapes
    idx = np.concatenate([np.arange(100), [131, 164]]).astype(np.int64)
    jobs = [(idx, np.ones(idx.size, dtype=np.int64), 16, 0, 200)]
    blob = codec.encode(*jobs[0], mode="sparse")
    assert codec._BLOCK_FIXED.unpack_from(blob, codec._STREAM.size + 16)[2] == 0  # rice_k of the block
    assert _encode_gpu(jobs, mode="sparse") == [blob]


def test_many_tensors_and_a_two_block_tensor_in_one_call():
    rng = np.random.default_rng(5)
    jobs = [(*_changes(rng, 200_000, 70_000, 16), 16, 0, 200_000)]
    jobs += [(*_changes(rng, n, max(1, n // 50), 16), 16, 0, n) for n in (1000, 333, 4096)]
    got = _encode_gpu(jobs)
    assert got == [codec.encode(*j) for j in jobs]
    assert codec._STREAM.unpack_from(got[0], 0)[3] == 2  # two blocks


@pytest.mark.parametrize("case", ["descending", "repeated", "outside", "zero_diff", "diff_too_wide"])
def test_rejects_what_the_host_codec_rejects(case):
    idx, diff = np.array([1, 5, 9], dtype=np.int64), np.array([1, -2, 3], dtype=np.int64)
    start, stop = 0, 10
    if case == "descending":
        idx = np.array([1, 9, 5], dtype=np.int64)
    elif case == "repeated":
        idx = np.array([1, 5, 5], dtype=np.int64)
    elif case == "outside":
        stop = 9
    elif case == "zero_diff":
        diff = np.array([1, 0, 3], dtype=np.int64)
    else:
        diff = np.array([1, 128, 3], dtype=np.int64)
    job = (idx, diff, 8, start, stop)
    with pytest.raises(ValueError) as host:
        codec.encode(*job)
    with pytest.raises(ValueError) as gpu:
        _encode_gpu([job])
    assert str(gpu.value) == str(host.value)


@pytest.mark.gpu
def test_a_step_of_real_size_equals_the_host_codec_on_cuda():
    rng = np.random.default_rng(7)
    jobs = []
    for t in range(40):
        numel = int(rng.integers(1 << 16, 1 << 22))
        frac = 0.3 if t % 13 == 0 else 0.01  # a few dense-ish tensors, as norms are
        idx, diff = _changes(rng, numel, max(1, int(numel * frac)), 16)
        jobs.append((idx, diff, 16, 0, numel))
    assert _encode_gpu(jobs) == codec.encode_many(jobs)
