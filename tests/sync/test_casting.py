"""Cast tensors in a torch engine: a parameter held in float32 while the checkpoint is bf16 (an engine that
keeps its final norm in float32) is loaded by value with the engine's cast, never patched; a delta that
changes it is refused before anything is written, and the engine keeps serving its last good weights.
The real vLLM case (GLM-4.5's float32 router) is in ``test_vllm_moe_casting.py``."""

from __future__ import annotations

import pytest
import torch
from sync_helpers import Trainer, assert_same_params, engine_cfg

from rltune.sync.casting import CastTensorChangedError
from rltune.sync.indexmap import IndexMap
from rltune.sync.receiver import DeltaReceiver
from rltune.sync.toy_engine import ToyEngine

NORM = "model.norm.weight"


def _engine(cfg) -> ToyEngine:
    engine = ToyEngine(cfg)
    engine.model.norm.weight.data = engine.model.norm.weight.data.float()  # the engine computes its norm in fp32
    return engine


def _reference(cfg, state) -> ToyEngine:
    engine = _engine(cfg)
    engine.load_weights(state.items())  # load_weights casts, as vLLM's loader does (copy_)
    return engine


def _receiver(root, cfg, manifest, engine):
    spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
    return DeltaReceiver(root, engine, IndexMap.record(engine.recording_copy, spec), manifest=manifest)


@pytest.mark.parametrize("manifest_at_start", [True, False], ids=["split-at-attach", "split-at-first-update"])
def test_a_frozen_cast_tensor_loads_by_value_and_every_other_tensor_is_patched(tmp_path, manifest_at_start):
    tr = Trainer(tmp_path, interval=2)
    tr.model.model.norm.weight.requires_grad_(False)  # frozen: no delta changes it
    m0 = tr.pub.publish(0)
    engine = _engine(engine_cfg(tr))
    rx = _receiver(tmp_path, engine_cfg(tr), m0, engine) if manifest_at_start else \
        DeltaReceiver(tmp_path, engine, IndexMap.record(engine.recording_copy, {n: (t["shape"], t["dtype"])
                                                                                 for n, t in m0["tensors"].items()}))
    rx.load_latest()
    assert rx.cast.names == [NORM]
    for step in range(1, 5):  # deltas 1, 3 and anchors 2, 4
        tr.train_step()
        tr.pub.publish(step)
        rx.apply(step)
        assert_same_params(engine, _reference(engine_cfg(tr), tr.wire_state()))
    assert engine.model.norm.weight.dtype == torch.float32
    rx.cast.verify()


def test_a_delta_that_changes_a_cast_tensor_is_refused_and_the_engine_keeps_its_weights(tmp_path):
    tr = Trainer(tmp_path, interval=10, lr=0.05)  # large enough to move a bf16 1.0 (its spacing is 2^-7)
    m0 = tr.pub.publish(0)
    engine = _engine(engine_cfg(tr))
    rx = _receiver(tmp_path, engine_cfg(tr), m0, engine)
    rx.load_latest()
    held = {n: p.clone() for n, p in engine.named_parameters()}
    before = tr.wire_state()[NORM].clone()
    tr.train_step()  # AdamW moves the norm too
    tr.pub.publish(1)
    assert not torch.equal(tr.wire_state()[NORM], before), "the step left the norm's bf16 bits: the test would be vacuous"
    with pytest.raises(CastTensorChangedError, match=rf"step 1 changes {NORM}, which the engine holds in float32 cast "
                                                     r"from the checkpoint's bfloat16"):
        rx.apply(1)
    for n, p in engine.named_parameters():
        assert torch.equal(p, held[n]), n
    assert rx.held is not None and rx.step == 0  # still valid at its last good step


@pytest.mark.gpu
def test_on_a_gpu_a_cast_tensor_loads_by_value_beside_the_fused_patches(tmp_path):
    tr = Trainer(tmp_path, interval=2)
    tr.model.model.norm.weight.requires_grad_(False)
    m0 = tr.pub.publish(0)
    engine = _engine(engine_cfg(tr)).cuda()
    spec = {n: (t["shape"], t["dtype"]) for n, t in m0["tensors"].items()}
    rx = DeltaReceiver(tmp_path, engine, IndexMap.record(engine.recording_copy, spec), manifest=m0, fused=True,
                       fused_backend="triton")
    rx.load_latest()
    for step in range(1, 4):
        tr.train_step()
        tr.pub.publish(step)
        rx.apply(step)
    want = _reference(engine_cfg(tr), tr.wire_state())
    for (n, a), b in zip(engine.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(a.cpu(), b), n
    rx.cast.verify()
