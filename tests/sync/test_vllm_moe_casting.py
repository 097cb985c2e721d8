"""Casting loads in a real vLLM engine: tensors the engine holds in another dtype than the checkpoint's.

What runs: a random GLM-4.5-style MoE (``vllm_helpers.GlmMoeTrainer``) whose router weight and
``e_score_correction_bias`` the trainer keeps in bf16 while vLLM builds both in float32 and casts the
checkpoint's values into them. Such tensors are loaded by value with the engine's cast at attach
and at anchors; a delta that changes one is refused, naming it, with the engine's weights left as
they were. "A fresh engine" is a new ``LLM`` started on the trainer's checkpoint of the same step.
~40 s on 2 cores.
"""

from __future__ import annotations

import pytest
from vllm_helpers import (
    GlmMoeTrainer,
    assert_same_weights,
    greedy,
    reference_weights,
    requires_vllm,
    start_engine,
)

pytestmark = requires_vllm

ROUTER = "model.layers.1.mlp.gate.weight"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _receiver(llm, root):
    from rltune.sync.vllm import VllmReceiver

    return VllmReceiver(llm, str(root))


def _matches_a_fresh_engine(trainer, llm, rx) -> None:
    fresh = start_engine(trainer.save())
    assert greedy(llm) == greedy(fresh)
    assert_same_weights(rx.weights(tensors=True), reference_weights(fresh))


def test_a_bf16_router_is_loaded_by_value_into_the_float32_engine_and_a_delta_changing_it_is_refused(tmp_path):
    from rltune.sync.casting import CastTensorChangedError

    trainer = GlmMoeTrainer(tmp_path, interval=10, train_router=False)
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    (report,) = rx.attach()  # attaching used to fail: "casting loads are not patchable in place"
    assert report["cast"] == {ROUTER: "bfloat16 -> float32", BIAS: "bfloat16 -> float32"}
    _matches_a_fresh_engine(trainer, llm, rx)  # the engine's own cast, to the byte

    for _ in range(2):  # deltas that leave the router alone go through, exact
        step = trainer.train()
        rx.prepare(step)
        summary = rx.update(step)
        assert (summary.step, summary.action) == (step, "delta") and summary.changes > 0
        _matches_a_fresh_engine(trainer, llm, rx)
    tokens, weights = greedy(llm), rx.weights(tensors=True)

    trainer.router.weight.requires_grad_(True)  # now the optimizer moves the router: step 3's delta changes it
    step = trainer.train()
    rx.prepare(step)
    with pytest.raises(CastTensorChangedError, match=rf"step {step} changes {ROUTER}.*float32.*bfloat16.*force_full"):
        rx.update(step)
    assert greedy(llm) == tokens  # nothing was written: the engine serves step 2's weights
    assert_same_weights(rx.weights(tensors=True), weights)
    assert rx.check_weights() == 2

    trainer.train(publish=False)
    trainer.pub.force_full()  # the fix the message names: a full checkpoint holds the router's new values
    trainer.pub.publish(trainer.step)
    summary = rx.update(trainer.step)
    assert summary.step == trainer.step == 4
    _matches_a_fresh_engine(trainer, llm, rx)
    assert rx.check_weights() == 4
