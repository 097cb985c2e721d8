"""The models the sync benchmarks train: Qwen3 shapes, built from their spec here (random init, seeded).

The harnesses (:func:`rltune.sync.bench.run_sync_bench`, :func:`rltune.sync.bench.readers.run_readers_bench`)
are handed a :data:`ModelBuilder` by the command that runs them, :func:`build_bench_model` unless it
hands another (a framework's own model). Nothing here reads the reference workload: ``tiny`` and
``small`` carry the shapes of its presets of the same names (and its 93-token character vocabulary,
pad id 0), so a bench record compares with those made when the bench built the workload's model.

Example::

    model = build_bench_model("tiny", seed=0, dtype=torch.bfloat16, device="cpu")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# (model name, seed, parameter dtype, device) -> a model whose .config is a transformers Qwen3Config
ModelBuilder = Callable[[str, int, "torch.dtype", Any], "torch.nn.Module"]


@dataclass(frozen=True)
class BenchModel:
    """A Qwen3 causal LM's shape."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # lm_head shares the embedding
    max_positions: int = 1024
    special_ids: tuple[int, int, int] | None = None  # (pad, bos, eos): the pad row starts at zero


BENCH_MODELS: dict[str, BenchModel] = {
    "tiny": BenchModel(93, 128, 384, 2, 4, 2, 32, False, 1024, (0, 1, 2)),  # ~0.4 M, a CPU step in ms
    "small": BenchModel(93, 1280, 4096, 26, 20, 4, 64, False, 4096, (0, 1, 2)),  # ~0.5 B, one H200
    "40m": BenchModel(32000, 512, 1536, 8, 8, 4, 64, True),
    "125m": BenchModel(32000, 768, 2048, 12, 12, 4, 64, False),
}


def bench_model_config(name: str):
    """The transformers ``Qwen3Config`` of a bench model."""
    from transformers import Qwen3Config

    m = BENCH_MODELS[name]
    special = {} if m.special_ids is None else dict(zip(("pad_token_id", "bos_token_id", "eos_token_id"),
                                                        m.special_ids, strict=True))
    cfg = Qwen3Config(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
                      num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                      head_dim=m.head_dim, max_position_embeddings=m.max_positions, tie_word_embeddings=m.tied,
                      **special)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_bench_model(name: str, seed: int, dtype: torch.dtype, device: Any = "cpu") -> torch.nn.Module:
    """A randomly initialised bench model; the same (name, seed, device type) gives bit-identical weights.

    Initialised on ``device`` (a 0.5 B model in seconds on a GPU, not a minute on a CPU)."""
    import torch
    from transformers import Qwen3ForCausalLM

    cfg = bench_model_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype=dtype)


__all__ = ["BENCH_MODELS", "BenchModel", "ModelBuilder", "bench_model_config", "build_bench_model"]
