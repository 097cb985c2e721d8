"""Reference element operations the sync path needs beyond ``kernels.reference``.

``kernels.reference`` defines the wire-bit view and the checksum; this module adds the operations
that work on *relative* deltas (the codec carries ``new - old`` wire bits, wrapped) and on mapped
writes (checkpoint element -> engine parameter element). Each is the torch reference a GPU kernel
must match bit for bit (``torch.equal``):

- ``wire_diff(old, new, bits)``: signed wrapped difference ``(u_new - u_old) mod 2^bits`` in
  ``[-2^(bits-1), 2^(bits-1))``, int64.
- ``wire_add(old, diff, bits)``: the inverse, ``(u_old + diff) mod 2^bits`` as the same bits dtype.
- ``apply_mapped_delta_ref(target_bits_N, pos_C, diff_C, ckpt_idx_C)``: add ``diff_C`` to the
  elements ``pos_C`` of a parameter in place and return the change of the *checkpoint tensor's*
  checksum, whose position weights are ``ckpt_idx_C + 1`` (not the parameter positions).

Example::

    from rltune.sync.ops import wire_diff, apply_mapped_delta_ref
    d = wire_diff(old_bits, new_bits, 16)
    change = apply_mapped_delta_ref(param_bits, positions, d, checkpoint_indices)
"""

from __future__ import annotations

import torch

from rltune.sync import format as fmt
from rltune.sync.kernels.reference import BITS_WIDTH, as_bits, checksum_update_ref, unsigned

WIRE_BITS = BITS_WIDTH  # wire bits per element of each bits view (int16 / int32 / uint8)


def wire_width(bits_tensor: torch.Tensor) -> int:
    """Number of wire bits per element of a bits view (8, 16 or 32)."""
    try:
        return WIRE_BITS[bits_tensor.dtype]
    except KeyError:
        raise TypeError(f"{bits_tensor.dtype} is not a wire-bit dtype") from None


def wire_diff(old_bits: torch.Tensor, new_bits: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed wrapped difference of two bits tensors, int64."""
    d = (unsigned(new_bits) - unsigned(old_bits)) & ((1 << bits) - 1)
    return torch.where(d >= (1 << (bits - 1)), d - (1 << bits), d)


def wire_add(old_bits: torch.Tensor, diff: torch.Tensor, bits: int) -> torch.Tensor:
    """``(u_old + diff) mod 2^bits`` in ``old_bits``'s dtype."""
    u = (unsigned(old_bits) + diff.to(torch.int64)) & ((1 << bits) - 1)
    if old_bits.dtype != torch.uint8:
        u = torch.where(u >= (1 << (bits - 1)), u - (1 << bits), u)
    return u.to(old_bits.dtype)


def apply_mapped_delta_ref(target_bits_N: torch.Tensor, pos_C: torch.Tensor, diff_C: torch.Tensor,
                           ckpt_idx_C: torch.Tensor) -> int:
    """Add ``diff_C`` at parameter positions ``pos_C``; return the checkpoint-checksum change.

    Positions must be unique. The checksum change uses the checkpoint indices as positions, so a
    running checksum of the checkpoint tensor follows the writes whatever the engine's layout.
    """
    target_bits_N = target_bits_N.reshape(-1)
    if pos_C.numel() == 0:
        return 0
    bits = wire_width(target_bits_N)
    old = target_bits_N[pos_C]
    new = wire_add(old, diff_C, bits)
    target_bits_N[pos_C] = new
    return checksum_update_ref(ckpt_idx_C, old, new)


# A value's wire bits hold inf or NaN when all of its dtype's nonfinite bits are set (the format's table).
NONFINITE_BITS = {getattr(torch, w.name): w.nonfinite for w in fmt.WIRE_DTYPES.values() if hasattr(torch, w.name)}


def count_nonfinite(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How many elements of ``bits`` (wire bits of ``dtype``, signed or unsigned view) are inf or NaN,
    as a 0-dim int64 tensor on their device (no host sync). Zero for a dtype that is not floating."""
    mask = NONFINITE_BITS.get(dtype)
    if mask is None:
        return torch.zeros((), dtype=torch.int64, device=bits.device)
    return ((bits & mask) == mask).sum()


def wire_bits(tensor: torch.Tensor, wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Wire bits of a tensor as sent: cast to ``wire_dtype`` first when it differs (fp32 master -> bf16)."""
    if wire_dtype is not None and tensor.dtype != wire_dtype:
        tensor = tensor.detach().to(wire_dtype)
    return as_bits(tensor.detach().contiguous())


__all__ = ["NONFINITE_BITS", "apply_mapped_delta_ref", "count_nonfinite", "wire_add", "wire_bits", "wire_diff", "wire_width"]
