"""Chunked optimizer steps: bit-identical to a plain step, and the recorded delta is exactly the step's change."""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rltune.sync.chunked import ChunkedStepError, DeltaRecorder, chunked_step  # noqa: E402
from rltune.sync.kernels import ChangeCapacityError  # noqa: E402
from rltune.sync.kernels.reference import (  # noqa: E402
    MASK64,
    as_bits,
    checksum2_add,
    checksum2_update_ref,
    checksum_ref,
    diff_extract_ref,
)
from rltune.sync.ops import wire_diff  # noqa: E402
from rltune.sync.sender import SignSGD  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_model(dtype=torch.bfloat16, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(97, 24), torch.nn.Linear(24, 61), torch.nn.LayerNorm(61),
                                torch.nn.Linear(61, 97, bias=False))
    return model.to(DEVICE, dtype)


def backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 97, (4, 9), generator=g).to(DEVICE)
    logits = model(tokens).float()
    torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tokens.roll(1, 1).reshape(-1)).backward()


def make_opt(kind: str, model: torch.nn.Module):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True, foreach=False)
    return SignSGD(model.parameters(), lr=1e-2, weight_decay=0.1)


def test_the_plan_packs_small_parameters_and_splits_large_ones():
    from rltune.sync.chunked import _plan

    f32, b16 = torch.zeros(30), torch.zeros(30, dtype=torch.bfloat16)
    params = [f32[:10], f32[:15], f32[:5], torch.zeros(14), torch.zeros(0), torch.zeros(3), torch.zeros(8), b16[:5],
              torch.zeros(4)]
    assert _plan(params, 30) == [[(0, 0, 10)],
                                 [(1, 0, 15)],  # half an update or more: alone
                                 [(2, 0, 5), (3, 0, 14), (5, 0, 3), (6, 0, 8)],  # exactly full; the empty one skipped
                                 [(7, 0, 5)],  # another dtype: its own update
                                 [(8, 0, 4)]]
    assert _plan([torch.zeros(3), torch.zeros(16), torch.zeros(70), torch.zeros(2), torch.zeros(14)], 30) == [
        [(0, 0, 3)], [(1, 0, 16)], [(2, 0, 30)], [(2, 30, 60)], [(2, 60, 70)], [(3, 0, 2), (4, 0, 14)]]
    with pytest.raises(ChunkedStepError, match="contiguous"):
        _plan([torch.zeros(4, 4).t()], 30)


def test_every_step_passes_the_same_updates_until_the_stepped_parameters_change():
    from types import SimpleNamespace

    model = make_model()
    opt = make_opt("adamw", model)
    seen: list = []
    hook = SimpleNamespace(before=seen.append, after=lambda update: None)
    for step in range(2):
        backward(model, seed=step)
        chunked_step(opt, hook, max_elements=700)
        opt.zero_grad()
    half = len(seen) // 2
    assert half > 3 and all(a is b for a, b in zip(seen[:half], seen[half:], strict=True))
    assert [len(u) for u in seen[:half]] == [1] * 7 + [3] + [1] * 9  # chunks of 3 weights; 3 small tensors
    backward(model, seed=3)
    next(model.parameters()).grad = None  # the embedding is not stepped: a new plan
    chunked_step(opt, hook, max_elements=700)
    assert not any(u is v for u in seen[2 * half:] for v in seen[:half])
    assert all(p is not next(model.parameters()) for u in seen[2 * half:] for p, _, _ in u)
    weight = model[1].weight
    weight.data = weight.data.t().contiguous().t()  # same values, transposed storage: the cached plan must refuse it
    with pytest.raises(ChunkedStepError, match="contiguous"):
        chunked_step(opt, hook, max_elements=700)


@pytest.mark.parametrize("max_elements", [101, 4000])
@pytest.mark.parametrize("kind", ["adamw", "adamw_foreach", "adamw_fused", "adam_amsgrad", "signsgd"])
def test_chunked_step_is_bit_identical_to_a_plain_step(kind, max_elements):
    # 101: every parameter alone or in chunks; 4000: the embedding, a weight and the small tensors in one update
    plain, chunked = make_model(), make_model()
    opt_plain, opt_chunked = make_opt(kind, plain), make_opt(kind, chunked)
    for step in range(3):
        for m in (plain, chunked):
            backward(m, seed=step)
        opt_plain.step()
        chunked_step(opt_chunked, None, max_elements=max_elements)
        opt_plain.zero_grad()
        opt_chunked.zero_grad()
    for a, b in zip(plain.parameters(), chunked.parameters(), strict=True):
        assert torch.equal(as_bits(a.data), as_bits(b.data))
    if kind != "signsgd":
        sa, sb = opt_plain.state_dict()["state"], opt_chunked.state_dict()["state"]
        for k in sa:
            assert float(sa[k]["step"]) == float(sb[k]["step"]) == 3.0
            assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("master", [torch.bfloat16, torch.float32])
def test_recorder_holds_exactly_the_elements_the_step_changed(backend, master):
    model = make_model(master)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    rec = DeltaRecorder(model.named_parameters(), max_elements=700, wire_dtype=torch.bfloat16, backend=backend,
                        capacity_fraction=1.0)
    backward(model, seed=1)
    before = {n: as_bits(p.detach().to(torch.bfloat16)).clone() for n, p in model.named_parameters()}
    chunked_step(opt, rec, max_elements=700)
    changes = rec.collect()
    seen = 0
    for name, p in model.named_parameters():
        after = as_bits(p.detach().to(torch.bfloat16))
        idx, new, old, change = diff_extract_ref(before[name].cpu(), after.cpu())
        if idx.numel() == 0:  # LayerNorm bias may not move in bf16: recorded with no changes
            assert changes[name].idx_C.numel() == 0 and changes[name].checksum_change == 0
            continue
        got = changes[name]
        assert torch.equal(got.idx_C.cpu(), idx) and torch.equal(got.new_C.cpu(), new)
        assert torch.equal(got.old_C.cpu(), old) and got.checksum_change == change
        assert (checksum_ref(before[name].cpu()) + change) & MASK64 == checksum_ref(after.cpu())
        seen += idx.numel()
    assert seen > 0, "the step changed nothing"


@pytest.mark.parametrize("ranges", [False, True])
def test_recorded_deltas_are_the_steps_changes_with_and_without_the_sink(ranges):
    # fp32 master weights sent as bf16; with ranges, each tensor's middle elements only (a rank's rows),
    # so chunks are clamped on both sides; the same deltas from the torch diff without a sink, the
    # sink's torch reference and its kernels
    got = {}
    for mode in ("no sink", "torch", "triton"):
        model = make_model(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        named = list(model.named_parameters())
        spans = {n: (p.numel() // 3, p.numel() - p.numel() // 4) if ranges else (0, p.numel()) for n, p in named}
        rec = DeltaRecorder(named, max_elements=700, wire_dtype=torch.bfloat16, capacity_fraction=1.0,
                            backend="torch" if mode == "torch" else "triton", ranges=spans if ranges else None,
                            sink=mode != "no sink")
        assert (rec.sink is None) == (mode == "no sink")
        backward(model, seed=1)
        before = {n: as_bits(p.detach().to(torch.bfloat16)).clone() for n, p in named}
        chunked_step(opt, rec, max_elements=700)
        deltas = rec.collect_deltas()
        assert all(d.idx_C.numel() for d in deltas)  # only chunks that changed
        per_name = {}
        for d in deltas:
            per_name.setdefault(d.name, []).append(d)
        for name, p in named:
            lo, hi = spans[name]
            old, new = before[name][lo:hi].cpu(), as_bits(p.detach().to(torch.bfloat16))[lo:hi].cpu()
            idx, new_c, old_c, change = diff_extract_ref(old, new, lo)
            ds = per_name.get(name, [])
            assert torch.equal(torch.cat([d.idx_C.cpu() for d in ds] or [idx[:0]]), idx), (mode, name)
            assert torch.equal(torch.cat([d.diff_C.cpu() for d in ds] or [idx[:0]]), wire_diff(old_c, new_c, 16))
            assert sum(d.checksum_change for d in ds) & MASK64 == change
            two = 0
            for d in ds:
                two = checksum2_add(two, d.checksum2_change)
            assert two == checksum2_update_ref(idx, old_c, new_c)
        got[mode] = [(d.name, d.idx_C.cpu(), d.diff_C.cpu()) for d in deltas]
        if mode == "no sink":
            with pytest.raises(ChunkedStepError, match="collect_deltas"):
                rec.collect()
    assert sum(len(i) for _, i, _ in got["triton"]) > 0
    for mode in ("torch", "triton"):
        assert [n for n, _, _ in got[mode]] == [n for n, _, _ in got["no sink"]]
        assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(got[mode], got["no sink"], strict=True))
    with pytest.raises(ChunkedStepError, match="not inside"):
        DeltaRecorder(named, ranges={n: (0, p.numel() + 1) for n, p in named})
    with pytest.raises(ChunkedStepError, match="no range"):
        DeltaRecorder(named, ranges={})


def test_recorder_raises_when_the_step_changes_more_than_its_capacity():
    model = make_model()
    opt = SignSGD(model.parameters(), lr=1.0)
    rec = DeltaRecorder(model.named_parameters(), max_elements=500, capacity_fraction=0.01)
    backward(model, seed=2)
    chunked_step(opt, rec, max_elements=500)
    with pytest.raises(ChangeCapacityError, match="capacity"):
        rec.collect()


def test_chunked_step_rejects_other_optimizers_and_bad_sizes():
    model = make_model()
    with pytest.raises(ChunkedStepError, match="SGD"):
        chunked_step(torch.optim.SGD(model.parameters(), lr=0.1), None, 10)
    with pytest.raises(ChunkedStepError, match="positive"):
        chunked_step(copy.deepcopy(make_opt("adamw", model)), None, 0)
