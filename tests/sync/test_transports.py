"""Each sync-bench transport carries real optimizer steps into an engine that ends bit-identical.

The engine is the vLLM-style ToyEngine (fused qkv / gate_up); "bit-identical" means every engine
parameter equals, bit for bit, what the engine's own loader makes of the trainer's state. The NCCL
transport runs here with gloo: the trainer is rank 0 of this process, engine ranks are spawned.
"""

from __future__ import annotations

import os

import pytest
import torch

from rltune.sync import transports as tr
from rltune.sync.bench.pairs import BenchContext, _bit_equal, make_bench_transport
from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig


def _tiny_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


class _Trainer:
    """A real model and optimizer; ``step`` runs forward/backward and the optimizer (through a driver if given)."""

    def __init__(self, tmp_path, lr=1e-3, nccl_engines=1):
        self.model = _tiny_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01, foreach=False)
        self.ctx = BenchContext(self.model, self.opt, ToyEngineConfig.from_hf(self.model.config), "cpu",
                                       tmp_path, anchor_interval=3, chunk_elements=500, nccl_engines=nccl_engines,
                                       nccl_timeout_s=120)
        self.gen = torch.Generator().manual_seed(1)

    def step(self, driver=None):
        ids = torch.randint(0, 96, (2, 12), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        if driver is not None:
            timings = driver.optimizer_step()
            assert timings["optimizer_step_s"] > 0 and 0 < timings["diff_in_step_s"] <= timings["optimizer_step_s"]
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def expected_engine(self):
        engine = ToyEngine(self.ctx.engine_config, dtype=torch.bfloat16)
        engine.load_weights(self.ctx.trainer_state().items())
        return {n: p.detach() for n, p in engine.named_parameters()}


def _run_steps(trainer, transport, steps):
    transport.boot()
    assert all(_bit_equal(trainer.expected_engine(), s) for s in transport.engine_states())
    results = []
    for step in range(1, steps + 1):
        before = trainer.expected_engine()
        before = {n: t.clone() for n, t in before.items()}
        trainer.step(transport if transport.drives_optimizer_step else None)
        after = trainer.expected_engine()
        assert not _bit_equal(before, after), "the optimizer step changed nothing: the test would be vacuous"
        published = transport.publish(step)
        prefetch_s = transport.prefetch(step)
        update = transport.update(step)
        states = transport.engine_states()
        assert states and all(_bit_equal(after, s) for s in states), f"{transport.name}: step {step} not bit-identical"
        results.append((published, prefetch_s, update))
    return results


@pytest.mark.parametrize("name", ["filesystem", "inprocess", "sparse"])
def test_local_transport_engine_is_bit_identical_after_every_step(tmp_path, name):
    trainer = _Trainer(tmp_path)
    transport = make_bench_transport(name, trainer.ctx)
    try:
        results = _run_steps(trainer, transport, steps=4)
    finally:
        transport.close()
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.ctx.trainer_state().values())
    for step, (published, prefetch_s, update) in enumerate(results, start=1):
        assert published.seconds > 0 and update.apply_s > 0
        assert update.dispatch_blocking_s == pytest.approx(update.pause_s + update.apply_s + update.resume_s)
        if name == "sparse":
            assert prefetch_s > 0
            assert update.checksum_verified is True and update.changes > 0
            assert published.details["anchor"] == float(step % 3 == 0)
            if step % 3:  # a delta: a few bytes per change plus one header, below a full copy
                assert 0 < published.bytes < min(full_bytes, 4 * update.changes + 8192)
        else:
            assert prefetch_s is None and update.checksum_verified is None
            if name == "inprocess":
                assert published.bytes == full_bytes
            else:  # safetensors: the tensors plus a small JSON header
                assert full_bytes < published.bytes < full_bytes + 64 * 1024


def test_filesystem_keeps_only_the_latest_checkpoint(tmp_path):
    trainer = _Trainer(tmp_path)
    transport = make_bench_transport("filesystem", trainer.ctx)
    _run_steps(trainer, transport, steps=2)
    assert sorted(p.name for p in (tmp_path / "filesystem").iterdir()) == ["step-000002.safetensors"]
    transport.close()
    assert list((tmp_path / "filesystem").iterdir()) == []


def test_sparse_changes_equal_the_elements_the_step_changed(tmp_path):
    trainer = _Trainer(tmp_path, lr=1e-4)
    transport = make_bench_transport("sparse", trainer.ctx)
    transport.boot()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.step(transport)
    changed = sum(int((p.detach().view(torch.int16) != before[n].view(torch.int16)).sum())
                  for n, p in trainer.model.named_parameters())
    transport.publish(1)
    transport.prefetch(1)
    update = transport.update(1)
    assert 0 < changed < sum(p.numel() for p in before.values())
    assert update.changes == changed  # TP=1, untied: one engine element per changed trainer element


def test_bit_check_sees_signed_zero_nan_payload_and_shape():
    a = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    assert _bit_equal({"w": a}, {"w": a.clone()})
    assert not _bit_equal({"w": a}, {"w": torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)})
    other_nan = a.clone()
    other_nan.view(torch.int16)[2] ^= 1  # another NaN payload: equal as "NaN", different bits
    assert not _bit_equal({"w": a}, {"w": other_nan})
    assert not _bit_equal({"w": a}, {"w": a.reshape(3, 1)})
    assert not _bit_equal({"w": a}, {"v": a})


def test_a_corrupted_engine_is_caught_by_the_bit_check_even_where_running_checksums_cannot(tmp_path):
    # Running checksums follow the delta's changes only, so an element corrupted outside the delta
    # passes the sparse path's own check; the bit-for-bit comparison is what catches it.
    trainer = _Trainer(tmp_path)
    transport = make_bench_transport("sparse", trainer.ctx)
    transport.boot()
    with torch.no_grad():
        transport.engine.model.norm.weight.view(torch.int16)[0] ^= 1
    trainer.step(transport)
    transport.publish(1)
    transport.prefetch(1)
    update = transport.update(1)
    assert update.checksum_verified is True
    assert not _bit_equal(trainer.expected_engine(), transport.engine_states()[0])


def test_unknown_transport_names_the_choices(tmp_path):
    trainer = _Trainer(tmp_path)
    with pytest.raises(tr.TransportError, match="filesystem, inprocess, sparse_delta, nccl"):
        make_bench_transport("rdma", trainer.ctx)


def test_nccl_timings_before_a_publish_are_refused_without_processes(tmp_path):
    from rltune.sync.transports.nccl import NcclPublisher

    publisher = object.__new__(NcclPublisher)
    publisher._pending_timings = False
    with pytest.raises(tr.TransportError, match="without a publish"):
        publisher.engine_timings()


def test_broadcast_with_gloo_to_two_engine_ranks_ends_bit_identical(tmp_path):
    trainer = _Trainer(tmp_path, nccl_engines=2)
    transport = make_bench_transport("nccl", trainer.ctx)
    try:
        for key, value in tr.NCCL_SAFE_ENV.items():
            assert os.environ[key] == value
        assert transport.backend == "gloo" and transport.world == 3
        results = _run_steps(trainer, transport, steps=2)
    finally:
        transport.close()
    assert [p.exitcode for p in transport.procs] == [0, 0]
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.ctx.trainer_state().values())
    for published, prefetch_s, update in results:
        assert published.bytes == 2 * full_bytes and published.seconds > 0
        assert prefetch_s is None and update.apply_s > 0 and update.details["engine_ranks"] == 2.0


@pytest.mark.gpu
def test_local_transports_on_gpu_end_bit_identical(tmp_path):
    model = _tiny_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ctx = BenchContext(model, opt, ToyEngineConfig.from_hf(model.config), "cuda", tmp_path, anchor_interval=3)
    sparse = make_bench_transport("sparse", ctx)
    full = make_bench_transport("filesystem", ctx)
    for t in (sparse, full):
        t.boot()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in (1, 2):
        ids = torch.randint(0, 96, (2, 12), generator=gen, device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        sparse.optimizer_step()
        opt.zero_grad()
        engine = ToyEngine(ctx.engine_config, dtype=torch.bfloat16).cuda()
        engine.load_weights(ctx.trainer_state().items())
        expected = {n: p.detach() for n, p in engine.named_parameters()}
        for t in (sparse, full):
            t.publish(step)
            t.prefetch(step)
            update = t.update(step)
            assert update.checksum_verified in (None, True)
            assert _bit_equal(expected, t.engine_states()[0])
