"""A small vLLM-style engine model: fused qkv/gate_up weights sliced by tensor-parallel rank.

It exists so the receiver's index map, anchor loads, delta applies and TP verification can be
exercised end to end on a CPU with real packing and slicing, exactly as a vLLM worker lays weights
out: ``qkv_proj`` packs q, k and v rows (column parallel); KV heads are replicated over workers when
TP exceeds the number of KV heads; ``gate_up_proj`` packs gate and up rows; ``o_proj`` and
``down_proj`` are row parallel (their input columns are sliced); embeddings and ``lm_head`` are
vocab parallel; norms are replicated. Its only entry point for weights is
``load_weights(iterable of (checkpoint name, tensor))``, as in vLLM, and the index map is recorded
by running it on placeholders. It computes nothing (weight sync only needs the weights).

Example::

    engine = ToyEngine(ToyEngineConfig.from_hf(hf_config), tp_rank=1, tp_size=2, dtype=torch.bfloat16)
    engine.load_weights(hf_model.state_dict().items())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ToyEngineConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg) -> ToyEngineConfig:
        """From a transformers Qwen3/Llama-style config."""
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                   cfg.num_attention_heads, cfg.num_key_value_heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                   bool(cfg.tie_word_embeddings))


class _Weight(nn.Module):
    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class ToyEngine(nn.Module):
    """Weights of one TP worker of a Qwen3-style decoder, laid out the way vLLM lays them out."""

    def __init__(self, cfg: ToyEngineConfig, tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        for what, n in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size),
                        ("vocab_size", cfg.vocab_size)):
            if n % tp_size:
                raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")
        if cfg.num_kv_heads % tp_size and tp_size % cfg.num_kv_heads:
            raise ValueError(f"num_kv_heads={cfg.num_kv_heads} and tp_size={tp_size}: one must divide the other")
        self.cfg, self.tp_rank, self.tp_size = cfg, tp_rank, tp_size
        hd, h = cfg.head_dim, cfg.hidden_size
        self.q_heads = cfg.num_heads // tp_size
        self.kv_heads = max(1, cfg.num_kv_heads // tp_size)
        self.inter = cfg.intermediate_size // tp_size
        self.vocab = cfg.vocab_size // tp_size
        self.model = nn.Module()
        self.model.embed_tokens = _Weight(self.vocab, h, dtype=dtype)
        self.model.norm = _Weight(h, dtype=dtype)
        self.model.layers = nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = _Weight((self.q_heads + 2 * self.kv_heads) * hd, h, dtype=dtype)
            layer.self_attn.o_proj = _Weight(h, self.q_heads * hd, dtype=dtype)
            layer.self_attn.q_norm = _Weight(hd, dtype=dtype)
            layer.self_attn.k_norm = _Weight(hd, dtype=dtype)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = _Weight(2 * self.inter, h, dtype=dtype)
            layer.mlp.down_proj = _Weight(h, self.inter, dtype=dtype)
            layer.input_layernorm = _Weight(h, dtype=dtype)
            layer.post_attention_layernorm = _Weight(h, dtype=dtype)
            self.model.layers.append(layer)
        if cfg.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = _Weight(self.vocab, h, dtype=dtype)

    def recording_copy(self, dtype: torch.dtype) -> ToyEngine:
        """The same layout in another dtype (what an index map is recorded on)."""
        return ToyEngine(self.cfg, self.tp_rank, self.tp_size, dtype=dtype)

    def _kv_head_range(self) -> tuple[int, int]:
        kv, tp = self.cfg.num_kv_heads, self.tp_size
        if tp >= kv:  # replicated: tp // kv workers share each KV head
            head = self.tp_rank // (tp // kv)
            return head, head + 1
        return self.tp_rank * self.kv_heads, (self.tp_rank + 1) * self.kv_heads

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into this worker's packed, sliced parameters; return the names loaded."""
        hd, r = self.cfg.head_dim, self.tp_rank
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the engine holds one tensor, loaded from embed_tokens
            parts = name.split(".")
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                dest = params[".".join(parts[:-2] + ["qkv_proj", "weight"])]
                which = parts[-2][0]
                if which == "q":
                    rows = slice(r * self.q_heads * hd, (r + 1) * self.q_heads * hd)
                    dest[: self.q_heads * hd].copy_(w[rows])
                else:
                    h0, h1 = self._kv_head_range()
                    base = self.q_heads * hd + (0 if which == "k" else self.kv_heads * hd)
                    dest[base: base + self.kv_heads * hd].copy_(w[h0 * hd: h1 * hd])
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                dest = params[".".join(parts[:-2] + ["gate_up_proj", "weight"])]
                base = 0 if parts[-2] == "gate_proj" else self.inter
                dest[base: base + self.inter].copy_(w[r * self.inter: (r + 1) * self.inter])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                dest = params[name]
                cols = dest.shape[1]
                dest.copy_(w[:, r * cols: (r + 1) * cols])
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                params[name].copy_(w[r * self.vocab: (r + 1) * self.vocab])
            elif name in params:
                params[name].copy_(w)
            else:
                raise KeyError(f"checkpoint tensor {name} has no parameter in this engine")
            loaded.add(name)
        return loaded
