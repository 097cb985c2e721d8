"""Triton sync kernels against their torch references, bit for bit (torch.equal).

On a CPU machine the kernels run under TRITON_INTERPRET=1 at small sizes; the ``gpu`` tests run
them at real sizes on CUDA. Every case checks the reference changed something, so no pass is vacuous.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rltune.sync import kernels as K  # noqa: E402
from rltune.sync.kernels import reference as R  # noqa: E402
from rltune.sync.ops import apply_mapped_delta_ref, wire_diff  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AWKWARD_SIZES = [0, 1, 127, 129, 4097, 2048 * 3 + 5]
BITS = {16: torch.int16, 32: torch.int32, 8: torch.uint8}


def random_bits(n: int, width: int, seed: int, device: str = DEVICE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 256) if width == 8 else (-(1 << (width - 1)), (1 << (width - 1)) - 1)
    return torch.randint(lo, hi, (n,), dtype=BITS[width], generator=g).to(device)


def perturb(bits: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    changed = (torch.rand(bits.numel(), generator=g) < fraction).to(bits.device)
    out = bits.clone()
    out[changed] = (out[changed].to(torch.int64) + 1 + seed).to(bits.dtype)
    return out


@pytest.mark.parametrize("width", [16, 32, 8])
@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_checksum_kernel_equals_reference(n, width):
    bits = random_bits(n, width, seed=n + width)
    for offset in (0, 3, (1 << 40) + 7):
        got = K.checksum(bits, offset=offset, backend="triton")
        assert got == R.checksum_ref(bits.cpu(), offset)
    if n:
        assert R.checksum_ref(bits.cpu()) != 0, "reference is zero"


@pytest.mark.parametrize("width", [16, 32, 8])
@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_checksum2_kernel_equals_reference(n, width):
    bits = random_bits(n, width, seed=n + width + 1)
    for offset in (0, 5, (1 << 32) - 3, (1 << 40) - n - 1):  # an offset whose elements cross 2^32
        assert K.checksum2(bits, offset=offset, backend="triton") == R.checksum2_ref(bits.cpu(), offset)
    if n:
        assert R.checksum2_ref(bits.cpu()) != 0, "reference is zero"


def _checksum2_by_hand(values: list[int], offset: int = 0) -> int:
    # docs/delta-format.md's definition with Python integers: an implementation independent of torch
    def mix32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    p, a, b = (1 << 31) - 1, 0, 0
    for k, u in enumerate(values):
        i = offset + k
        h = mix32((i & 0xFFFFFFFF) ^ (((i >> 32) * 0x9E3779B9) & 0xFFFFFFFF))
        a += ((h & ((1 << 30) - 1)) + 1) * (u % p)
        b += ((mix32(h ^ 0x5BD1E995) & ((1 << 30) - 1)) + 1) * (u % p)
    return ((a % p) << 32) | (b % p)


def test_checksum2_golden_values():
    # bf16 1.0, 2.0, 3.0, -0.5 are 0x3F80, 0x4000, 0x4040, 0xBF00: fixed numbers, so neither the
    # definition nor an implementation can drift unnoticed
    t = torch.tensor([1.0, 2.0, 3.0, -0.5], dtype=torch.bfloat16)
    u = [0x3F80, 0x4000, 0x4040, 0xBF00]
    assert R.checksum2_ref(R.as_bits(t)) == _checksum2_by_hand(u) == 0x6ED63C99_2C3C8C67
    assert R.checksum_ref(R.as_bits(t)) == 1 * 0x3F80 + 2 * 0x4000 + 3 * 0x4040 + 4 * 0xBF00
    big = [0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 0]  # fp32 patterns at the lane prime's edges
    bits = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in big], dtype=torch.int32)
    assert R.checksum2_ref(bits, offset=(1 << 32) - 2) == _checksum2_by_hand(big, (1 << 32) - 2)
    assert K.checksum2(bits, offset=(1 << 32) - 2, backend="triton") == _checksum2_by_hand(big, (1 << 32) - 2)


def _checksum2_edge_bits(n: int, width: int) -> torch.Tensor:
    # the full pass's programs hold 8192 elements: the first all ones (the largest value every term
    # can take), the second random with the top bit set (fp32: above P, reduced only through the
    # lanes), the third cycling through the values next to P and 2**32, the rest random
    bits = random_bits(n, width, seed=n + width)
    top = {8: 0x80, 16: -0x8000, 32: -(1 << 31)}[width]
    bits[:8192] = -1 if width != 8 else 0xFF
    bits[8192:2 * 8192] |= top
    edges = torch.tensor([0x7FFFFFFE, 0x7FFFFFFF, -(1 << 31), -(1 << 31) + 1, -2, -1, 0, 1], dtype=torch.int64)
    if width != 32:
        edges &= (1 << width) - 1
    third = bits[2 * 8192:3 * 8192]
    third.copy_(edges.to(torch.int32).repeat(third.numel() // 8 + 1)[:third.numel()].to(third.dtype))
    return bits


@pytest.mark.parametrize("device", ["cpu", "cpu-no-numba", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_checksum2_span_changes_equal_the_reference_per_span(device, monkeypatch):
    """A step's changes (what DeltaRecorder.collect_deltas holds), split into chunks: each chunk's
    packed checksum2 change equals checksum2_update_ref of that chunk alone, on the compiled CPU pass
    and on the reference path (a GPU's, or a CPU's without numba), with positions past 2**32 and bits
    at the ends of their range."""
    if device == "cpu-no-numba":
        monkeypatch.setitem(sys.modules, "rltune.sync.kernels.cpu_kernels", None)  # its import fails
        device = "cpu"
    gen = torch.Generator().manual_seed(5)
    n = 20_000
    idx = torch.sort(torch.randint(0, 1 << 34, (n,), generator=gen)).values
    old = torch.randint(-(1 << 31), 1 << 31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    new = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    old[:50], new[:50] = -1, 0            # all-ones bits to zero
    old[50:100], new[50:100] = 0, -1      # and back
    new[100:150] = (1 << 31) - 1          # the prime itself
    spans = [(0, 0), (0, 100), (100, 101), (101, 7000), (7000, 7000), (7000, n)]
    got = K.checksum2_span_changes(idx.to(device), old.to(device), new.to(device), spans)
    want = [R.checksum2_update_ref(idx[a:b], old[a:b], new[a:b]) if b > a else 0 for a, b in spans]
    assert got == want
    assert K.checksum2_span_changes(idx, old, new, []) == []
    old16, new16 = old.to(torch.int16), new.to(torch.int16)  # other bit views take the reference path
    assert K.checksum2_span_changes(idx, old16, new16, spans[1:2]) == [R.checksum2_update_ref(idx[:100], old16[:100],
                                                                                             new16[:100])]


@pytest.mark.parametrize("width", [16, 32, 8])
@pytest.mark.parametrize("n", [8191, 8192, 3 * 8192 + 517])  # masked only, one unmasked program, both
def test_checksum2_at_the_edges_of_its_bounds(n, width):
    from rltune.sync.kernels import triton_kernels as tk
    from rltune.sync.kernels.cpu_kernels import checksum2_cpu

    assert tk.CHECKSUM2_BLOCK * tk.CHECKSUM2_TILES == 8192, "the sizes here straddle a program"
    bits = _checksum2_edge_bits(n, width)
    mask = (1 << width) - 1
    # positions that cross 2**32 in the first program and 3 * 2**32 in the second, and a high word of 2**30
    for offset in (0, (1 << 32) - 4000, 3 * (1 << 32) - 8192 - 77, (1 << 62) + 11):
        want = R.checksum2_ref(bits, offset)
        assert K.checksum2(bits.to(DEVICE), offset=offset, backend="triton") == want
        assert checksum2_cpu(bits, offset) == want
        partials = tk.checksum2_partials(bits.to(DEVICE), offset, mask)
        assert bool(((partials >= 0) & (partials < R.P31)).all()), "a program's lanes are not reduced mod P"
    assert R.checksum2_ref(bits) != 0

def test_checksum2_sees_edits_whose_position_weighted_changes_cancel():
    # +2 at element i and -1 at element 2i + 1 move sum (i+1) * u by 2(i+1) - (2i+2) = 0; and
    # (+1, -3, +3, -1) on four neighbours cancels any weighting polynomial in i up to degree 2
    base = torch.full((64,), 0x3F80, dtype=torch.int16)
    for edits in ({5: 2, 11: -1}, {20: 1, 21: -3, 22: 3, 23: -1}):
        edited = base.clone()
        for i, d in edits.items():
            edited[i] += d
        assert R.checksum_ref(edited) == R.checksum_ref(base)
        assert R.checksum2_ref(edited) != R.checksum2_ref(base)
        assert K.checksum2(edited, backend="triton") == R.checksum2_ref(edited)


def test_checksum2_shares_of_a_partition_add_up_lane_by_lane():
    bits = random_bits(10_000, 16, seed=3)
    whole = R.checksum2_ref(bits.cpu(), offset=7)
    parts = [R.checksum2_ref(bits.cpu()[a:b], offset=7 + a) for a, b in ((0, 3333), (3333, 9000), (9000, 10_000))]
    total = 0
    for part in parts:
        total = R.checksum2_add(total, part)
    assert total == whole and R.checksum2_scale(whole, 2) == R.checksum2_add(whole, whole)


@pytest.mark.parametrize("width", [16, 32, 8])
@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_the_compiled_cpu_checksums_equal_the_references(n, width):
    from rltune.sync.kernels.cpu_kernels import checksum2_cpu, checksum_cpu

    bits = random_bits(n, width, seed=2 * n + width, device="cpu")
    for offset in (0, 3, (1 << 32) - 3, (1 << 40) + 7, (1 << 62) + 11):  # products and sums past 2^64 wrap as the reference's
        assert checksum_cpu(bits, offset) == R.checksum_ref(bits, offset) == K.checksum(bits, offset)
        assert checksum2_cpu(bits, offset) == R.checksum2_ref(bits, offset) == K.checksum2(bits, offset)
    if n > 1:
        assert checksum_cpu(bits[1:], 1) == R.checksum_ref(bits[1:], 1)  # a slice's share, as the publisher takes it
        assert checksum2_cpu(bits[1:], 1) == R.checksum2_ref(bits[1:], 1)
    full = torch.full((4097,), -1, dtype=BITS[width])  # every element at its largest unsigned value
    assert checksum_cpu(full, (1 << 62) - 5) == R.checksum_ref(full, (1 << 62) - 5)
    assert checksum2_cpu(full, (1 << 40) - 5) == R.checksum2_ref(full, (1 << 40) - 5)


@pytest.mark.parametrize("threads", [1, 2])
def test_checksum_pairs_of_many_tensors_equal_the_references_on_one_or_two_threads(threads):
    from rltune.sync.kernels.cpu_kernels import checksum_pairs_cpu

    # mixed widths and offsets, enough elements (> 2**20) that two threads split them
    tensors = [random_bits(n, width, seed=n + width, device="cpu")
               for n, width in ((700_000, 16), (1, 32), (400_000, 32), (5, 8), (300_001, 16), (0, 16))]
    offsets = [0, (1 << 32) - 1, 12345, (1 << 62) + 11, 7, 3]
    want = [(R.checksum_ref(t, o), R.checksum2_ref(t, o)) for t, o in zip(tensors, offsets, strict=True)]
    assert checksum_pairs_cpu(tensors, offsets, threads=threads) == want
    assert K.checksum_pairs(tensors, offsets) == want == [K.checksum_pair(t, o) for t, o in zip(tensors, offsets, strict=True)]
    floats = [torch.randn(999, dtype=torch.bfloat16), torch.randn(3, 5)]  # float tensors by their wire bits
    assert K.checksum_pairs(floats, [0, 9]) == [(R.checksum_ref(R.as_bits(f), o), R.checksum2_ref(R.as_bits(f), o))
                                                for f, o in zip(floats, [0, 9], strict=True)]
    assert K.checksum_pairs([], []) == []


def _float32_with_every_rounding_case(n: int, seed: int) -> torch.Tensor:
    """Random float32 weights with NaNs (both signs, several payloads), infinities, zeros, subnormals,
    the largest finite values (which round to infinity in bf16) and halfway cases of both parities."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, generator=g)
    special = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000,
               0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F817FFF]
    special_bits = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in special], dtype=torch.int32)
    at = torch.randint(0, max(n, 1), (min(n, 4 * len(special)),), generator=g)
    bits[at] = special_bits.repeat(4)[:at.numel()]
    return bits.view(torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_checksum_pairs_of_float32_weights_sent_as_bfloat16_equal_those_of_their_cast(threads):
    # the live check of fp32 master weights published as bf16 rounds inside the pass: it must give what
    # torch's cast and the references give, for every rounding case, across run (2**16) and 2**32 bounds
    from rltune.sync.kernels.cpu_kernels import _WEIGHT_TABLE_MAX, checksum_pairs_cpu

    sizes = [*AWKWARD_SIZES, 200_003, 1_100_000, 1_100_000]
    weights = [_float32_with_every_rounding_case(n, seed=n) for n in sizes]
    # small offsets read their weights from the kept table; one tensor runs past its end (hashed there),
    # one lies past 2**32 (never in a table)
    offsets = [65_530 + n for n in AWKWARD_SIZES] + [_WEIGHT_TABLE_MAX - 5000, 3, (1 << 32) - 70_000]
    cast = [w.to(torch.bfloat16) for w in weights]
    want = [(R.checksum_ref(R.as_bits(c), o), R.checksum2_ref(R.as_bits(c), o)) for c, o in zip(cast, offsets, strict=True)]
    assert any(torch.isnan(c).any() for c in cast) and any(torch.isinf(c).any() for c in cast)
    assert checksum_pairs_cpu(weights, offsets, threads=threads, bf16_of_f32=[True] * len(sizes)) == want
    assert K.checksum_pairs(weights, offsets, wire_dtype=torch.bfloat16) == want
    assert K.checksum_pairs(cast, offsets, wire_dtype=torch.bfloat16) == want  # already in the wire dtype
    # a float32 tensor sent as float32, and integer bits, are not cast by a floating wire dtype
    assert K.checksum_pairs([weights[-1], R.as_bits(cast[-1])], [3, 3], wire_dtype=torch.bfloat16)[1] == \
        (R.checksum_ref(R.as_bits(cast[-1]), 3), R.checksum2_ref(R.as_bits(cast[-1]), 3))
    assert K.checksum_pairs([weights[-1]], [3]) == [(R.checksum_ref(R.as_bits(weights[-1]), 3),
                                                     R.checksum2_ref(R.as_bits(weights[-1]), 3))]
    with pytest.raises(TypeError, match="float32"):
        checksum_pairs_cpu([cast[-1]], [0], bf16_of_f32=[True])


def test_checksum_of_a_float_tensor_uses_its_wire_bits():
    t = torch.randn(3000, dtype=torch.bfloat16).to(DEVICE)
    assert K.checksum(t, backend="triton") == R.checksum_ref(R.as_bits(t.cpu()))
    assert K.checksums([t, t[:5].clone()], backend="triton") == [R.checksum_ref(R.as_bits(t.cpu())),
                                                                 R.checksum_ref(R.as_bits(t[:5].cpu()))]


def test_checksum_all_ones_at_the_int32_accumulator_limit():
    # every lane of every tile at the maximum value: the int32 per-lane sums are at their largest
    bits = torch.full((1024 * 32 * 2 + 3,), -1, dtype=torch.int16, device=DEVICE)
    assert K.checksum(bits, offset=(1 << 31) - 5, backend="triton") == R.checksum_ref(bits.cpu(), (1 << 31) - 5)


@pytest.mark.parametrize("width", [16, 32, 8])
@pytest.mark.parametrize("n", AWKWARD_SIZES)
def test_diff_extract_kernel_equals_reference(n, width):
    old = random_bits(n, width, seed=n)
    new = perturb(old, 0.05, seed=1)
    offset = (1 << 33) + 11
    from rltune.sync.kernels.cpu_kernels import diff_extract_cpu

    want = R.diff_extract_ref(old.cpu(), new.cpu(), offset)
    for got in (K.diff_extract(old, new, offset=offset, backend="triton"), diff_extract_cpu(old.cpu(), new.cpu(), offset),
                K.diff_extract(old.cpu(), new.cpu(), offset=offset)):  # the last: the compiled CPU passes
        for g, w in zip(got[:3], want[:3], strict=True):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
        assert got[3] == want[3]
    far = (1 << 62) + 5  # products and the sum wrap mod 2**64 as the reference's
    assert diff_extract_cpu(old.cpu(), new.cpu(), far)[3] == R.diff_extract_ref(old.cpu(), new.cpu(), far)[3]


def test_diff_extract_every_element_changed_and_none_changed():
    old = random_bits(5000, 16, seed=3)
    new = (old.to(torch.int32) ^ 1).to(torch.int16)
    idx, new_c, old_c, change = K.diff_extract(old, new, backend="triton")
    assert torch.equal(idx.cpu(), torch.arange(5000))
    assert change == R.checksum_update_ref(torch.arange(5000), old.cpu(), new.cpu())
    idx, _, _, change = K.diff_extract(old, old.clone(), backend="triton")
    assert idx.numel() == 0 and change == 0
    from rltune.sync.kernels.cpu_kernels import diff_extract_cpu

    idx, new_c, old_c, change = diff_extract_cpu(old.cpu(), new.cpu())
    assert torch.equal(idx, torch.arange(5000)) and torch.equal(new_c, R.unsigned(new.cpu()).to(torch.int32))
    assert change == R.checksum_update_ref(torch.arange(5000), old.cpu(), new.cpu())
    idx, new_c, old_c, change = diff_extract_cpu(old.cpu(), old.cpu().clone())
    assert (idx.numel(), new_c.numel(), old_c.numel(), change) == (0, 0, 0, 0)


def test_change_sink_appends_chunks_in_order_and_checks_capacity():
    sink = K.ChangeSink(capacity=400, max_chunk_elements=3000, max_chunks=4, device=DEVICE, backend="triton")
    olds = [random_bits(n, 16, seed=n) for n in (3000, 1, 2500)]
    news = [perturb(o, 0.04, seed=i + 2) for i, o in enumerate(olds)]
    news[1] = (olds[1] + 1).to(torch.int16)
    for k, (o, w) in enumerate(zip(olds, news, strict=True)):
        sink.append(o, w, offset=1000 * k, key=f"t{k}")
    sink.finish()
    chunks = sink.collect()
    assert [c.key for c in chunks] == ["t0", "t1", "t2"]
    for k, (c, o, w) in enumerate(zip(chunks, olds, news, strict=True)):
        want = R.diff_extract_ref(o.cpu(), w.cpu(), 1000 * k)
        assert torch.equal(c.idx_C, want[0]) and torch.equal(c.new_C, want[1]) and torch.equal(c.old_C, want[2])
        assert c.checksum_change == want[3]
    assert chunks[1].idx_C.numel() == 1
    sink.reset()
    full = random_bits(3000, 16, seed=9)
    sink.append(full, (full ^ 1).to(torch.int16), offset=0, key="big")
    sink.finish()
    with pytest.raises(K.ChangeCapacityError, match="full checkpoint"):
        sink.collect()


@pytest.mark.parametrize(("rows", "tile"), [(1, 1), (2, 4), (4, 16)])
def test_diff_offsets_from_tile_counters_over_many_blocks(monkeypatch, rows, tile):
    # blocks of 32-128 elements and tiles of 1-16 blocks: hundreds of blocks over many tiles, whole
    # blocks and tiles without a change, chunks of different sizes, one sink over two steps
    from rltune.sync.kernels import triton_kernels as tk

    monkeypatch.setattr(tk, "DIFF_ROWS", rows)
    monkeypatch.setattr(tk, "DIFF_TILE", tile)
    sizes = (7000, 4100, 33)
    sink = K.ChangeSink(capacity=2000, max_chunk_elements=7000, max_chunks=3, device=DEVICE, backend="triton")
    for step in range(2):
        olds = [random_bits(n, 16, seed=n + step) for n in sizes]
        news = [perturb(o, 0.02, seed=step + 3) for o in olds]
        news[0][1000:3500] = olds[0][1000:3500]  # 2,500 unchanged elements: empty blocks and tiles
        sink.reset()
        for k, (o, w) in enumerate(zip(olds, news, strict=True)):
            sink.append(o, w, offset=10_000 * k, key=k)
        sink.finish()
        chunks = sink.collect()
        for k, (c, o, w) in enumerate(zip(chunks, olds, news, strict=True)):
            want = R.diff_extract_ref(o.cpu(), w.cpu(), 10_000 * k)
            assert want[0].numel() > 0
            assert torch.equal(c.idx_C, want[0]) and torch.equal(c.new_C, want[1]) and torch.equal(c.old_C, want[2])
            assert c.checksum_change == want[3]


def test_packed_group_aligns_members_to_blocks():
    g = K.PackedGroup([5, 8192, 8193, 1], [0, 3, 7, 9], block=8192)
    assert g.starts == [0, 8192, 16384, 32768] and g.padded == 40960 and g.n == 32769
    blocks, ends, shift = (t.tolist() for t in g.tables(torch.device("cpu")))
    assert blocks == [0, 1, 2, 2, 3] and ends == [5, 16384, 24577, 32769]
    assert shift == [0, 3 - 8192, 7 - 16384, 9 - 32768]
    assert [v.numel() for v in g.views(torch.zeros(g.padded))] == [5, 8192, 8193, 1]
    assert K.PackedGroup([4, 2], [1, 0], block=1).starts == [0, 4]
    for sizes, offsets in (([], []), ([3, 0], [0, 0]), ([3], [0, 1])):
        with pytest.raises(K.KernelError, match="packed group"):
            K.PackedGroup(sizes, offsets, block=64)


@pytest.mark.parametrize(("rows", "tile"), [(2, 4), (None, None)])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_change_sink_groups_equal_the_reference(monkeypatch, rows, tile, backend):
    # members packed at block boundaries (one diff for the group), around a chunk appended alone and a
    # lone member diffed in place; members of 1 element to several blocks, at tensor offsets; floats
    # cast to bf16 on the way in; one sink over two steps. rows=2: 64-element blocks, tiles of 4.
    from rltune.sync.kernels import triton_kernels as tk

    if rows is not None:
        monkeypatch.setattr(tk, "DIFF_ROWS", rows)
        monkeypatch.setattr(tk, "DIFF_TILE", tile)
    block = 32 * (rows or tk.DIFF_ROWS)
    sizes = [1, block - 1, block, block + 1, 3 * block + 7, 3]
    offsets = [0, 5, 2 * block, 0, 11, 1]
    sink = K.ChangeSink(capacity=20_000, max_chunk_elements=max(300, 4 * block), max_chunks=16, device=DEVICE,
                        backend=backend)
    for step in range(2):
        sink.reset()
        tensors = [torch.randn(o + z, generator=torch.Generator().manual_seed(10 * step + i)).to(DEVICE)
                   for i, (z, o) in enumerate(zip(sizes, offsets, strict=True))]
        tensors[-1] = tensors[-1].to(torch.bfloat16)  # a member already in its wire dtype
        want = []
        lone_old = random_bits(300, 16, seed=step)
        lone_new = perturb(lone_old, 0.1, seed=step + 1)
        sink.append(lone_old, lone_new, 40, "lone")
        want.append(("lone",) + R.diff_extract_ref(lone_old.cpu(), lone_new.cpu(), 40))
        for members in ([0, 1, 2, 3, 4], [5]):  # a group, then a lone member in place
            chunks = [tensors[m][offsets[m]:offsets[m] + sizes[m]] for m in members]
            group = sink.group([sizes[m] for m in members], [offsets[m] for m in members])
            sink.stage(group, chunks, torch.bfloat16)
            olds = [R.as_bits(c.to(torch.bfloat16)).clone() for c in chunks]
            for i, c in enumerate(chunks):
                c.add_(torch.randn(c.shape, generator=torch.Generator().manual_seed(i)).to(DEVICE, c.dtype)
                       * (torch.rand(c.shape, generator=torch.Generator().manual_seed(i)) < 0.3).to(DEVICE))
            sink.append_staged(group, chunks, torch.bfloat16, [f"m{m}" for m in members])
            for m, c, o in zip(members, chunks, olds, strict=True):
                want.append((f"m{m}",) + R.diff_extract_ref(o.cpu(), R.as_bits(c.to(torch.bfloat16)).cpu(), offsets[m]))
        sink.finish()
        got = sink.collect()
        assert [c.key for c in got] == [w[0] for w in want]
        for c, w in zip(got, want, strict=True):
            assert torch.equal(c.idx_C.cpu(), w[1]) and torch.equal(c.new_C.cpu(), w[2]), c.key
            assert torch.equal(c.old_C.cpu(), w[3]) and c.checksum_change == w[4], c.key
        assert sum(w[1].numel() for w in want) > 100
        idx, new, old = sink.step_changes()
        assert torch.equal(idx.cpu(), torch.cat([w[1] for w in want]))
        assert torch.equal(old.cpu(), torch.cat([w[3] for w in want]))


def _delta(layout_rows: int, ncols: int, entries: list[int], fraction: float, seed: int, width: int):
    g = torch.Generator().manual_seed(seed)
    idx_parts, offsets = [], [0]
    for _ in entries:
        chosen = torch.nonzero(torch.rand(layout_rows * ncols, generator=g) < fraction).reshape(-1)
        idx_parts.append(chosen)
        offsets.append(offsets[-1] + chosen.numel())
    idx = torch.cat(idx_parts)
    val = random_bits(idx.numel(), 32 if width == 32 else 16, seed=seed + 1, device="cpu").to(torch.int32)
    return torch.tensor(entries), torch.tensor(offsets), idx, val


# the Triton kernel (a GPU, or the interpreter on CI), the compiled CPU pass CPU engines use, and
# that pass in two halves (staged while the engine serves, stored in the pause)
FUSED_BACKENDS = ["triton", "numba", "numba-staged"]


def _fused_device(backend: str) -> str:
    return "cpu" if backend.startswith("numba") else DEVICE


class _StagedPlan:
    """``ApplyPlan.stage`` then ``store`` behind ``apply``'s signature; staging must write nothing."""

    def __init__(self, params, layouts):
        self.params, self.plan = params, K.ApplyPlan(params, layouts, backend="numba")

    def apply(self, *args, **kwargs):
        before = [p.clone() for p in self.params]
        patch = self.plan.stage(*args, **kwargs)
        assert all(torch.equal(p, b) for p, b in zip(self.params, before, strict=True)), "stage wrote a target"
        return self.plan.store(patch)


def _fused_plan(params, layouts, backend):
    return _StagedPlan(params, layouts) if backend == "numba-staged" else K.ApplyPlan(params, layouts, backend=backend)


@pytest.mark.parametrize("mix", [False, True])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("add", [True, False])
def test_fused_apply_equals_reference_with_strides_tables_and_mixed_widths(add, backend, mix):
    rows, ncols = 40, 33
    dev = _fused_device(backend)
    params = [random_bits(rows * ncols, 16, seed=1, device=dev), random_bits(2 * rows * ncols + 10, 16, seed=2, device=dev),
              random_bits(rows * ncols, 32, seed=3, device=dev), random_bits(rows * 20, 16, seed=4, device=dev)]
    g = torch.Generator().manual_seed(5)
    shuffled_rows = torch.randperm(rows, generator=g) * ncols
    cols = torch.arange(ncols)
    col_slice = torch.full((ncols,), -1, dtype=torch.int64)
    col_slice[5:25] = torch.arange(20)  # this worker holds columns 5..24 of a row-parallel layer
    layouts = [
        K.strided_layout(0, [rows, ncols]),                                       # identity
        K.strided_layout(1, [rows, ncols], base=10 + rows * ncols),               # second half of a fused param
        K.strided_layout(1, [rows, ncols], base=10 - 8 * ncols, rows=(8, 30)),    # row slice into first half
        K.strided_layout(2, [rows, ncols]),                                       # fp32
        K.table_layout(0, ncols, shuffled_rows, cols),                            # shuffled rows
        K.table_layout(3, ncols, torch.arange(rows) * 20, col_slice),             # column slice
    ]
    entries = [0, 1, 2, 3, 5]
    entry_tensor, offsets, idx, val = _delta(rows, ncols, entries, 0.2, seed=7, width=16)
    if not add:
        layouts[4] = K.table_layout(0, ncols, shuffled_rows, cols)
    ref_params = [p.cpu().clone() for p in params]
    plan = _fused_plan(params, layouts, backend)
    got = plan.apply(entry_tensor, offsets, idx, val, add=add, mix=mix)
    want = R.apply_deltas_ref(ref_params, layouts, entry_tensor, offsets, idx, val, add, mix=mix)
    want_sums, want_written = want[:2]
    assert got.checksums() == want_sums and got.written() == want_written
    if mix:
        assert got.checksums2() == want[2] and any(want[2]), "reference checksum2 changes are all zero"
    for p, r in zip(params, ref_params, strict=True):
        assert torch.equal(p.cpu(), r)
    assert want_written[3] > 0 and 0 < want_written[4] < offsets[5] - offsets[4], "column slice skipped nothing"
    assert not torch.equal(params[0].cpu(), random_bits(rows * ncols, 16, seed=1, device="cpu"))


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("add", [True, False])
def test_fused_apply_blocks_within_one_entry_take_the_contiguous_path_exactly(add, backend):
    # both checksums: the contiguous path adds the checksum2 lanes of whole blocks
    # 3000 changes of one entry fill whole kernel blocks; the held row window skips some of them
    params = [random_bits(60 * 100 + 50, 16, seed=1, device=_fused_device(backend))]
    layouts = [K.strided_layout(0, [60, 100], base=50 - 200, rows=(2, 50)), K.strided_layout(0, [50])]
    g = torch.Generator().manual_seed(3)
    idx = torch.cat([torch.randperm(6000, generator=g)[:3000].sort().values, torch.arange(0, 50, 7)])
    val = random_bits(idx.numel(), 16, seed=4, device="cpu").to(torch.int32)
    entry_tensor, offsets = torch.tensor([0, 1]), torch.tensor([0, 3000, idx.numel()])
    ref = [params[0].cpu().clone()]
    got = _fused_plan(params, layouts, backend).apply(entry_tensor, offsets, idx, val, add=add, mix=True)
    want_sums, want_written, want_mix = R.apply_deltas_ref(ref, layouts, entry_tensor, offsets, idx, val, add, mix=True)
    assert got.checksums() == want_sums and got.written() == want_written and got.checksums2() == want_mix
    assert torch.equal(params[0].cpu(), ref[0])
    assert 0 < want_written[0] < 3000


@pytest.mark.parametrize("width", [16, 32, 8])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("add", [True, False])
def test_fused_apply_checksum2_at_the_edges_of_its_bounds(add, backend, width):
    # Checkpoint indices across 2**32 (entry 0: rows [2**20 - 1, 2**20 + 1) of 4096 columns, whole
    # blocks and a partial last one), in a column window past 2**33 (entry 1: the per-change path) and
    # past 2**40 (entry 2); old values all ones or with the top bit set, new ones all ones, zero,
    # random or with the top bit set.
    dev = _fused_device(backend)
    r0, r1, r2 = (1 << 20) - 1, (1 << 26) - 8, 1 << 31
    layouts = [K.strided_layout(0, [1 << 21, 4096], base=-r0 * 4096, rows=(r0, r0 + 2)),
               K.strided_layout(1, [1 << 28, 64], base=-r1 * 37 - 3, rows=(r1, r1 + 16), cols=(3, 40)),
               K.strided_layout(2, [1 << 36, 16], base=-r2 * 16, rows=(r2, r2 + 8))]
    top = {8: 0x80, 16: -0x8000, 32: -(1 << 31)}[width]
    params = [torch.full((8192,), -1 if width != 8 else 0xFF, dtype=BITS[width]),
              random_bits(16 * 37, width, seed=1, device="cpu") | top, random_bits(128, width, seed=2, device="cpu")]
    g = torch.Generator().manual_seed(3)
    idx = torch.cat([torch.randperm(8192, generator=g)[:1300].sort().values + r0 * 4096,
                     torch.randperm(16 * 64, generator=g)[:300].sort().values + r1 * 64,  # some outside the columns
                     torch.arange(0, 128, 3) + r2 * 16])
    offsets = torch.tensor([0, 1300, 1600, idx.numel()])
    val = random_bits(idx.numel(), 32, seed=4, device="cpu")
    if not add:
        val[0::4], val[1::4], val[2::4] = -1, 0, val[2::4] | (1 << (width - 1))
    ref = [p.clone() for p in params]
    before = R.checksum2_ref(params[0], r0 * 4096)
    params = [p.to(dev) for p in params]
    got = _fused_plan(params, layouts, backend).apply(torch.arange(3), offsets, idx, val, add=add, mix=True)
    want_sums, want_written, want_mix = R.apply_deltas_ref(ref, layouts, torch.arange(3), offsets, idx, val, add,
                                                          mix=True)
    assert got.checksums2() == want_mix and got.checksums() == want_sums and got.written() == want_written
    assert all(torch.equal(p.cpu(), r) for p, r in zip(params, ref, strict=True))
    assert 0 < want_written[1] < 300 and all(want_mix)
    # the running checksum2 of the held slice follows the change to the full recompute's value
    assert R.checksum2_add(before, want_mix[0]) == R.checksum2_ref(ref[0], r0 * 4096) != before

@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_fused_apply_with_no_changes_and_one_change(backend):
    params = [random_bits(100, 16, seed=1, device=_fused_device(backend))]
    plan = _fused_plan(params, [K.strided_layout(0, [10, 10])], backend)
    empty = plan.apply(torch.tensor([0]), torch.tensor([0, 0]), torch.zeros(0, dtype=torch.int64),
                       torch.zeros(0, dtype=torch.int32))
    assert empty.checksums() == [0] and empty.written() == [0]
    before = params[0].cpu().clone()
    one = plan.apply(torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([99]), torch.tensor([5], dtype=torch.int32))
    assert one.written() == [1]
    assert one.checksums() == [R.checksum_update_ref(torch.tensor([99]), before[99:], params[0].cpu()[99:])]
    assert int(params[0][99]) == (int(before[99]) + 5 + 32768) % 65536 - 32768


def test_the_compiled_cpu_apply_refuses_gpu_parameters():
    if not torch.cuda.is_available():
        with pytest.raises(K.KernelBackendError, match="CPU parameters"):
            K.ApplyPlan([random_bits(10, 16, seed=1, device="meta")], [K.strided_layout(0, [10])], backend="numba")
        return
    with pytest.raises(K.KernelBackendError, match="CPU parameters"):
        K.ApplyPlan([random_bits(10, 16, seed=1, device="cuda")], [K.strided_layout(0, [10])], backend="numba")


def test_fused_apply_rejects_mismatched_offsets():
    plan = K.ApplyPlan([random_bits(10, 16, seed=1)], [K.strided_layout(0, [10])], backend="triton")
    with pytest.raises(K.KernelError, match="entries"):
        plan.apply(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([1]))


def test_positional_apply_equals_receiver_reference():
    target = random_bits(5000, 16, seed=1)
    ref = target.cpu().clone()
    g = torch.Generator().manual_seed(2)
    pos = torch.randperm(5000, generator=g)[:700]
    ckpt_idx = pos * 3 + 1
    diff = wire_diff(ref[pos], random_bits(700, 16, seed=3, device="cpu"), 16)
    got = K.apply_mapped_delta(target, pos.to(DEVICE), diff.to(DEVICE), ckpt_idx.to(DEVICE), backend="triton")
    want = apply_mapped_delta_ref(ref, pos, diff, ckpt_idx)
    assert got == want and want != 0
    assert torch.equal(target.cpu(), ref)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(K.KernelBackendError, match="TRITON_INTERPRET"):
        K.checksum(torch.zeros(3, dtype=torch.int16), backend="triton")
    assert K.checksum(torch.ones(3, dtype=torch.int16)) == 6


def test_layouts_from_a_recorded_index_map_match_its_runs():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rltune.sync.indexmap import IndexMap
    from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    spec = {n: (list(t.shape), "bfloat16") for n, t in model.state_dict().items()}
    cfg = ToyEngineConfig.from_hf(model.config)
    imap = IndexMap.record(lambda dt: ToyEngine(cfg, 1, 2, dtype=dt), spec)
    names, layouts = K.layouts_from_index_map(imap, {n: s for n, (s, _) in spec.items()})
    held = 0
    for name, lay in zip(names, layouts, strict=True):
        runs = imap.tensors[name]
        idx = torch.arange(runs.numel)
        kwargs = {k: v for k, v in lay.items() if k != "target"}
        pos = R.map_positions_ref(idx, **kwargs)
        mask, _, want_pos = runs.locate(idx.numpy())
        assert torch.equal(pos >= 0, torch.from_numpy(mask))
        assert torch.equal(pos[pos >= 0], torch.from_numpy(want_pos))
        held += int(mask.sum())
    assert held > 0


@pytest.mark.gpu
def test_kernels_equal_references_at_real_sizes_on_cuda():
    n = (1 << 26) + 12345  # one 64 M-element optimizer chunk and a ragged tail
    old = random_bits(n, 16, seed=11, device="cuda")
    new = perturb(old, 0.03, seed=12)
    assert K.checksum(old) == R.checksum_ref(old)
    got = K.diff_extract(old, new, offset=(1 << 35))
    want = R.diff_extract_ref(old, new, 1 << 35)
    assert all(torch.equal(g, w) for g, w in zip(got[:3], want[:3], strict=True)) and got[3] == want[3]
    assert want[0].numel() > 0.02 * n
    params = [old.clone(), random_bits(n, 32, seed=13, device="cuda")]
    ref = [p.clone() for p in params]
    layouts = [K.strided_layout(0, [n]), K.strided_layout(1, [n // 7, 7])]
    idx = torch.cat([want[0] - (1 << 35), want[0][:1000] - (1 << 35)])
    val = random_bits(idx.numel(), 32, seed=14, device="cuda")
    entry_tensor, offsets = torch.tensor([0, 1]), torch.tensor([0, want[0].numel(), idx.numel()])
    result = K.ApplyPlan(params, layouts).apply(entry_tensor, offsets, idx, val, add=True, mix=True)
    sums, written, mixes = R.apply_deltas_ref(ref, layouts, entry_tensor, offsets, idx, val, True, mix=True)
    assert result.checksums() == sums and result.written() == written and result.checksums2() == mixes
    assert all(torch.equal(p, r) for p, r in zip(params, ref, strict=True))
    assert K.checksum2(params[1], offset=5) == R.checksum2_ref(params[1], 5)


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.3, 1.0])
def test_change_sink_over_many_chunks_twice_on_cuda(fraction):
    # thousands of blocks per chunk, four chunks, twice: nothing of one step leaks into the next
    n, chunk = (1 << 24) + 777, 1 << 22
    old = random_bits(n, 16, seed=21, device="cuda")
    new = (old ^ 1) if fraction == 1.0 else perturb(old, fraction, seed=22)
    want = R.diff_extract_ref(old, new, 0)
    sink = K.ChangeSink(capacity=n, max_chunk_elements=chunk, max_chunks=8, device="cuda")
    for _ in range(2):
        sink.reset()
        for k, a in enumerate(range(0, n, chunk)):
            sink.append(old[a:a + chunk], new[a:a + chunk], offset=a, key=k)
        sink.finish()
        chunks = sink.collect()
        got = [torch.cat([getattr(c, f) for c in chunks]) for f in ("idx_C", "new_C", "old_C")]
        assert all(torch.equal(g, w.cpu()) for g, w in zip(got, want[:3], strict=True))
        assert sum(c.checksum_change for c in chunks) & R.MASK64 == want[3]


@pytest.mark.gpu
def test_fused_apply_with_unaligned_inputs_and_many_entries_on_cuda():
    # inputs that start 8 bytes into their storage are not 16-byte aligned: the launcher must not
    # run the kernel compiled for aligned ones; 300 entries grow the plan's sums buffers
    params = [random_bits(5000, 16, seed=s, device="cuda") for s in range(3)]
    plan = K.ApplyPlan(params, [K.strided_layout(t, [5000]) for t in range(3)])
    for shift in (0, 1, 0):
        # 100 entries per tensor (split entries), 7 changes each, no element twice in one delta
        entries = torch.arange(3).repeat_interleave(100)
        offsets = torch.arange(301) * 7
        idx = torch.cat([torch.randperm(5000)[:700].view(100, 7).sort(dim=1).values.reshape(-1) for _ in range(3)])
        val = random_bits(idx.numel(), 16, seed=shift + 9, device="cpu").to(torch.int32)
        padded_idx = torch.cat([torch.zeros(shift, dtype=torch.int64), idx]).cuda()
        padded_val = torch.cat([torch.zeros(shift, dtype=torch.int32), val]).cuda()
        ref = [p.cpu().clone() for p in params]
        want_sums, want_written = R.apply_deltas_ref(ref, [K.strided_layout(t, [5000]) for t in range(3)], entries,
                                                     offsets, idx, val, add=False)
        got = plan.apply(entries, offsets, padded_idx[shift:], padded_val[shift:], add=False)
        assert got.checksums() == want_sums and got.written() == want_written
        assert all(torch.equal(p.cpu(), r) for p, r in zip(params, ref, strict=True))


@pytest.mark.gpu
def test_fused_apply_compiles_once_per_plan_not_per_delta():
    from rltune.sync.kernels.triton_kernels import KERNELS, compiled_variants

    params = [random_bits(1 << 20, 16, seed=1, device="cuda"), random_bits(3000, 16, seed=2, device="cuda")]
    plan = K.ApplyPlan(params, [K.strided_layout(0, [1 << 20]), K.strided_layout(1, [30, 100])])
    compiled = compiled_variants(KERNELS["apply_deltas"])
    assert compiled > 0
    for n_changes, entries in ((17, [0]), (100_000, [0, 1]), (3, [1])):
        idx = torch.cat([torch.arange(n_changes) for _ in entries])
        offsets = torch.tensor([0] + [n_changes * (k + 1) for k in range(len(entries))])
        plan.apply(torch.tensor(entries), offsets, idx.cuda(), torch.ones(idx.numel(), dtype=torch.int32).cuda())
    assert compiled_variants(KERNELS["apply_deltas"]) == compiled, "a delta recompiled the apply kernel"


def test_the_compiled_cpu_apply_splits_a_large_delta_over_two_threads_exactly():
    # above the size at which a second thread starts: entries dealt to two threads, same bits and sums
    params = [random_bits(400 * 512, 16, seed=s, device="cpu") for s in range(1, 4)]
    layouts = [K.strided_layout(t, [400, 512]) for t in range(3)] + [K.strided_layout(1, [400, 256], rows=(100, 300),
                                                                                    cols=(0, 256), row_stride=512)]
    entry_tensor, offsets, idx, val = _delta(400, 512, [0, 1, 2], 0.3, seed=9, width=16)
    assert offsets[-1] > (1 << 16)
    ref = [p.clone() for p in params]
    from rltune.sync.kernels.cpu_kernels import apply_deltas_cpu, stage_deltas_cpu, store_staged_cpu

    staged_params = [p.clone() for p in params]
    sums, written, mixes = apply_deltas_cpu(params, layouts, entry_tensor, offsets, idx, val, add=True, threads=2,
                                            mix=True)
    want_sums, want_written, want_mix = R.apply_deltas_ref(ref, layouts, entry_tensor, offsets, idx, val, True, mix=True)
    assert [s & R.MASK64 for s in sums] == want_sums and written == want_written and mixes == want_mix
    for p, r in zip(params, ref, strict=True):
        assert torch.equal(p, r)
    # the same delta staged and stored, each half over two threads
    (sums, written, mixes), pos, new = stage_deltas_cpu(staged_params, layouts, entry_tensor, offsets, idx, val,
                                                        add=True, threads=2, mix=True)
    assert [s & R.MASK64 for s in sums] == want_sums and written == want_written and mixes == want_mix
    assert int((pos >= 0).sum()) == sum(want_written) == idx.numel()
    store_staged_cpu(staged_params, layouts, entry_tensor, offsets, pos, new, threads=2)
    for p, r in zip(staged_params, ref, strict=True):
        assert torch.equal(p, r)


def test_stage_and_store_are_the_compiled_cpu_pass_only():
    plan = K.ApplyPlan([random_bits(10, 16, seed=1)], [K.strided_layout(0, [10])], backend="torch")
    with pytest.raises(K.KernelBackendError, match="numba"):
        plan.stage(torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([1], dtype=torch.int32))
