"""fp8 engine deltas: in-place patches of e4m3 values and block scales equal a full fp8 reload, bit for bit."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rltune.sync import kernels as K  # noqa: E402
from rltune.sync.fp8 import Fp8Error, fp8_delta, fp8_slab_delta, quantize_blocks  # noqa: E402
from rltune.sync.kernels.reference import apply_delta_ref, as_bits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def training_weights(steps: int, shape=(300, 260), seed=0):
    """Real AdamW steps on a bf16 weight; one step also rescales a block, so scales change."""
    torch.manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(*shape) * 0.02).to(DEVICE, torch.bfloat16))
    opt = torch.optim.AdamW([w], lr=3e-4)
    out = [w.detach().clone()]
    for step in range(steps):
        w.grad = torch.randn_like(w)
        opt.step()
        if step == 1:
            with torch.no_grad():
                w[130:140, 5:9] *= 8  # a block's amax moves: its scale changes
        out.append(w.detach().clone())
    return out


@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_patched_fp8_engine_equals_a_full_reload(scale_format, backend):
    weights = training_weights(4)
    engine = quantize_blocks(weights[0], scale_format)
    targets = {"w": as_bits(engine.q), "w_scale_inv": as_bits(engine.scale_inv)}
    names = list(targets)
    plan = K.ApplyPlan(list(targets.values()),
                       [K.strided_layout(0, list(engine.q.shape)), K.strided_layout(1, list(engine.scale_inv.shape))],
                       backend=backend)
    scale_changes = 0
    for old, new in zip(weights[:-1], weights[1:], strict=True):
        changes = fp8_delta("w", old, new, scale_format)
        assert changes["w"][0].numel() > 0
        scale_changes += changes.get("w_scale_inv", (torch.zeros(0),))[0].numel()
        if backend == "torch":
            for name, (idx, bits) in changes.items():
                apply_delta_ref(targets[name], idx, bits)
        else:
            present = [n for n in names if n in changes]
            idx = torch.cat([changes[n][0] for n in present])
            val = torch.cat([changes[n][1].to(torch.int64) & 0xFFFFFFFF for n in present]).to(torch.int32)
            offsets = torch.tensor([0] + [changes[n][0].numel() for n in present]).cumsum(0)
            result = plan.apply(torch.tensor([names.index(n) for n in present]), offsets, idx, val, add=False)
            assert result.written() == [changes[n][0].numel() for n in present]
        full = quantize_blocks(new, scale_format)
        assert torch.equal(as_bits(engine.q), as_bits(full.q))
        assert torch.equal(as_bits(engine.scale_inv), as_bits(full.scale_inv))
    assert scale_changes > 0, "no block scale changed; the test would not cover {name}_scale_inv"


def test_ue8m0_scales_are_powers_of_two_that_cover_the_block():
    w = training_weights(0)[0]
    q = quantize_blocks(w, "ue8m0")
    scale = q.scale_inv.float()
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    amax = w.float().abs().amax()
    assert float(scale.max()) * 448 >= float(amax)


def test_slab_delta_equals_the_matching_part_of_the_full_delta():
    old, new = training_weights(2)[1:3]
    full = fp8_delta("w", old, new)
    top = fp8_slab_delta("w", old[:128], new[:128], 0)
    bottom = fp8_slab_delta("w", old[128:], new[128:], 128)
    for key in full:
        idx = torch.cat([d[key][0] for d in (top, bottom) if key in d])
        bits = torch.cat([d[key][1] for d in (top, bottom) if key in d])
        assert torch.equal(idx, full[key][0]) and torch.equal(bits, full[key][1])


def test_fp8_rejects_misaligned_slabs_and_1d_tensors():
    w = torch.randn(256, 128)
    with pytest.raises(Fp8Error, match="multiple of the 128-row block"):
        fp8_slab_delta("w", w[64:], w[64:], 64)
    with pytest.raises(Fp8Error, match="2-D"):
        quantize_blocks(torch.randn(10))
    with pytest.raises(Fp8Error, match="scale_format"):
        quantize_blocks(w, "e5m2")
