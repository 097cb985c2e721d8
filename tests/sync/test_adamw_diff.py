"""The fused AdamW step + diff: the kernel against its torch reference (CPU, interpreter) and against
torch's fused AdamW on CUDA (``gpu``), bit for bit; the chunked step handing fused updates to the sink."""

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rltune.sync import kernels as K  # noqa: E402
from rltune.sync.chunked import AdamWUpdate, DeltaRecorder, chunked_step  # noqa: E402
from rltune.sync.kernels import reference as R  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8, maximize=False)


def _members(sizes, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)

    def draw(z, scale, positive=False):
        x = torch.rand(z, generator=g) if positive else torch.randn(z, generator=g)
        return (x * scale).to(dtype).to(device)

    return ([draw(z, 0.02) for z in sizes], [draw(z, 1e-3) for z in sizes], [draw(z, 1e-4) for z in sizes],
            [draw(z, 1e-7, positive=True) for z in sizes])


def _expected(lists, counts, hyper, wire):
    """The reference step of each member (copies), the old and new wire bits."""
    out, olds, news = [], [], []
    for m, (p, g, a, v) in enumerate(zip(*lists, strict=True)):
        p, a, v = p.clone(), a.clone(), v.clone()
        olds.append(R.as_bits(p.to(wire)).clone())
        corr = R.adamw_bias_corrections(torch.tensor([counts[m] + 1.0]), *hyper["betas"])
        R.adamw_step_ref(p, g, a, v, (corr[0, 0], corr[1, 0]), hyper["lr"], *hyper["betas"],
                         hyper["weight_decay"], hyper["eps"], hyper["maximize"])
        out.append((p, a, v))
        news.append(R.as_bits(p.to(wire)))
    return out, olds, news


def _bits_equal(a, b):
    return torch.equal(R.as_bits(a.contiguous()), R.as_bits(b.contiguous()))


def test_fma32_ref_rounds_once():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    c = torch.randn(3000, generator=g) * torch.rand(3000, generator=g) ** 8
    # ties of float32 broken by a tiny addend, which a float64 sum rounded twice gets wrong
    a[:2] = b[:2] = 1 + 2 ** -12
    c[0], c[1] = 2 ** -60, -(2 ** -60)
    got = R.fma32_ref(a, b, c)
    assert got[0].item() == 1 + 2 ** -11 + 2 ** -23 and got[1].item() == 1 + 2 ** -11
    assert (a[:1].double() * b[:1].double() + c[:1].double()).float().item() == 1 + 2 ** -11  # the double rounding
    for i in range(0, 3000, 7):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        x = np.float32(float(exact))
        near = [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
        want = min(near, key=lambda y: (abs(Fraction(float(y)) - exact), int(np.array(y).view(np.int32)) & 1))
        assert np.float32(got[i].item()) == want, i


def test_adamw_reference_is_one_step_of_torch_adamw_to_within_rounding():
    # the reference is AdamW: against torch's own float64 AdamW its float32 result is within a few ulps
    p, g, a, v = (t[0] for t in _members([4096], torch.float32, seed=3, device="cpu"))
    p64 = torch.nn.Parameter(p.double().clone())
    p64.grad = g.double().clone()
    opt = torch.optim.AdamW([p64], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"])
    opt.state[p64] = dict(step=torch.tensor(4.0), exp_avg=a.double().clone(), exp_avg_sq=v.double().clone())
    opt.step()
    corr = R.adamw_bias_corrections(torch.tensor([5.0]), *HYPER["betas"])
    R.adamw_step_ref(p, g, a, v, (corr[0, 0], corr[1, 0]), HYPER["lr"], *HYPER["betas"], HYPER["weight_decay"],
                     HYPER["eps"])
    assert torch.allclose(p.double(), p64.detach(), rtol=1e-5, atol=1e-7)  # the step moved them by ~3e-3
    assert torch.allclose(a.double(), opt.state[p64]["exp_avg"], rtol=1e-5, atol=1e-10)
    assert not torch.equal(p, p64.detach().float())  # float32 is not float64: the comparison above is not vacuous


CASES = [  # (parameter dtype, wire dtype, member sizes, hyper-parameter changes)
    (torch.bfloat16, torch.bfloat16, [1, 31, 8192, 8193], {}),
    (torch.bfloat16, torch.bfloat16, [20000], {"weight_decay": 0.0, "maximize": True}),
    (torch.float16, torch.float16, [100, 3000], {}),
    (torch.float32, torch.bfloat16, [70, 8200], {}),
    (torch.float32, torch.float32, [5000, 3], {"weight_decay": 0.0, "lr": 2e-9}),  # near one float32 step
]


@pytest.mark.parametrize("dtype,wire,sizes,changes", CASES)
def test_fused_step_and_diff_equal_the_reference(dtype, wire, sizes, changes):
    hyper = {**HYPER, **changes}
    lists = _members(sizes, dtype, seed=len(sizes))
    counts = [3.0 + m for m in range(len(sizes))]  # each member its own step count
    want, olds, news = _expected(lists, counts, hyper, wire)
    sink = K.ChangeSink(sum(sizes), max(sizes), 8, DEVICE, backend="triton", fuse_adamw=True)
    sink.reset()
    group = sink.group(sizes, [0] * len(sizes))
    steps = [torch.tensor(c, device=DEVICE) for c in counts]
    assert sink.adamw_append(group, AdamWUpdate(*lists, steps, hyper), wire, list(range(len(sizes))))
    sink.finish()
    got = sink.collect()
    assert [s.item() for s in steps] == [c + 1 for c in counts]
    changed = 0
    for m, (p, a, v) in enumerate(want):
        assert _bits_equal(lists[0][m], p) and _bits_equal(lists[2][m], a) and _bits_equal(lists[3][m], v), m
        idx, new, old, change = R.diff_extract_ref(olds[m], news[m], 0)
        assert torch.equal(got[m].idx_C.cpu(), idx.cpu()) and torch.equal(got[m].new_C.cpu(), new.cpu())
        assert torch.equal(got[m].old_C.cpu(), old.cpu()) and got[m].checksum_change == change
        changed += idx.numel()
    assert 0 < changed < sum(sizes)  # some elements moved, some did not: both kinds of rows are exercised


def test_a_nan_gradient_makes_its_element_nan_and_leaves_the_others_exact():
    # a NaN's bits are the platform's (the reference's CPU conversion, the interpreter and the GPU's
    # hardware each write their own): the element must be NaN everywhere, every other one exact
    lists = _members([300], torch.bfloat16, seed=4)
    lists[1][0][7] = float("nan")
    want, _, _ = _expected(lists, [2.0], HYPER, torch.bfloat16)
    sink = K.ChangeSink(300, 300, 2, DEVICE, backend="triton", fuse_adamw=True)
    sink.reset()
    update = AdamWUpdate(*lists, [torch.tensor(2.0, device=DEVICE)], HYPER)
    assert sink.adamw_append(sink.group([300], [0]), update, torch.bfloat16, ["w"])
    sink.finish()
    sink.collect()
    others = torch.arange(300, device=DEVICE) != 7
    for got, w in zip((lists[0], lists[2], lists[3]), want[0], strict=True):
        assert torch.isnan(got[0][7]) and torch.isnan(w[7])
        assert _bits_equal(got[0][others], w[others])


def test_fused_step_of_chunks_at_offsets_and_unaligned_members():
    # members that are slices of larger tensors at odd element offsets: the kernel's loads go unvectorised
    base = _members([9000, 700], torch.bfloat16, seed=9)
    lists = [[t[0][5:8197], t[1][3:700]] for t in base]
    sizes, offsets = [8192, 697], [5, 3]
    want, olds, news = _expected(lists, [0.0, 0.0], HYPER, torch.bfloat16)
    sink = K.ChangeSink(10 ** 5, 8192, 4, DEVICE, backend="triton", fuse_adamw=True)
    sink.reset()
    group = sink.group(sizes, offsets)
    steps = [torch.tensor(0.0, device=DEVICE) for _ in sizes]
    assert sink.adamw_append(group, AdamWUpdate(*lists, steps, HYPER), torch.bfloat16, ["a", "b"])
    assert [entry[1][1] for entry in sink._adamw_plans.values()] == [1]  # not every offset is a multiple of 8
    sink.finish()
    got = sink.collect()
    for m, (p, _, _) in enumerate(want):
        assert _bits_equal(lists[0][m], p)
        idx, _, _, change = R.diff_extract_ref(olds[m], news[m], offsets[m])
        assert torch.equal(got[m].idx_C.cpu(), idx.cpu()) and got[m].checksum_change == change
    assert torch.equal(base[0][0][:5], _members([9000, 700], torch.bfloat16, seed=9)[0][0][:5])  # outside: untouched


def test_sink_declines_what_it_cannot_fuse():
    lists = _members([64], torch.bfloat16, seed=1)
    before = [t.clone() for t in lists[0]]
    sink = K.ChangeSink(64, 64, 2, DEVICE, backend="triton", fuse_adamw=True)
    group = sink.group([64], [0])
    steps = [torch.tensor(1.0, device=DEVICE)]
    assert not sink.adamw_append(group, AdamWUpdate(*lists, steps, HYPER), torch.float16, ["w"])  # fp16 wire of bf16
    mixed = (lists[0], [g.float() for g in lists[1]], lists[2], lists[3])
    assert not sink.adamw_append(group, AdamWUpdate(*mixed, steps, HYPER), torch.bfloat16, ["w"])
    strided = (lists[0], [torch.stack([g, g], dim=1)[:, 0] for g in lists[1]], lists[2], lists[3])
    assert not strided[1][0].is_contiguous()
    assert not sink.adamw_append(group, AdamWUpdate(*strided, steps, HYPER), torch.bfloat16, ["w"])
    off = K.ChangeSink(64, 64, 2, DEVICE, backend="triton", fuse_adamw=False)
    assert not off.adamw_append(off.group([64], [0]), AdamWUpdate(*lists, steps, HYPER), torch.bfloat16, ["w"])
    assert steps[0].item() == 1.0 and all(torch.equal(a, b) for a, b in zip(lists[0], before, strict=True))
    with pytest.raises(K.KernelError, match="fuse_adamw"):
        K.ChangeSink(64, 64, 2, DEVICE, fuse_adamw="yes")


def _model_params(sizes, dtype, device=DEVICE):
    g = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter((torch.randn(z, generator=g) * 0.02).to(dtype).to(device)) for z in sizes]


@pytest.mark.parametrize("fused,amsgrad", [(True, False), (False, False), (True, True)])
def test_chunked_step_hands_fused_adamw_updates_to_the_recorder(fused, amsgrad):
    # three steps over small parameters packed together and a large one in two chunks; fused AdamW's
    # updates are stepped by the sink (the reference arithmetic), the others by torch with before/after
    sizes, chunk = [40, 3000, 130, 20000], 10000
    params = _model_params(sizes, torch.bfloat16)
    ref = [p.detach().clone() for p in params]
    moments = [(torch.zeros_like(r), torch.zeros_like(r)) for r in ref]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=fused or None, amsgrad=amsgrad)
    rec = DeltaRecorder([(f"w{i}", p) for i, p in enumerate(params)], chunk, capacity_fraction=1.0, backend="triton",
                        fuse_adamw=True)
    calls = {"after": 0, "fused": 0}
    after, step_adamw = rec.after, rec.step_adamw
    rec.after = lambda chunks: (calls.__setitem__("after", calls["after"] + 1), after(chunks))
    rec.step_adamw = lambda chunks, u: (calls.__setitem__("fused", calls["fused"] + 1), step_adamw(chunks, u))[1]
    g = torch.Generator().manual_seed(6)
    for step in range(1, 4):
        grads = [(torch.randn(z, generator=g) * 1e-3).to(torch.bfloat16).to(DEVICE) for z in sizes]
        olds = [p.detach().clone() for p in params]
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr.clone()
        chunked_step(opt, rec, chunk)
        changes = rec.collect()
        for i, (p, gr) in enumerate(zip(params, grads, strict=True)):
            if fused and not amsgrad:  # what the sink computed: the reference, step after step
                corr = R.adamw_bias_corrections(torch.tensor([float(step)]), 0.9, 0.999)
                R.adamw_step_ref(ref[i], gr, *moments[i], (corr[0, 0], corr[1, 0]), 1e-3, 0.9, 0.999, 0.01, 1e-8)
                assert _bits_equal(p.detach(), ref[i]), (step, i)
            idx, new, old, change = R.diff_extract_ref(R.as_bits(olds[i]), R.as_bits(p.detach()), 0)
            assert torch.equal(changes[f"w{i}"].idx_C.cpu(), idx.cpu()) and changes[f"w{i}"].checksum_change == change
        assert all(opt.state[p]["step"].item() == step for p in params)
    # three updates per step (the small parameters packed, the large one in two chunks), each either
    # stepped by the sink or by torch and then diffed
    assert calls == ({"after": 0, "fused": 9} if fused and not amsgrad else {"after": 9, "fused": 0})


# ------------------------------------------------------------------------------------------------ CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,wire,decay,maximize", [
    (torch.bfloat16, torch.bfloat16, 0.01, False), (torch.bfloat16, torch.bfloat16, 0.0, True),
    (torch.float16, torch.float16, 0.01, False), (torch.float32, torch.bfloat16, 0.01, False),
    (torch.float32, torch.float32, 0.1, False)])
def test_fused_step_and_diff_equal_torch_fused_adamw_on_cuda(dtype, wire, decay, maximize):
    # real sizes: a parameter in two 64 M-element chunks with a ragged tail, and small ones packed;
    # three steps of torch's fused AdamW on one copy and of the recorder's fused step on the other
    sizes, chunk = [(1 << 26) + (1 << 25) + 77, 1, 4097, 300000, 12345], 1 << 26
    a, b = _model_params(sizes, dtype, "cuda"), _model_params(sizes, dtype, "cuda")
    kw = dict(lr=1e-4, weight_decay=decay, maximize=maximize, fused=True)
    opt_a, opt_b = torch.optim.AdamW(a, **kw), torch.optim.AdamW(b, **kw)
    rec = DeltaRecorder([(f"w{i}", p) for i, p in enumerate(b)], chunk, wire_dtype=wire, capacity_fraction=1.0,
                        outputs="device")
    assert rec.sink.fuse_adamw
    g = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):
        olds = [R.as_bits(p.detach().to(wire)).clone() for p in b]
        for p, q in zip(a, b, strict=True):
            p.grad = (torch.randn(p.shape, generator=g, device="cuda") * 1e-3).to(dtype)
            q.grad = p.grad.clone()
        opt_a.step()
        chunked_step(opt_b, rec, chunk)
        changes = rec.collect()
        total = 0
        for i, (p, q) in enumerate(zip(a, b, strict=True)):
            assert _bits_equal(p.detach(), q.detach()), i
            for key in ("exp_avg", "exp_avg_sq"):
                assert _bits_equal(opt_a.state[p][key], opt_b.state[q][key]), (i, key)
            idx, new, old, change = R.diff_extract_ref(olds[i], R.as_bits(q.detach().to(wire)), 0)
            got = changes[f"w{i}"]
            assert torch.equal(got.idx_C, idx) and torch.equal(got.new_C, new) and torch.equal(got.old_C, old)
            assert got.checksum_change == change
            total += idx.numel()
        assert total > 0
