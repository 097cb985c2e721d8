"""The policy model: a Qwen3 causal LM built from a config and initialised randomly (seeded).

Nothing is downloaded. ``tiny`` runs a step in seconds on a CPU; ``small`` has ~0.5 B parameters
for one H200 and can be checked on a CPU without materialising weights (meta device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rltune.workload.tokenizer import TOKENIZER

if TYPE_CHECKING:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

# Shapes of each preset. tiny matches presets/cpu-demo.yaml's model facts.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024),
    # mini: big enough on a CPU that moving whole weights costs more than the fixed costs of a sync
    "mini": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=1024),
    "small": dict(hidden_size=1280, intermediate_size=4096, num_hidden_layers=26, num_attention_heads=20,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}


def model_config(preset: str, attn_implementation: str = "sdpa") -> Qwen3Config:
    """The transformers config of a preset, with the shipped tokenizer's vocabulary."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=TOKENIZER.vocab_size,
        pad_token_id=TOKENIZER.pad_id,
        bos_token_id=TOKENIZER.bos_id,
        eos_token_id=TOKENIZER.eos_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        **PRESETS[preset],
    )
    cfg._attn_implementation = attn_implementation
    return cfg


def build_model(preset: str, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                attn_implementation: str = "sdpa") -> Qwen3ForCausalLM:
    """A randomly initialised model; the same (preset, seed, device type) gives bit-identical weights.

    Weights are initialised on the target device (a 0.5 B model initialises in seconds on a GPU,
    not a minute on a CPU); trainer and engines therefore agree whenever they share a device type.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(model_config(preset, attn_implementation))
    return model.to(dtype=dtype)


def count_parameters(preset: str) -> int:
    """Parameters of a preset, counted on the meta device (no memory is allocated)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(model_config(preset))
    return sum(p.numel() for p in model.parameters())


def resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def sampled_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) under the temperature-scaled distribution; engine and trainer share this."""
    import torch

    logp = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    return logp.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
