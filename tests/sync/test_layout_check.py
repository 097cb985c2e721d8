"""The first-update layout check of DeltaReceiver, on toy engines whose weights move after loading.

The engines here do what FlashInfer's CUTLASS MoE backend does to fused expert weights: after
loading they swap the gate and up halves of every ``gate_up_proj`` and read them swapped from then
on. An index map recorded through ``load_weights`` alone does not know; the receiver writes and
checksums the positions its map names, so without the check every delta lands in the wrong half
while verification passes. Each engine's truth is :func:`swapped_engine` (a fresh engine loaded
with a step's weights, then swapped), what its kernels read. The real vLLM cases are in
``test_vllm_layout.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sync_helpers import Trainer, assert_same_params, engine_cfg, make_receiver

from rltune.sync import format as fmt
from rltune.sync.indexmap import IndexMap, TensorRuns
from rltune.sync.receiver import MIN_RELOCATED_RUN, DeltaReceiver, _find_block
from rltune.sync.toy_engine import ToyEngine

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bcast")
    tr = Trainer(root, interval=10)
    m0 = tr.pub.publish(0)
    states = {0: {k: v.clone() for k, v in tr.wire_state().items()}}
    for s in range(1, STEPS + 1):
        tr.train_step()
        tr.pub.publish(s)
        states[s] = {k: v.clone() for k, v in tr.wire_state().items()}
    return dict(root=root, m0=m0, states=states, cfg=engine_cfg(tr))


@torch.no_grad()
def swap_gate_up(engine: ToyEngine) -> None:
    """The post-load transform: each gate_up_proj becomes [up; gate], in place (storage kept)."""
    for layer in engine.model.layers:
        w = layer.mlp.gate_up_proj.weight
        half = w.shape[0] // 2
        w.copy_(torch.cat((w[half:], w[:half])))


def swapped_engine(run, step, tp_rank=0, tp_size=1) -> ToyEngine:
    engine = ToyEngine(run["cfg"], tp_rank, tp_size)
    engine.load_weights(run["states"][step].items())
    swap_gate_up(engine)
    return engine


def booted(run, tp_rank=0, tp_size=1, **kw):
    """An engine that booted from step 0 and moved its weights, and a receiver on a map of its loader."""
    engine, rx = make_receiver(run["root"], run["cfg"], run["m0"], tp_rank, tp_size, **kw)
    engine.load_weights(run["states"][0].items())
    swap_gate_up(engine)
    return engine, rx


def boot_of(run):
    return lambda name: run["states"][0][name]


def test_without_the_check_every_delta_lands_in_the_wrong_half_and_verification_still_passes(run):
    engine, rx = booted(run)
    rx.apply(1)  # anchor 0 + delta 1, written where the map says; every checksum matches
    assert rx.valid and rx.step == 1
    with pytest.raises(AssertionError, match="gate_up_proj"):
        assert_same_params(engine, swapped_engine(run, 1))


@pytest.mark.parametrize("fused", [False, True], ids=["per-run", "fused"])
def test_the_check_finds_each_moved_half_and_the_deltas_then_land_where_the_engine_reads(run, fused):
    engine, rx = booted(run, fused=fused, fused_backend="torch")
    report = rx.check_layout(boot_of(run))
    layers = run["cfg"].num_layers
    # gate and up of every layer moved (one run each: whole rows), nothing else
    assert report.runs_moved == 2 * layers
    assert sorted(report.moves) == sorted(f"model.layers.{i}.mlp.{p}.weight" for i in range(layers)
                                          for p in ("gate_proj", "up_proj"))
    inter, hidden = run["cfg"].intermediate_size, run["cfg"].hidden_size
    assert report.elements_moved == 2 * layers * inter * hidden
    assert report.runs_checked == sum(len(r.length) for r in rx.imap.tensors.values())
    assert_same_params(engine, swapped_engine(run, 0))  # checking writes nothing
    for step in range(1, STEPS + 1):
        rx.apply(step)
        assert_same_params(engine, swapped_engine(run, step))


def test_an_engine_that_did_not_move_anything_passes_with_no_moves(run):
    engine, rx = make_receiver(run["root"], run["cfg"], run["m0"])
    engine.load_weights(run["states"][0].items())
    report = rx.check_layout(boot_of(run))
    assert (report.runs_moved, report.moves) == (0, {})
    assert report.runs_checked > 0


def test_moves_found_once_are_applied_to_a_new_receiver_of_the_same_engine(run):
    engine, rx = booted(run)
    moves = rx.check_layout(boot_of(run)).moves
    rx.apply(2)
    # attaching again: the engine no longer holds its boot weights, so the moves found at boot are reused
    spec = {n: (t["shape"], t["dtype"]) for n, t in run["m0"]["tensors"].items()}
    rx2 = DeltaReceiver(run["root"], engine, IndexMap.record(engine.recording_copy, spec))
    rx2.relocate(moves)
    rx2.load_latest()
    rx2.apply(STEPS)
    assert_same_params(engine, swapped_engine(run, STEPS))


@torch.no_grad()
def test_a_block_the_engine_changed_after_loading_is_found_nowhere_and_nothing_is_written(run):
    engine, rx = booted(run)
    w = engine.model.layers[1].mlp.down_proj.weight
    w.mul_(2)  # values, not a move: no block of the checkpoint is there any more
    before = {n: p.clone() for n, p in engine.named_parameters()}
    with pytest.raises(fmt.LayoutMovedError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: 1 recorded write\(s\) "
                                                   r"hold other values .* found nowhere else in it"):
        rx.check_layout(boot_of(run))
    for n, p in engine.named_parameters():
        assert torch.equal(p, before[n]), n
    assert rx.held is None and rx.step is None


@torch.no_grad()
def test_a_short_run_that_moved_is_refused_rather_than_placed_by_chance():
    # one run of MIN_RELOCATED_RUN - 1 elements, moved by one position inside its parameter
    n = MIN_RELOCATED_RUN - 1
    engine = torch.nn.Module()
    engine.w = torch.nn.Parameter(torch.zeros(n + 1, dtype=torch.bfloat16), requires_grad=False)
    boot = torch.arange(1, n + 1, dtype=torch.bfloat16)
    engine.w[1:] = boot
    one = np.array([0]), np.array([n]), np.array([0]), np.array([0])
    imap = IndexMap(["w"], {"t": TensorRuns("t", n, *[a.astype(np.int64) for a in one])})
    rx = DeltaReceiver("/nonexistent", engine, imap)
    with pytest.raises(fmt.LayoutMovedError, match=f"runs under {MIN_RELOCATED_RUN} elements are not searched"):
        rx.check_layout(lambda name: boot)


def test_find_block_sees_one_place_several_places_and_none():
    g = torch.Generator().manual_seed(0)
    hay = torch.randint(-(1 << 15), 1 << 15, (5000,), generator=g, dtype=torch.int16)
    needle = hay[1234:1300].clone()
    assert _find_block(hay, needle) == [1234]
    hay[3000:3066] = needle
    assert _find_block(hay, needle) == [1234, 3000]
    assert _find_block(hay, -needle - 1) == []
    flat = torch.zeros(1000, dtype=torch.int16)  # a constant block sits everywhere: more than `most` places
    assert len(_find_block(flat, flat[:20], most=8)) == 9


@pytest.mark.gpu
def test_on_a_gpu_the_fused_kernel_patches_the_followed_layout(run):
    engine, rx = booted(run)
    engine.cuda()  # booted and moved on the CPU, then served from the GPU
    rx = DeltaReceiver(run["root"], engine, rx.imap, fused=True, fused_backend="triton")
    assert rx.check_layout(boot_of(run)).runs_moved == 2 * run["cfg"].num_layers
    for step in range(1, STEPS + 1):
        rx.apply(step)
    want = swapped_engine(run, STEPS)
    for (n, a), b in zip(engine.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(a.cpu(), b), n
