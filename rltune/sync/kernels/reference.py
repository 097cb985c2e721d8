"""Torch reference implementations of the weight-sync element operations.

These are the CPU path, the oracle every Triton kernel is compared with bit for bit
(``torch.equal``), and the baseline every kernel benchmark reports its ratio against. They work
on *wire bits*: the raw integer pattern of each element (bf16/fp16 -> 16 bits, fp8 -> 8 bits,
fp32 -> 32 bits), so a patch never rounds and a checksum sees every bit.

Shape suffixes: ``_N`` one entry per element of a flattened tensor, ``_C`` one per change.

Checksum (docs/delta-format.md, "Checksums"): for a tensor flattened in row-major order with
unsigned wire bits ``u[i]``,

    checksum = sum_i (i + 1) * u[i]   mod 2**64

It is position-weighted, so swapped or shifted elements change it, and it is linear, so a delta
that moves element ``i`` from ``u_old`` to ``u_new`` changes it by ``(i + 1) * (u_new - u_old)``
mod 2**64: a receiver keeps it up to date in O(changes).
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1

# Signed integer view of each element type; the unsigned value is view & mask.
_BITS_VIEW = {
    torch.bfloat16: (torch.int16, 0xFFFF),
    torch.float16: (torch.int16, 0xFFFF),
    torch.float32: (torch.int32, 0xFFFFFFFF),
    torch.int16: (torch.int16, 0xFFFF),
    torch.int32: (torch.int32, 0xFFFFFFFF),
    torch.uint8: (torch.uint8, 0xFF),
    torch.int8: (torch.uint8, 0xFF),
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _BITS_VIEW[getattr(torch, _name)] = (torch.uint8, 0xFF)

# Elements per chunk when a reference walks a large tensor (bounds its int64 temporaries).
_CHUNK = 1 << 22


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype that holds one element's wire bits."""
    try:
        return _BITS_VIEW[dtype][0]
    except KeyError:
        raise TypeError(f"no wire-bit view for dtype {dtype}") from None


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view (no copy) of a contiguous tensor's elements, flattened."""
    if not tensor.is_contiguous():
        raise ValueError("as_bits needs a contiguous tensor")
    return tensor.reshape(-1).view(bits_dtype(tensor.dtype))


def unsigned(bits: torch.Tensor) -> torch.Tensor:
    """The unsigned value of each element's bits, as int64."""
    mask = _BITS_VIEW[bits.dtype][1]
    return bits.to(torch.int64) & mask


def _to_u64(value: int) -> int:
    return value & MASK64


def _wrap_sum(values_i64: torch.Tensor) -> int:
    # int64 addition wraps modulo 2**64 (two's complement), which is exactly the checksum's ring.
    return _to_u64(int(values_i64.sum(dtype=torch.int64)))


def checksum_ref(bits_N: torch.Tensor, offset: int = 0) -> int:
    """sum_i (offset + i + 1) * u[i] mod 2**64 over a flat bits tensor.

    ``offset`` lets a holder of rows ``[r0, r1)`` of a tensor compute its share of the full
    tensor's checksum: the shares of disjoint slices add up (mod 2**64) to the whole.
    """
    bits_N = bits_N.reshape(-1)
    total = 0
    for start in range(0, bits_N.numel(), _CHUNK):
        chunk = unsigned(bits_N[start:start + _CHUNK])
        pos = torch.arange(offset + start + 1, offset + start + 1 + chunk.numel(), dtype=torch.int64,
                           device=chunk.device)
        total += _wrap_sum(pos * chunk)
    return _to_u64(total)


def checksum_update_ref(idx_C: torch.Tensor, old_bits_C: torch.Tensor, new_bits_C: torch.Tensor) -> int:
    """Change of the checksum when elements ``idx_C`` go from ``old_bits_C`` to ``new_bits_C``."""
    if idx_C.numel() == 0:
        return 0
    step = (idx_C.to(torch.int64) + 1) * (unsigned(new_bits_C) - unsigned(old_bits_C))
    return _wrap_sum(step)


def diff_ref(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Changed elements: (flat indices int64 ascending, new bits) where old != new."""
    if old_bits_N.shape != new_bits_N.shape or old_bits_N.dtype != new_bits_N.dtype:
        raise ValueError("diff_ref needs two bits tensors of the same shape and dtype")
    old_bits_N, new_bits_N = old_bits_N.reshape(-1), new_bits_N.reshape(-1)
    idx_C = torch.nonzero(old_bits_N != new_bits_N, as_tuple=False).reshape(-1)
    return idx_C, new_bits_N[idx_C]


def apply_delta_ref(target_bits_N: torch.Tensor, idx_C: torch.Tensor, new_bits_C: torch.Tensor) -> int:
    """Write ``new_bits_C`` at ``idx_C`` in place; return the checksum change it made.

    Indices must be unique (a delta never names an element twice), so the order of writes does
    not matter.
    """
    target_bits_N = target_bits_N.reshape(-1)
    if idx_C.numel() == 0:
        return 0
    idx_C = idx_C.to(torch.int64)
    old_bits_C = target_bits_N[idx_C]
    target_bits_N[idx_C] = new_bits_C.to(target_bits_N.dtype)
    return checksum_update_ref(idx_C, old_bits_C, new_bits_C.to(target_bits_N.dtype))


__all__ = [
    "MASK64",
    "apply_delta_ref",
    "as_bits",
    "bits_dtype",
    "checksum_ref",
    "checksum_update_ref",
    "diff_ref",
    "unsigned",
]
