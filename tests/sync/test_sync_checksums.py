"""Checksum identities the sync path relies on (property-based), using the reference definitions."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltune.sync.kernels.reference import MASK64, as_bits, checksum_ref, checksum_update_ref
from rltune.sync.ops import apply_mapped_delta_ref, wire_add, wire_diff

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


@st.composite
def tensor_and_changes(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 500))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    t = torch.randn(n, generator=g).to(dtype)
    k = draw(st.integers(0, n))
    idx = torch.randperm(n, generator=g)[:k].sort().values
    new = t.clone()
    new[idx] = torch.randn(k, generator=g).to(dtype)
    return t, new, idx


@settings(max_examples=80, deadline=None)
@given(tensor_and_changes(), st.integers(0, 2**40))
def test_shares_of_a_partition_add_up_to_the_whole(case, offset):
    t, _, _ = case
    bits = as_bits(t)
    cut = bits.numel() // 3
    parts = checksum_ref(bits[:cut], offset=offset) + checksum_ref(bits[cut:], offset=offset + cut)
    assert parts & MASK64 == checksum_ref(bits, offset=offset)


@settings(max_examples=80, deadline=None)
@given(tensor_and_changes())
def test_running_checksum_follows_a_relative_delta_exactly(case):
    old_t, new_t, idx = case
    old, new = as_bits(old_t), as_bits(new_t)
    width = {torch.int16: 16, torch.int32: 32}[old.dtype]
    diff = wire_diff(old[idx], new[idx], width)
    assert torch.equal(wire_add(old[idx], diff, width), new[idx])
    target = old.clone()
    # a shuffled map: checkpoint element i lives at parameter position perm[i]
    perm = torch.randperm(old.numel(), generator=torch.Generator().manual_seed(7))
    param = torch.empty_like(target)
    param[perm] = target
    change = apply_mapped_delta_ref(param, perm[idx], diff, idx)
    assert torch.equal(param[perm], new)
    assert (checksum_ref(old) + change) & MASK64 == checksum_ref(new)
    assert change == checksum_update_ref(idx, old[idx], new[idx])


def test_checksum_sees_a_swap_and_a_double_apply():
    t = as_bits(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    swapped = t[[1, 0, 2]]
    assert checksum_ref(t) != checksum_ref(swapped)
    idx, diff = torch.tensor([1]), torch.tensor([5])
    once = t.clone()
    c1 = apply_mapped_delta_ref(once, idx, diff, idx)
    twice = once.clone()
    c2 = apply_mapped_delta_ref(twice, idx, diff, idx)
    assert c2 != 0 and (checksum_ref(t) + c1 + c2) & MASK64 == checksum_ref(twice) != checksum_ref(once)


def test_wire_diff_wraps_around_the_sign_boundary():
    old = torch.tensor([32767, -32768, 0], dtype=torch.int16)
    new = torch.tensor([-32768, 32767, -1], dtype=torch.int16)
    d = wire_diff(old, new, 16)
    assert d.tolist() == [1, -1, -1]
    assert torch.equal(wire_add(old, d, 16), new)
