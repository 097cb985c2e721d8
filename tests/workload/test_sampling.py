"""Per-request sampling: the hash equals its integer reference bit for bit, the Gumbel-max draw follows
the softmax, and an engine samples a request's tokens from its key alone, whatever shares its batch."""

from __future__ import annotations

import math
import queue
import random

import pytest
import torch

from rltune.workload.engine import Engine, EngineSettings
from rltune.workload.sampling import mix64, mix64_tensor, request_key, sample, seeded_key, uniforms
from rltune.workload.tokenizer import TOKENIZER

EDGES = [0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64, 12345678901234567]


def _unsigned(x: int) -> int:
    return x & (2**64 - 1)


def test_the_tensor_hash_equals_the_integer_reference_bit_for_bit():
    rng = random.Random(3)
    values = EDGES + [rng.randrange(-(2**63), 2**63) for _ in range(2000)]
    got = mix64_tensor(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [_unsigned(g) for g in got] == [mix64(v) for v in values]


def test_a_rows_uniforms_depend_on_its_key_and_position_alone():
    keys = torch.tensor([5, 7, 5], dtype=torch.int64)
    positions = torch.tensor([0, 0, 1], dtype=torch.int64)
    u = uniforms(keys, positions, 50)
    alone = uniforms(keys[1:2], positions[1:2], 50)
    assert torch.equal(u[1], alone[0]) and u.dtype == torch.float64
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])  # another position, another key


def test_gumbel_max_draws_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
    n = 40_000
    logp = probs.log().expand(n, -1)
    keys = torch.tensor([request_key(f"t{i}:0:0") for i in range(n)], dtype=torch.int64)
    picked = sample(logp, keys, torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(picked, minlength=5).double()
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 18.5, (counts.tolist(), chi2)  # the 0.999 quantile of chi-square with 4 degrees of freedom
    # A token the distribution rules out (log-probability -inf) is never drawn.
    masked = logp.clone()
    masked[:, 0] = -math.inf
    assert int((sample(masked, keys, torch.zeros(n, dtype=torch.int64)) == 0).sum()) == 0


def test_keys_are_63_bit_stable_and_the_seed_moves_them():
    names = [f"t{t}:{i}:{turn}" for t in range(30) for i in range(8) for turn in range(3)]
    keys = [request_key(n) for n in names]
    assert len(set(keys)) == len(keys) and all(0 <= k < 2**63 for k in keys)
    assert request_key("t0:0:0") == request_key("t0:0:0")
    assert seeded_key(0, keys[0]) != seeded_key(1, keys[0])
    assert all(-(2**63) <= seeded_key(s, k) < 2**63 for s in (0, 1, 2**40) for k in keys[:20])


PROMPTS = [TOKENIZER.encode(text, bos=True) for text in ["1+2=", "37*4-5=", "9=", "12-3=", "88*88=", "5+5+5="]]


def _engine(index=0, batching="continuous", max_seqs=4, sample_seed=1):
    settings = EngineSettings(preset="tiny", seed=0, dtype="float32", device="cpu", attn_implementation="sdpa",
                              max_concurrent_seqs=max_seqs, batching=batching, kv_cache_tokens=4096,
                              compile=False, num_threads=1, sample_seed=sample_seed, loader=None)
    out: queue.Queue = queue.Queue()
    return Engine(index, settings, out), out


def _serve(engine, out, requests):
    """``requests``: (req_id, prompt index, key); the tokens of each request id."""
    for req_id, prompt, key in requests:
        engine.handle(("generate", req_id, PROMPTS[prompt], 10, 1.0, 0.0, key))
    while engine.step():
        pass
    results = {}
    while not out.empty():
        msg = out.get()
        if msg[0] == "result":
            results[msg[2]] = msg[3]["tokens"]
    return results


def test_an_engine_samples_a_requests_tokens_from_its_key_whatever_shares_its_batch():
    keys = [request_key(f"t{i}:0:0") for i in range(len(PROMPTS))]
    together = _serve(*_engine(), [(i, i, keys[i]) for i in range(len(PROMPTS))])
    # Alone, on another engine, in reverse order, one at a time, or in static batches: the same tokens.
    alone = {i: _serve(*_engine(index=1), [(0, i, keys[i])])[0] for i in (0, 3)}
    reverse = _serve(*_engine(), [(i, i, keys[i]) for i in reversed(range(len(PROMPTS)))])
    single = _serve(*_engine(max_seqs=1), [(i, i, keys[i]) for i in range(len(PROMPTS))])
    static = _serve(*_engine(batching="static", max_seqs=3), [(i, i, keys[i]) for i in range(len(PROMPTS))])
    assert all(len(t) >= 1 for t in together.values())
    assert {i: together[i] for i in alone} == alone
    assert reverse == together and single == together and static == together
    # Another key or another job seed draws otherwise (somewhere among the requests).
    other = _serve(*_engine(), [(i, i, keys[i] ^ 1) for i in range(len(PROMPTS))])
    reseeded = _serve(*_engine(sample_seed=2), [(i, i, keys[i]) for i in range(len(PROMPTS))])
    assert other != together and reseeded != together


@pytest.mark.gpu
def test_a_gpu_draws_what_the_cpu_draws():
    rng = random.Random(5)
    values = EDGES + [rng.randrange(-(2**63), 2**63) for _ in range(2000)]
    on_gpu = mix64_tensor(torch.tensor(values, dtype=torch.int64, device="cuda")).cpu()
    assert torch.equal(on_gpu, mix64_tensor(torch.tensor(values, dtype=torch.int64)))
    keys = torch.tensor([request_key(f"t{i}:0:0") for i in range(64)], dtype=torch.int64)
    positions = torch.arange(64, dtype=torch.int64)
    assert torch.equal(uniforms(keys.cuda(), positions.cuda(), 300).cpu(), uniforms(keys, positions, 300))
