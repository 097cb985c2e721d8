"""The engine's decode step on fixed buffers (``engine.compile`` on a GPU) against the HF forward.

On the CPU the decoder runs its step eagerly (no graphs); that step is what a graph records, so
these tests check the buffers, the column bookkeeping and the engine's hand-over of its cache on
every path (rows joining, finishing, preempted, a context too wide for the buffers). The GPU test
checks that replaying the captured graphs equals the eager step bit for bit.
"""

from __future__ import annotations

import queue

import pytest
import torch
from test_workload_engine_trainer import LOGPROB_ATOL, PROMPTS, drive, worst_logprob_error

from rltune.workload.engine import Engine, EngineSettings
from rltune.workload.graph_decode import GraphDecoder, buckets, buffer_shape
from rltune.workload.model import build_model


def _engine(max_seqs: int, kv_tokens: int, columns: int, device: str = "cpu", dtype: str = "float32",
            compile_: bool = False):
    settings = EngineSettings(preset="tiny", seed=0, dtype=dtype, device=device, attn_implementation="sdpa",
                              max_concurrent_seqs=max_seqs, batching="continuous", kv_cache_tokens=kv_tokens,
                              compile=compile_, num_threads=1, sample_seed=1, loader=None,
                              max_context_tokens=columns - 1)
    out: queue.Queue = queue.Queue()
    engine = Engine(0, settings, out)
    if not compile_:  # CPU: the graph decoder's step run eagerly
        engine.graph = GraphDecoder(engine.model, max_seqs, columns)
    return engine, out


def _count_graph_steps(engine) -> list[int]:
    seen = [0, 0]  # graph steps, loads
    step, load = engine.graph.step, engine.graph.load

    def counted_step(*a):
        seen[0] += 1
        return step(*a)

    def counted_load(*a):
        seen[1] += 1
        return load(*a)

    engine.graph.step, engine.graph.load = counted_step, counted_load
    return seen


def test_the_buffers_hold_the_longest_context_within_the_kv_budget():
    assert buffer_shape(128, 65536, 384) == (128, 385)   # the H200 small job: everything fits
    assert buffer_shape(1024, 65536, 384) == (170, 385)  # more rows than the budget holds at that width
    assert buffer_shape(16, 8192, 0) == (1, 8192)        # no context given: one row of the whole budget
    assert buffer_shape(8, 100, 4000) == (1, 100)        # a context longer than the budget


def test_buckets_cover_every_batch_size():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    for rows in (1, 3, 17, 128):
        sizes = buckets(rows)
        assert all(any(b >= n for b in sizes) for n in range(1, rows + 1))


def test_one_step_equals_the_hf_forward_on_a_left_padded_batch():
    torch.manual_seed(0)
    model = build_model("tiny", 0, torch.float32).eval()
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    width = max(len(p) for p in prompts)
    ids = torch.full((3, width), 0, dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    decoder = GraphDecoder(model, rows=4, columns=width + 8)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache = out.past_key_values
        decoder.load([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], mask)
        tokens, pos, full_mask = out.logits[:, -1].argmax(-1), mask.sum(-1), mask
        for _ in range(5):  # several columns: each step writes the next one
            full_mask = torch.cat([full_mask, torch.ones((3, 1), dtype=torch.long)], dim=1)
            expected = model(input_ids=tokens[:, None], attention_mask=full_mask, position_ids=pos[:, None],
                             past_key_values=cache, use_cache=True)
            got = decoder.step(tokens, pos)
            assert got.shape == (3, model.config.vocab_size)
            torch.testing.assert_close(got, expected.logits[:, -1], rtol=0, atol=2e-5)
            tokens, pos = got.argmax(-1), pos + 1
        keys, values, held_mask = decoder.cache(3)
        assert held_mask.dtype == torch.long and torch.equal(held_mask, full_mask)
        for layer, k, v in zip(cache.layers, keys, values, strict=True):
            torch.testing.assert_close(k, layer.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(v, layer.values, rtol=0, atol=1e-5)


def test_fits_only_what_the_buffers_hold():
    decoder = GraphDecoder(build_model("tiny", 0, torch.float32), rows=4, columns=10)
    assert decoder.fits(1, 0) and decoder.fits(4, 9)
    assert not decoder.fits(5, 3)   # more rows than the buffers
    assert not decoder.fits(2, 10)  # the step would write column 10 of 10
    assert not decoder.fits(0, 3)


@pytest.mark.parametrize(("max_seqs", "kv_tokens", "columns"), [
    (3, 4096, 64),   # rows join while others decode and leave
    (8, 120, 64),    # a tight KV budget preempts and re-queues rows
    (2, 4096, 24),   # the longest prompt outgrows the buffers: its steps run eagerly
])
def test_the_engine_on_the_graph_decoder_samples_what_a_full_forward_gives(max_seqs, kv_tokens, columns):
    engine, out = _engine(max_seqs, kv_tokens, columns)
    seen = _count_graph_steps(engine)
    results, steps = drive(engine, out, PROMPTS, temperature=0.7)
    assert sorted(results) == list(range(len(PROMPTS)))
    for res in results.values():
        assert len(res["logprobs"]) == len(res["tokens"]) >= 1
    worst = worst_logprob_error(results, PROMPTS, 0.7)
    assert worst < LOGPROB_ATOL, worst
    graph_steps, loads = seen
    assert 0 < graph_steps <= engine.counters["forward_steps"]
    assert loads < graph_steps  # the cache is handed over only when the batch changed shape
    if columns == 24:
        assert graph_steps < engine.counters["forward_steps"]  # the widest steps ran eagerly
    if kv_tokens == 120:
        assert engine.counters["preemptions"] > 0
    assert engine.running == [] and engine.mask is None


def test_the_engine_with_and_without_the_graph_decoder_samples_the_same_tokens():
    plain, plain_out = _engine(3, 4096, 64)
    plain.graph = None
    graphed, graphed_out = _engine(3, 4096, 64)
    a, _ = drive(plain, plain_out, PROMPTS, temperature=0.7)
    b, _ = drive(graphed, graphed_out, PROMPTS, temperature=0.7)
    assert {i: r["tokens"] for i, r in a.items()} == {i: r["tokens"] for i, r in b.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("live", [8, 5])
def test_captured_graphs_replay_the_eager_step(live):
    """A full bucket replays the eager step bit for bit; 5 rows replay the bucket of 8, whose matrix
    products may round differently from a batch of 5 (other GEMM shapes), so they are compared closely."""
    model = build_model("tiny", 0, torch.bfloat16, "cuda").eval()
    eager, graphed = GraphDecoder(model, 8, 40), GraphDecoder(model, 8, 40)
    graphed.capture()
    assert list(graphed.graphs) == [1, 2, 4, 8]
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        keys = [torch.randn((live, 2, 7, 32), generator=gen, device="cuda").bfloat16() for _ in model.model.layers]
        values = [torch.randn((live, 2, 7, 32), generator=gen, device="cuda").bfloat16() for _ in model.model.layers]
        mask = torch.ones((live, 7), dtype=torch.long, device="cuda")
        mask[0, :3] = 0
        for decoder in (eager, graphed):
            decoder.load(keys, values, mask)
        tokens = torch.randint(0, model.config.vocab_size, (live,), generator=gen, device="cuda")
        pos = mask.sum(-1)
        for _ in range(6):
            a, b = eager.step(tokens, pos), graphed.step(tokens, pos)
            if live == 8:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(b, a, rtol=0.02, atol=0.02)
            tokens, pos = a.argmax(-1), pos + 1
        assert eager.width == graphed.width == 13
        for x, y in zip(eager.cache(live)[0], graphed.cache(live)[0], strict=True):
            if live == 8:
                assert torch.equal(x, y)
            else:
                torch.testing.assert_close(y, x, rtol=0.02, atol=0.02)


@pytest.mark.gpu
def test_a_compiled_gpu_engine_samples_what_a_full_forward_gives():
    engine, out = _engine(3, 4096, 64, device="cuda", compile_=True)
    assert engine.graph is not None and engine.forward is engine.model
    with torch.inference_mode():
        engine.graph.capture()
    seen = _count_graph_steps(engine)
    results, _ = drive(engine, out, PROMPTS, temperature=0.7)
    model = build_model("tiny", 0, torch.float32, "cuda").eval()
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt + results[i]["tokens"]], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        ref = torch.log_softmax(logits[:, :-1].float() / 0.7, -1).gather(-1, ids[:, 1:, None])[0, len(prompt) - 1:, 0]
        worst = max(worst, float((ref.cpu() - torch.tensor(results[i]["logprobs"])).abs().max()))
    assert worst < 1e-3, worst  # float32 on the GPU (TF32 off by default), batched vs unbatched
    assert seen[0] > 0
