"""The format's one dtype table: every width, mask and view of the sync path is read from it.

``rltune.sync.format.WIRE_DTYPES`` names each element dtype the byte format carries, its wire bits
and its inf/NaN bits; the bit views of the kernels, the receiver's anchor reads, the sender's
manifest names and the non-finite check all derive from it. These tests hold the table to torch and
to the specification, and fail if a second table of dtypes grows back anywhere in ``rltune/sync``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from rltune.sync import format as fmt

REPO = Path(__file__).resolve().parents[2]
SYNC = REPO / "rltune" / "sync"
WIRE = list(fmt.WIRE_DTYPES.values())


@pytest.mark.parametrize("wire", WIRE, ids=lambda w: w.name)
def test_each_wire_dtype_is_torchs_own_with_its_width_and_every_derived_table_agrees(wire):
    from rltune.sync.kernels import _MASK_OF_BITS, _WIDTH_OF_BITS, cpu_kernels
    from rltune.sync.kernels.reference import as_bits, bits_dtype
    from rltune.sync.ops import NONFINITE_BITS, wire_width
    from rltune.sync.receiver import _BITS_NP

    dtype = fmt.torch_dtype(wire.name)
    assert fmt.dtype_name(dtype) == wire.name and fmt.wire_dtype(dtype) is wire
    assert torch.empty(0, dtype=dtype).element_size() * 8 == wire.bits
    view = bits_dtype(dtype)
    assert fmt.dtype_name(view) == fmt.BITS_INTEGERS[wire.bits]
    assert wire_width(as_bits(torch.zeros(3, dtype=dtype))) == _WIDTH_OF_BITS[view] == wire.bits
    assert _MASK_OF_BITS[view] == fmt.wire_mask(wire.bits) == (1 << wire.bits) - 1
    np_view = np.dtype(fmt.BITS_INTEGERS[wire.bits])
    assert cpu_kernels._MASKS[np_view] == fmt.wire_mask(wire.bits) and cpu_kernels._WIDTHS[np_view] == wire.bits
    assert _BITS_NP[wire.bits].itemsize * 8 == wire.bits and _BITS_NP[wire.bits].byteorder in "<|="
    assert NONFINITE_BITS[dtype] == wire.nonfinite


@pytest.mark.parametrize("wire", WIRE, ids=lambda w: w.name)
def test_the_nonfinite_bits_are_exactly_the_values_torch_calls_inf_or_nan(wire):
    # every pattern of the 8- and 16-bit dtypes; float32's patterns around each exponent edge
    dtype = fmt.torch_dtype(wire.name)
    if wire.bits <= 16:
        u = torch.arange(1 << wire.bits, dtype=torch.int64)
    else:
        edges = torch.tensor([0, 0x00800000, 0x3F800000, 0x7F000000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7FFFFFFF])
        u = torch.cat([edges - 1, edges, edges + 1]).clamp(0, (1 << 31) - 1)
        u = torch.cat([u, u | (1 << 31)])
    signed = torch.where(u >= 1 << (wire.bits - 1), u - (1 << wire.bits), u) if wire.bits > 8 else u
    x = signed.to(getattr(torch, fmt.BITS_INTEGERS[wire.bits])).view(dtype)
    nonfinite = (u & wire.nonfinite) == wire.nonfinite
    assert nonfinite.any() and not nonfinite.all()
    assert torch.equal(nonfinite, ~torch.isfinite(x.float()))


def test_an_unknown_or_wrong_kind_of_dtype_has_no_wire_entry():
    assert fmt.wire_dtype(torch.float64) is None and fmt.wire_dtype(torch.int16) is None
    assert fmt.wire_dtype("bfloat16") is None and fmt.wire_dtype(None) is None  # a name is not a dtype


def test_the_specifications_dtype_enum_is_the_table_in_its_order():
    text = (REPO / "docs" / "delta-format.md").read_text()
    enum = re.search(r'"dtype": \{"enum": (\[[^\]]*\])\}', text)
    assert enum is not None, "docs/delta-format.md lost its tensors.<name>.dtype enum"
    assert json.loads(enum.group(1)) == list(fmt.DTYPES)


def _dtype_keys(node: ast.Dict) -> int:
    """How many keys of a dict literal name a wire dtype or a bits view (torch.X, "X", np.dtype("X"))."""
    names = set(fmt.DTYPES) | set(fmt.BITS_INTEGERS.values())
    count = 0
    for key in node.keys:
        if isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name) and key.value.id == "torch":
            count += key.attr in names
        elif isinstance(key, ast.Constant) and isinstance(key.value, str):
            count += key.value in names
        elif isinstance(key, ast.Call) and key.args and isinstance(key.args[0], ast.Constant):
            count += key.args[0].value in names
    return count


def test_no_module_of_rltune_sync_but_the_format_writes_a_table_of_dtypes():
    found = []
    for path in sorted(SYNC.rglob("*.py")):
        if path == SYNC / "format.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Dict) and _dtype_keys(node) >= 2:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"dtype tables outside rltune/sync/format.py (read WIRE_DTYPES / BITS_INTEGERS instead): {found}"


def test_the_table_check_finds_the_tables_it_forbids():
    # the check above cannot pass vacuously: each spelling of a dtype table it must catch, it catches
    for text in ('{torch.bfloat16: 16, torch.float32: 32}', '{"bfloat16": 2, "float16": 2}',
                 '{np.dtype("int16"): 0xFFFF, np.dtype("uint8"): 0xFF}', '{torch.int16: 16, torch.uint8: 8}'):
        assert _dtype_keys(ast.parse(text, mode="eval").body) == 2, text
    assert _dtype_keys(ast.parse('{"step": 1, "bfloat16": 2}', mode="eval").body) == 1
