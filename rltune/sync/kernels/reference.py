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

Linear also means that edits whose weighted changes cancel pass it: +2 at element ``i`` and -1 at
element ``2i + 1``, or (+1, -3, +3, -1) on four neighbours against any polynomial weighting. The
**second checksum** (``checksum2``) weighs each element by a hash of its position instead, in two
lanes modulo the prime ``P = 2**31 - 1``:

    h(i)   = mix32((i mod 2**32) xor ((i >> 32) * 0x9E3779B9 mod 2**32))
    wa(i)  = (h(i) mod 2**30) + 1,   wb(i) = (mix32(h(i) xor 0x5BD1E995) mod 2**30) + 1
    a      = sum_i wa(i) * (u[i] mod P)   mod P,      b = the same with wb
    checksum2 = a * 2**32 + b

``mix32`` is the 32-bit finaliser ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B;
x ^= x >> 16`` (mod 2**32, a bijection). The weights share no structure with ``i + 1``, so an edit
the first checksum cannot see moves the second one like any other edit (it passes both only by
chance, ~2**-62). It is linear too, so it follows deltas in O(changes) the same way, and the shares
of a partition add up lane by lane (mod P). Every intermediate fits in int64: ``w < 2**30``,
``u mod P < 2**31``, and products are folded (``(x & P) + (x >> 31)``) before they are summed.
"""

from __future__ import annotations

import torch

from rltune.sync import format as fmt

MASK64 = (1 << 64) - 1

# Every width's integer view (rltune.sync.format.BITS_INTEGERS) and its mask, and the signed integer
# view of each element type the format carries; the unsigned value is view & mask.
BITS_WIDTH = {getattr(torch, name): bits for bits, name in fmt.BITS_INTEGERS.items()}
BITS_MASK = {view: fmt.wire_mask(bits) for view, bits in BITS_WIDTH.items()}
_BITS_VIEW = {view: (view, mask) for view, mask in BITS_MASK.items()}
_VIEW_OF_WIDTH = {bits: view for view, bits in BITS_WIDTH.items()}
for _wire in fmt.WIRE_DTYPES.values():
    if hasattr(torch, _wire.name):
        _view = _VIEW_OF_WIDTH[_wire.bits]
        _BITS_VIEW[getattr(torch, _wire.name)] = (_view, BITS_MASK[_view])
# not wire dtypes of their own: int8 bytes, and the ue8m0 block scales of fp8 weights (rltune.sync.fp8)
_BITS_VIEW[torch.int8] = _BITS_VIEW[torch.uint8]
if hasattr(torch, "float8_e8m0fnu"):
    _BITS_VIEW[torch.float8_e8m0fnu] = _BITS_VIEW[torch.uint8]

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


# ------------------------------------------------------------------------------ the second checksum

P31 = (1 << 31) - 1  # the prime of both lanes of checksum2
_M32 = 0xFFFFFFFF
_M30 = (1 << 30) - 1
MIX_C1, MIX_C2, MIX_HI, MIX_LANE_B = 0x7FEB352D, 0x846CA68B, 0x9E3779B9, 0x5BD1E995


def mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser of checksum2's position hash, on int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * MIX_C1) & _M32  # int64 products wrap mod 2**64; the low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * MIX_C2) & _M32
    return x ^ (x >> 16)


def checksum2_weights_ref(idx_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both lanes' weights ``(wa, wb)`` (int64, in ``[1, 2**30]``) of flat positions ``idx_C >= 0``."""
    idx_C = idx_C.to(torch.int64)
    h = mix32_ref((idx_C & _M32) ^ (((idx_C >> 32) * MIX_HI) & _M32))
    return (h & _M30) + 1, (mix32_ref(h ^ MIX_LANE_B) & _M30) + 1


def _mod_p(u: torch.Tensor) -> torch.Tensor:
    # u in [0, 2**32) -> u mod P: (u & P) + (u >> 31) <= P + 1
    v = (u & P31) + (u >> 31)
    return torch.where(v >= P31, v - P31, v)


def _fold(x: torch.Tensor) -> torch.Tensor:
    # x in [0, 2**62) -> a value < 2**32 congruent to x mod P (2**31 = 1 mod P)
    return (x & P31) + (x >> 31)


def checksum2_pack(a: int, b: int) -> int:
    """checksum2 as one u64: lane a in the high 32 bits, lane b in the low ones."""
    return ((a % P31) << 32) | (b % P31)


def checksum2_lanes(value: int) -> tuple[int, int]:
    """The two lanes of a packed checksum2 (each in ``[0, P)``)."""
    return (value >> 32) % P31, (value & _M32) % P31


def checksum2_add(x: int, y: int) -> int:
    """Sum of two packed checksum2 values (lane by lane, mod P): shares of a partition add up so."""
    (xa, xb), (ya, yb) = checksum2_lanes(x), checksum2_lanes(y)
    return checksum2_pack(xa + ya, xb + yb)


def checksum2_scale(x: int, m: int) -> int:
    """``m`` copies of a packed checksum2 (a tensor held whole by ``m`` workers)."""
    a, b = checksum2_lanes(x)
    return checksum2_pack(a * m, b * m)


def checksum2_ref(bits_N: torch.Tensor, offset: int = 0) -> int:
    """Packed ``checksum2`` of a flat bits tensor holding elements ``[offset, offset + N)``."""
    bits_N = bits_N.reshape(-1)
    a = b = 0
    for start in range(0, bits_N.numel(), _CHUNK):
        v = _mod_p(unsigned(bits_N[start:start + _CHUNK]))
        pos = torch.arange(offset + start, offset + start + v.numel(), dtype=torch.int64, device=v.device)
        wa, wb = checksum2_weights_ref(pos)
        a += int(_fold(wa * v).sum())
        b += int(_fold(wb * v).sum())
    return checksum2_pack(a, b)


def checksum2_contributions_ref(idx_C: torch.Tensor, old_bits_C: torch.Tensor,
                                new_bits_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each change's two lane contributions (int64, each < 2**32 and congruent mod P to
    ``w(idx) * (u_new - u_old)``): summed over any set of changes (exact in int64 up to 2**31 of
    them), then reduced mod P, they are that set's checksum2 change."""
    d = _mod_p(unsigned(new_bits_C)) - _mod_p(unsigned(old_bits_C)) + P31  # in [1, 2P): w * d < 2**62
    wa, wb = checksum2_weights_ref(idx_C.to(d.device))
    return _fold(wa * d), _fold(wb * d)


def checksum2_update_ref(idx_C: torch.Tensor, old_bits_C: torch.Tensor, new_bits_C: torch.Tensor) -> int:
    """Packed change of checksum2 when elements ``idx_C`` go from ``old_bits_C`` to ``new_bits_C``."""
    if idx_C.numel() == 0:
        return 0
    lane_a, lane_b = checksum2_contributions_ref(idx_C, old_bits_C, new_bits_C)
    return checksum2_pack(int(lane_a.sum()), int(lane_b.sum()))


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


def diff_extract_ref(old_bits_N: torch.Tensor, new_bits_N: torch.Tensor,
                     offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Oracle of the diff/extract kernel: changed elements of a chunk and the checksum change they make.

    The chunk holds elements ``[offset, offset + N)`` of its tensor. Returns ``(idx_C, new_C, old_C,
    checksum_change)``: absolute indices (int64, ascending), the new and old wire bits of those
    elements (as int32 unsigned bit patterns, the width every kernel output uses) and
    ``sum (idx + 1) * (u_new - u_old) mod 2**64``.
    """
    local_C, new_C = diff_ref(old_bits_N, new_bits_N)
    old_C = old_bits_N.reshape(-1)[local_C]
    idx_C = local_C + offset
    change = checksum_update_ref(idx_C, old_C, new_C)
    return idx_C, unsigned(new_C).to(torch.int32), unsigned(old_C).to(torch.int32), change


def wrapping_add_bits(old_bits: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """``(u_old + diff) mod 2**width`` in ``old_bits``'s dtype: the add-mode patch of one element."""
    width = BITS_WIDTH[old_bits.dtype]
    u = (unsigned(old_bits) + diff.to(torch.int64)) & ((1 << width) - 1)
    if old_bits.dtype != torch.uint8:
        u = torch.where(u >= (1 << (width - 1)), u - (1 << width), u)
    return u.to(old_bits.dtype)


def map_positions_ref(idx_C: torch.Tensor, ncols: int, base: int, row_stride: int, col_stride: int,
                      row_window: tuple[int, int], col_window: tuple[int, int],
                      row_table: torch.Tensor | None = None,
                      col_table: torch.Tensor | None = None) -> torch.Tensor:
    """Target position of each checkpoint element, -1 where this worker does not hold it.

    Element ``i`` is at row ``r = i // ncols`` and column ``c = i % ncols`` of its checkpoint tensor.
    With strides it lives at ``base + r * row_stride + c * col_stride`` when ``r`` and ``c`` are inside
    the held windows; with offset tables (one int64 per row / per column, -1 = not held) at
    ``base + row_table[r] + col_table[c]``.
    """
    idx_C = idx_C.to(torch.int64)
    r, c = idx_C // ncols, idx_C % ncols
    if row_table is not None:
        rt, ct = row_table.to(idx_C.device)[r], col_table.to(idx_C.device)[c]
        return torch.where((rt >= 0) & (ct >= 0), base + rt + ct, torch.full_like(idx_C, -1))
    held = (r >= row_window[0]) & (r < row_window[1]) & (c >= col_window[0]) & (c < col_window[1])
    return torch.where(held, base + r * row_stride + c * col_stride, torch.full_like(idx_C, -1))


def apply_deltas_ref(targets: list[torch.Tensor], layouts: list[dict], entry_tensor_E: torch.Tensor,
                     entry_offsets_E1: torch.Tensor, idx_C: torch.Tensor, val_C: torch.Tensor,
                     add: bool, mix: bool = False) -> tuple[list[int], ...]:
    """Oracle of the fused apply kernel: patch a whole multi-tensor delta in place.

    ``targets``: flat bits views of the worker's parameters. ``layouts[t]``: how checkpoint tensor
    ``t`` maps into them, a dict with ``target`` (index into ``targets``) and the keyword arguments
    of :func:`map_positions_ref`. The delta has E entries; entry ``e`` carries changes
    ``[entry_offsets_E1[e], entry_offsets_E1[e + 1])`` of checkpoint tensor ``entry_tensor_E[e]``:
    checkpoint indices ``idx_C`` (unique within an entry) and values ``val_C`` (new bits, or with
    ``add`` the wrapped difference to add). Changes this worker does not hold are skipped.

    Returns per entry the running-checksum change (position weights ``idx + 1`` of the checkpoint
    tensor) and the number of changes written; with ``mix`` also the packed checksum2 change.
    """
    checksums, written, mixes = [], [], []
    offsets = entry_offsets_E1.tolist()
    for e, t in enumerate(entry_tensor_E.tolist()):
        lay = layouts[t]
        sl = slice(offsets[e], offsets[e + 1])
        idx = idx_C[sl].to(torch.int64)
        target = targets[lay["target"]]
        kwargs = {k: v for k, v in lay.items() if k != "target"}
        pos = map_positions_ref(idx, **kwargs).to(target.device)
        held = pos >= 0
        pos, idx, val = pos[held], idx[held.to(idx.device)], val_C[sl][held.to(val_C.device)].to(target.device)
        old = target[pos]
        new = wrapping_add_bits(old, val) if add else unsigned(val).to(target.dtype) if target.dtype == torch.uint8 \
            else _signed_bits(val, target.dtype)
        target[pos] = new
        checksums.append(checksum_update_ref(idx.to(target.device), old, new))
        written.append(int(pos.numel()))
        if mix:
            mixes.append(checksum2_update_ref(idx.to(target.device), old, new))
    return (checksums, written, mixes) if mix else (checksums, written)


def fma32_ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors rounded once, as a GPU's fused multiply-add rounds it.

    The product of two float32 values is exact in float64; the sum is rounded to float64 and then
    moved to round-to-odd (when inexact and even, one float64 step toward the exact sum's side, known
    from the sum's error term), and a round-to-odd value with 29 spare bits rounds to float32 exactly
    as the exact sum would, subnormals included."""
    a64, b64, c64 = a.double(), b.double(), c.double()  # float32 values (or float64 holding them)
    p = a64 * b64
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)  # s + err == p + c exactly
    bits = s.view(torch.int64)
    inexact = (err != 0) & torch.isfinite(s) & ((bits & 1) == 0)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    return torch.where(inexact, bits + step, bits).view(torch.float64).float()


def adamw_beta_powers(steps: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """``[beta1**step, beta2**step]`` per step count (float32, shape ``[2, M]``), computed on the
    steps' device with torch's float32 ``pow``, the function torch's fused AdamW calls."""
    key = (steps.device, beta1, beta2)
    betas = _BETAS.get(key)
    if betas is None:  # made once: a copy to the GPU each step would wait for it to drain
        betas = _BETAS[key] = torch.tensor([[beta1], [beta2]], dtype=torch.float32, device=steps.device)
    return torch.pow(betas, steps.reshape(1, -1).float())


def adamw_bias_corrections(steps: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """``[1 - beta1**step, 1 - beta2**step]`` per step count (float32, ``[2, M]``), as torch's fused
    AdamW computes them."""
    return 1 - adamw_beta_powers(steps, beta1, beta2)


_BETAS: dict[tuple, torch.Tensor] = {}


def adamw_step_ref(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   bias_corrections: tuple[torch.Tensor | float, torch.Tensor | float], lr: float, beta1: float,
                   beta2: float, weight_decay: float, eps: float, maximize: bool = False) -> None:
    """One AdamW update in place, with the arithmetic of torch's fused CUDA AdamW, in float32.

    Each value is widened to float32; the weight decay ``p -= (lr * wd) * p`` and both moments are
    fused multiply-adds (``m = fma(b1, m, fma(-b1, g, g))``, ``v = fma(b2, v, fma(-b2, g*g, g*g))``);
    ``p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`` rounds each operation; the results are
    rounded back to the tensors' dtypes. ``bias_corrections``: ``(1 - beta1**step, 1 - beta2**step)``
    as float32 (:func:`adamw_bias_corrections`). The oracle of the fused AdamW + diff kernel.
    """
    # Every float32 operation is done in float64 and rounded to float32, which is the correctly
    # rounded float32 result for + - * / and sqrt (53 >= 2 * 24 + 2 bits); torch's own float32
    # kernels on a CPU need not be (its vectorised sqrt is not).
    def r(x: torch.Tensor) -> torch.Tensor:
        return x.float().double()

    dev = param.device
    p, g = param.double(), grad.double()
    m, v = exp_avg.double(), exp_avg_sq.double()
    if maximize:
        g = -g
    lr32, b1, b2, eps32 = (r(torch.tensor(x, dtype=torch.float64, device=dev)) for x in (lr, beta1, beta2, eps))
    if weight_decay != 0:
        lw = r(lr32 * r(torch.tensor(weight_decay, dtype=torch.float64, device=dev)))
        p = fma32_ref(-lw.expand_as(p), p, p).double()
    m = fma32_ref(b1.expand_as(m), m, fma32_ref(-b1.expand_as(g), g, g)).double()
    g2 = r(g * g)
    v = fma32_ref(b2.expand_as(v), v, fma32_ref(-b2.expand_as(g2), g2, g2)).double()
    bc1, bc2 = (torch.as_tensor(x, device=dev).float().double() for x in bias_corrections)
    step_size = r(lr32 / bc1)
    denom = r(r(r(torch.sqrt(v)) / r(torch.sqrt(bc2))) + eps32)
    p = r(p - r(r(step_size * m) / denom))
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


def _signed_bits(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # New bits may arrive as unsigned patterns in a wider int; wrap them into the signed view.
    width = BITS_WIDTH[dtype]
    u = val.to(torch.int64) & ((1 << width) - 1)
    return torch.where(u >= (1 << (width - 1)), u - (1 << width), u).to(dtype)


__all__ = [
    "MASK64",
    "P31",
    "checksum2_add",
    "checksum2_contributions_ref",
    "checksum2_lanes",
    "checksum2_pack",
    "checksum2_ref",
    "checksum2_scale",
    "checksum2_update_ref",
    "checksum2_weights_ref",
    "mix32_ref",
    "adamw_beta_powers",
    "adamw_bias_corrections",
    "adamw_step_ref",
    "apply_delta_ref",
    "apply_deltas_ref",
    "as_bits",
    "bits_dtype",
    "checksum_ref",
    "checksum_update_ref",
    "diff_extract_ref",
    "diff_ref",
    "fma32_ref",
    "map_positions_ref",
    "unsigned",
    "wrapping_add_bits",
]
