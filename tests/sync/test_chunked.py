"""Chunked optimizer steps: bit-identical to a plain step, and the recorded delta is exactly the step's change."""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rltune.sync.chunked import ChunkedStepError, DeltaRecorder, chunked_step  # noqa: E402
from rltune.sync.kernels import ChangeCapacityError  # noqa: E402
from rltune.sync.kernels.reference import MASK64, as_bits, checksum_ref, diff_extract_ref  # noqa: E402
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
