"""The engine's sampled-token logprobs agree with the trainer's; packing equals padding.

The engine runs in this process here (its scheduling loop driven by hand) so that continuous and
static batching, preemption and cancellation are checked token by token against a full forward.
"""

from __future__ import annotations

import queue
import random

import pytest
import torch

from rltune.errors import WrongTypeError
from rltune.sync.transports import make_publisher
from rltune.workload.config import WorkloadConfig, config_from_data
from rltune.workload.engine import Engine, EngineSettings
from rltune.workload.envs import make_math_task
from rltune.workload.model import build_model, sampled_logprobs
from rltune.workload.tokenizer import TOKENIZER
from rltune.workload.trainer import GRPOTrainer, TrainSample

# fp32 on a CPU: batched/padded vs unpadded forwards differ by ~1e-6 in logprob (measured max 4e-7).
LOGPROB_ATOL = 2e-5


def make_engine(batching="continuous", max_seqs=4, kv_tokens=4096):
    settings = EngineSettings(preset="tiny", seed=0, dtype="float32", device="cpu", attn_implementation="sdpa",
                              max_concurrent_seqs=max_seqs, batching=batching, kv_cache_tokens=kv_tokens,
                              compile=False, num_threads=1, sample_seed=1, loader=None)
    out: queue.Queue = queue.Queue()
    return Engine(0, settings, out), out


def drive(engine, out, prompts, max_new=12, temperature=1.0, keys=None):
    for i, prompt in enumerate(prompts):
        engine.handle(("generate", i, prompt, max_new, temperature, 0.0, keys[i] if keys else i))
    steps = 0
    while engine.step():
        steps += 1
        assert steps < 10_000
    results = {}
    while not out.empty():
        msg = out.get()
        if msg[0] == "result":
            results[msg[2]] = msg[3]
    return results, steps


def reference_logprobs(model, prompt, tokens, temperature=1.0):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    lp = sampled_logprobs(logits[:, :-1], ids[:, 1:], temperature)[0]
    return lp[len(prompt) - 1:]


def worst_logprob_error(results, prompts, temperature) -> float:
    """The largest gap between an engine's sampled-token logprobs and a full forward's, over every result."""
    model = build_model("tiny", 0, torch.float32).eval()
    worst = 0.0
    for i, prompt in enumerate(prompts):
        ref = reference_logprobs(model, prompt, results[i]["tokens"], temperature=temperature)
        worst = max(worst, float((ref - torch.tensor(results[i]["logprobs"])).abs().max()))
    return worst


PROMPTS = [TOKENIZER.encode(text, bos=True) for text in
           ["1+2=", "37*4-5=", "9=", "Find the sum of data.txt\n$ ", "12-3=", "88*88=", "5+5+5=", "0="]]


@pytest.mark.parametrize(("batching", "max_seqs", "kv_tokens"), [
    ("continuous", 3, 4096),   # rows join while others decode
    ("static", 3, 4096),       # a batch runs to its end before the next
    ("continuous", 8, 120),    # a tight KV budget forces preemption + recompute
    ("continuous", 1, 4096),   # one sequence at a time
])
def test_engine_logprobs_match_a_full_forward(batching, max_seqs, kv_tokens):
    engine, out = make_engine(batching, max_seqs, kv_tokens)
    results, _ = drive(engine, out, PROMPTS, temperature=0.7)
    assert sorted(results) == list(range(len(PROMPTS)))
    for res in results.values():
        assert 1 <= len(res["tokens"]) <= 12
        assert len(res["logprobs"]) == len(res["tokens"])
        if not res["eos"]:
            assert len(res["tokens"]) == 12
    worst = worst_logprob_error(results, PROMPTS, 0.7)
    assert worst < LOGPROB_ATOL, worst
    if kv_tokens == 120:
        assert engine.counters["preemptions"] > 0
        assert any(r["preemptions"] > 0 for r in results.values())
    assert engine.counters["kv_peak_frac"] <= 1.0
    assert engine.running == [] and engine.mask is None


def test_static_batching_admits_only_when_the_batch_is_empty():
    engine, out = make_engine("static", max_seqs=4)
    for i, prompt in enumerate(PROMPTS):
        engine.handle(("generate", i, prompt, 6, 1.0, 0.0, i))
    engine.step()
    assert len(engine.running) == 4 and len(engine.waiting) == 4
    while engine.running:
        assert len(engine.waiting) == 4  # nobody joins a running static batch
        engine.step()


def test_a_cancelled_request_returns_nothing():
    engine, out = make_engine("continuous", max_seqs=1)
    engine.handle(("generate", 0, PROMPTS[0], 5, 1.0, 0.0, 0))
    engine.handle(("generate", 1, PROMPTS[1], 5, 1.0, 0.0, 1))
    engine.handle(("cancel", 1))  # still waiting: dropped from the queue
    engine.step()
    engine.handle(("cancel", 0))  # running: dropped at its next token
    while engine.step():
        pass
    assert out.empty()


def test_weight_versions_move_with_loads(tmp_path):
    engine, out = make_engine()
    model = build_model("tiny", 0, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    for name in ("filesystem", "inprocess"):
        publisher = make_publisher(name, model=model, workdir=tmp_path, engine_dtype=torch.float32)
        engine.loads.loader = engine.s.loader = publisher.loader()
        published = publisher.publish(3)
        engine.handle(("load", 3, published.message))
        assert engine.loads.due(serving=True)  # a full-copy transport prefetches nothing: the load may run at once
        engine.loads.finish(engine._loaded)
        kind, _, version, loaded = out.get()
        assert (kind, version) == ("loaded", 3)
        assert loaded["bytes"] == published.bytes > 0
        for (name, a), b in zip(model.state_dict().items(), engine.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    results, _ = drive(engine, out, PROMPTS[:2])
    assert {r["version"] for r in results.values()} == {3}


def test_the_workload_refuses_a_transport_it_cannot_run_and_names_the_choices():
    for name in ("filesystem", "inprocess", "sparse_delta"):
        assert config_from_data({"schema_version": 1, "sync": {"transport": name}}, "<test>").sync.transport == name
    # nccl needs the engines in the trainer's process group, which the workload does not form
    for name in ("rdma", "nccl"):
        with pytest.raises(WrongTypeError, match="sync.transport: expected one of 'filesystem', 'inprocess', "
                                                 f"'sparse_delta', found string '{name}'"):
            config_from_data({"schema_version": 1, "sync": {"transport": name}}, "<test>")
    with pytest.raises(WrongTypeError, match="sync.transport: inprocess has no loader for vLLM engines; they take "
                                             "filesystem or sparse_delta"):
        config_from_data({"schema_version": 1, "sync": {"transport": "inprocess"}, "engine": {"backend": "vllm"}},
                         "<test>")


def _samples(n=6, seed=0):
    rng = random.Random(seed)
    engine, out = make_engine("continuous", max_seqs=8)
    prompts = [TOKENIZER.encode(make_math_task(rng, f"t{i}").prompt, bos=True) for i in range(n)]
    results, _ = drive(engine, out, prompts, max_new=rng.randint(4, 12))
    return [TrainSample(p + results[i]["tokens"], [False] * len(p) + [True] * len(results[i]["tokens"]),
                        [0.0] * len(p) + results[i]["logprobs"], advantage=(-1) ** i * 0.5, version=0)
            for i, p in enumerate(prompts)]


def _trainer(**trainer):
    cfg = config_from_data({"schema_version": 1, "trainer": dict(trainer, lr=1e-3)}, "<test>")
    return GRPOTrainer(cfg)


def test_packing_gives_the_padded_logprobs_and_no_padding():
    samples = _samples()
    padded, packed = _trainer(micro_batch_size=4), _trainer(micro_batch_size=4, packing=True)
    old_padded, old_packed = padded.old_logprobs(samples), packed.old_logprobs(samples)
    for s, a, b in zip(samples, old_padded, old_packed, strict=True):
        mask = torch.tensor(s.loss_mask)
        assert torch.allclose(a[mask], b[mask], atol=LOGPROB_ATOL)
        # The trainer reproduces the engine's logprobs (same weights): the gap is numerical only.
        assert torch.allclose(a[mask], torch.tensor(s.rollout_logprobs)[mask], atol=LOGPROB_ATOL)
    r_padded, r_packed = padded.train(samples, old_padded), packed.train(samples, old_packed)
    assert r_packed["real_tokens"] == r_packed["total_tokens"]
    assert r_padded["real_tokens"] < r_padded["total_tokens"]
    assert r_padded["loss"] == pytest.approx(r_packed["loss"], abs=1e-5)
    assert r_padded["gap_sum"] / r_padded["gap_n"] < LOGPROB_ATOL
    # Compare gradients (left in .grad after the step), not Adam's sign-like update of near-zero grads.
    for a, b in zip(padded.module.parameters(), packed.module.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_grad_checkpointing_and_micro_batch_size_do_not_change_the_update():
    samples = _samples(seed=1)
    results, models = [], []
    for kwargs in ({"micro_batch_size": 6}, {"micro_batch_size": 1}, {"micro_batch_size": 4, "grad_checkpointing": True}):
        trainer = _trainer(reuse_rollout_logprobs=True, **kwargs)
        results.append(trainer.train(samples, None))
        models.append(trainer.module)
        assert trainer.version == 1
    assert [r["micro_batches"] for r in results] == [1.0, 6.0, 2.0]
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    assert models[0].lm_head.weight.abs().sum() != build_model("tiny", 0, torch.float32).lm_head.weight.abs().sum()


def test_default_config_object_builds():
    assert WorkloadConfig().batch_size == 32


def test_warm_up_runs_prefill_and_decode_and_changes_nothing_a_request_sees():
    warmed, out_w = make_engine()
    warmed.warm_up()
    plain, out_p = make_engine()
    got, _ = drive(warmed, out_w, PROMPTS[:3])
    want, _ = drive(plain, out_p, PROMPTS[:3])
    assert warmed.warm_up_s > 0 and plain.warm_up_s == 0.0
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}
    assert warmed.counters["gen_tokens"] == plain.counters["gen_tokens"] > 0


def test_an_engine_whose_orchestrator_died_stops_serving():
    engine, out = make_engine()
    requests: queue.Queue = queue.Queue()
    requests.put(("generate", 0, PROMPTS[0], 12, 1.0, 0.0, 0))
    engine.parent_pid = -1  # as after the orchestrator was killed and the engine re-parented
    engine.serve(requests)  # returns instead of looping forever
    assert out.get_nowait()[0] == "ready" and out.empty() and engine.counters["gen_tokens"] == 0
