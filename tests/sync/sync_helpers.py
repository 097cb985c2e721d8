"""Shared builders for the sync tests: a tiny real Qwen3 trainer, a publisher, toy engines."""

from __future__ import annotations

import torch

from rltune.sync.indexmap import IndexMap
from rltune.sync.receiver import DeltaReceiver
from rltune.sync.sender import DeltaPublisher, SignSGD
from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig


def tiny_qwen3(kv_heads: int = 2, tie: bool = False, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               hidden: int = 32, heads: int = 4, head_dim: int = 8, intermediate: int = 64, max_positions: int = 64):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=128, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_positions, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(dtype)


class Trainer:
    """A real model, a real optimizer and a publisher; ``train_step`` runs a real forward/backward."""

    def __init__(self, root, interval=3, optimizer="adamw", lr=1e-3, kv_heads=2, tie=False,
                 dtype=torch.bfloat16, wire_dtype=None, chunk_elements=1000, rank=0, world=1, run_id="run-a",
                 dense_fraction=None, encoder="auto", differ="torch", change_capacity=0.1, fused=None, incarnation=None,
                 keep_anchors=2, model_kw=None, coding="entropy", fp32=()):
        self.model = tiny_qwen3(kv_heads, tie, dtype, **(model_kw or {}))
        for name in fp32:  # parameters the trainer keeps in float32 (a norm, a router), the rest in ``dtype``
            p = self.model.get_parameter(name)
            p.data = p.data.float()
        if optimizer == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01, fused=fused)
        else:
            self.opt = SignSGD(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.pub = DeltaPublisher(self.model, self.opt, root, interval, rank=rank, world=world, run_id=run_id,
                                  chunk_elements=chunk_elements, wire_dtype=wire_dtype, dense_fraction=dense_fraction,
                                  encoder=encoder, differ=differ, change_capacity=change_capacity,
                                  incarnation=incarnation, keep_anchors=keep_anchors, coding=coding)
        self.gen = torch.Generator().manual_seed(1)

    def train_step(self):
        ids = torch.randint(0, 128, (2, 16), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.pub.step()
        self.opt.zero_grad()

    def wire_state(self):
        wire = self.pub.wire_dtype
        return {k: (v.detach().to(wire) if wire is not None and v.is_floating_point() else v.detach())
                for k, v in self.model.state_dict().items()}


def engine_cfg(trainer: Trainer) -> ToyEngineConfig:
    return ToyEngineConfig.from_hf(trainer.model.config)


def make_receiver(root, cfg: ToyEngineConfig, manifest: dict, tp_rank=0, tp_size=1, group=None, **kw):
    engine = ToyEngine(cfg, tp_rank, tp_size)
    spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
    imap = IndexMap.record(lambda dt: ToyEngine(cfg, tp_rank, tp_size, dtype=dt), spec)
    return engine, DeltaReceiver(root, engine, imap, group=group, **kw)


def reference_engine(cfg: ToyEngineConfig, state: dict, tp_rank=0, tp_size=1) -> ToyEngine:
    engine = ToyEngine(cfg, tp_rank, tp_size)
    engine.load_weights(state.items())
    return engine


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n
