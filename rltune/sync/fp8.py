"""Deltas for fp8 engines: online fp8 per-block quantisation (e4m3, float32 or ue8m0 scales) and its diffs.

An engine that quantises its bf16 checkpoint online to fp8 per block holds, per weight ``name`` of
shape ``[R, C]``, the e4m3 values ``name`` and one scale per 128-row x 128-column block,
``{name}_scale_inv`` (the dequantisation multiplier, ``[ceil(R/128), ceil(C/128)]``). The trainer
quantises the old and the new weights with the same quantiser (:func:`quantize_blocks`, a fixed
sequence of IEEE float32 operations, so the same bits on every device), diffs the fp8 bytes and the
scale bits, and sends both as ordinary changes: the engine patches them in place, and the result
is bit-identical to quantising the new weights from scratch (a full fp8 reload).

Quantiser, per block ``b`` of ``x = w.float()``::

    amax  = max |x| over the block (1e-12 if the block is all zeros)
    scale = amax / 448                        # 448 = largest e4m3 value
    ue8m0: scale = 2 ** ceil(log2(scale))     # power of two (DeepGEMM), via frexp (exact)
    q     = clamp(x / scale, -448, 448).to(float8_e4m3fn)
    scale_inv = scale                         # float32, or float8_e8m0fnu for ue8m0

Blocks are whole 128-row slabs, so a slab of rows ``[r0, r1)`` with ``r0`` a multiple of 128 can be
quantised and diffed on its own (:func:`fp8_slab_delta`), e.g. per optimizer chunk.

Example::

    old_q = quantize_blocks(w_before)               # what the engine holds
    changes = fp8_delta("mlp.down_proj.weight", w_before, w_after)
    for name, (idx, new_bits) in changes.items():  # name and name + "_scale_inv"
        apply_delta_ref(as_bits(engine[name]), idx, new_bits)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltune.errors import RltuneError
from rltune.sync.kernels.reference import as_bits, diff_ref

E4M3_MAX = 448.0
BLOCK = 128
SCALE_FORMATS = ("float32", "ue8m0")


class Fp8Error(RltuneError):
    """A tensor cannot be quantised or diffed as fp8 per block."""


@dataclass
class Fp8Weight:
    """One fp8-per-block weight as an engine holds it."""

    q: torch.Tensor  # float8_e4m3fn [R, C]
    scale_inv: torch.Tensor  # float32 or float8_e8m0fnu [ceil(R/128), ceil(C/128)]


def _check(w: torch.Tensor, scale_format: str) -> None:
    if w.dim() != 2:
        raise Fp8Error(f"fp8 per-block quantisation needs a 2-D weight, got shape {list(w.shape)}; keep 1-D tensors "
                       "(norms, biases) in bf16")
    if scale_format not in SCALE_FORMATS:
        raise Fp8Error(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    if scale_format == "ue8m0" and not hasattr(torch, "float8_e8m0fnu"):
        raise Fp8Error("ue8m0 scales need torch.float8_e8m0fnu (torch >= 2.7)")


def _power_of_two_ceil(scale: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def quantize_blocks(w: torch.Tensor, scale_format: str = "float32", block: int = BLOCK) -> Fp8Weight:
    """Quantise a 2-D weight to e4m3 with one scale per ``block`` x ``block`` block (see module doc)."""
    _check(w, scale_format)
    rows, cols = w.shape
    rb, cb = -(-rows // block), -(-cols // block)
    x = torch.zeros(rb * block, cb * block, dtype=torch.float32, device=w.device)
    x[:rows, :cols] = w.detach().float()
    blocks = x.view(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / E4M3_MAX
    if scale_format == "ue8m0":
        scale = _power_of_two_ceil(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(rb * block, cb * block)[:rows, :cols].contiguous()
    scale_inv = scale.to(torch.float8_e8m0fnu) if scale_format == "ue8m0" else scale
    return Fp8Weight(q, scale_inv.contiguous())


def fp8_slab_delta(name: str, old_rows: torch.Tensor, new_rows: torch.Tensor, row0: int = 0,
                   scale_format: str = "float32", block: int = BLOCK) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Changes of the fp8 values and block scales of rows ``[row0, row0 + len)`` of weight ``name``.

    ``row0`` must start a block (multiple of ``block``) and the slab must end on a block boundary or
    at the tensor's last row, so its blocks are whole. Returns ``{name: (idx, new e4m3 bits),
    name + "_scale_inv": (idx, new scale bits)}`` with indices into the full tensors (only entries
    with changes).
    """
    if old_rows.shape != new_rows.shape:
        raise Fp8Error(f"{name}: old slab {list(old_rows.shape)} and new slab {list(new_rows.shape)} differ in shape")
    if row0 % block:
        raise Fp8Error(f"{name}: slab starts at row {row0}, not a multiple of the {block}-row block; align chunks "
                       "to whole row blocks")
    old, new = quantize_blocks(old_rows, scale_format, block), quantize_blocks(new_rows, scale_format, block)
    cols = old_rows.shape[1]
    out = {}
    idx, bits = diff_ref(as_bits(old.q), as_bits(new.q))
    if idx.numel():
        out[name] = (idx + row0 * cols, bits)
    idx, bits = diff_ref(as_bits(old.scale_inv), as_bits(new.scale_inv))
    if idx.numel():
        out[f"{name}_scale_inv"] = (idx + (row0 // block) * old.scale_inv.shape[1], bits)
    return out


def fp8_delta(name: str, old_w: torch.Tensor, new_w: torch.Tensor, scale_format: str = "float32",
              block: int = BLOCK) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Changes of a whole weight's fp8 values and scales (see :func:`fp8_slab_delta`)."""
    return fp8_slab_delta(name, old_w, new_w, 0, scale_format, block)


__all__ = ["BLOCK", "E4M3_MAX", "Fp8Error", "Fp8Weight", "fp8_delta", "fp8_slab_delta", "quantize_blocks"]
