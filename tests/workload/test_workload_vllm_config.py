"""The vLLM backend's config keys: what validation refuses before vLLM is even imported, and how engine
arguments are derived from the rest of the config (no vLLM needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rltune.errors import UnknownKeyError, WrongTypeError
from rltune.workload.config import load_workload_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "presets" / "workload" / "tiny-math.yaml"
TINY_VLLM = REPO / "presets" / "workload" / "tiny-math-vllm.yaml"


def test_engine_vllm_entries_are_set_one_at_a_time_by_override():
    cfg = load_workload_config(TINY_VLLM, ["engine.vllm.max_num_seqs=512", "engine.vllm.block_size=32",
                                           "engine.vllm.speculative_config={method: ngram, num_speculative_tokens: 2}"])
    assert cfg.engine.vllm["max_num_seqs"] == 512 and cfg.engine.vllm["block_size"] == 32
    assert cfg.engine.vllm["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert cfg.engine.vllm["enable_prefix_caching"] is True  # the file's other entries stay
    with pytest.raises(UnknownKeyError, match=r"engine\.vlm\.max_num_seqs: unknown override key \(did you mean 'engine\.vllm\.max_num_seqs'\?\)"):
        load_workload_config(TINY_VLLM, ["engine.vlm.max_num_seqs=4"])
    with pytest.raises(UnknownKeyError, match="engine.vllm.: unknown override key"):
        load_workload_config(TINY_VLLM, ["engine.vllm.=4"])


@pytest.mark.parametrize(("config", "override", "where", "text"), [
    (TINY, "engine.vllm.max_num_seqs=8", "engine.vllm", "only vLLM engines take it; set engine.backend: vllm"),
    (TINY, "engine.serve=true", "engine.serve", "only vLLM engines take it"),
    (TINY_VLLM, "sync.transport=inprocess", "sync.transport", "inprocess has no loader for vLLM engines; they take "
                                                              "filesystem or sparse_delta"),
    (TINY_VLLM, "engine.compile=true", "engine.compile", "HF engine only"),
    (TINY_VLLM, "engine.batching=static", "engine.batching", "HF engine only"),
    (TINY_VLLM, "engine.vllm.dtype=float16", "engine.vllm.dtype", "rltune sets this vLLM argument itself: set model.engine_dtype"),
    (TINY_VLLM, "engine.vllm.max_model_len=4096", "engine.vllm.max_model_len", "env.context_limit_tokens"),
    (TINY_VLLM, "engine.vllm.kv_cache_memory_bytes=1", "engine.vllm.kv_cache_memory_bytes", "engine.kv_cache_tokens"),
])
def test_keys_the_vllm_backend_refuses_name_the_key_and_the_fix(config, override, where, text):
    with pytest.raises(WrongTypeError) as err:
        load_workload_config(config, [override])
    assert str(err.value).startswith(f"{config}: {where}: ") and text in str(err.value)


def test_engine_arguments_come_from_the_config_and_spec_tokens_0_is_speculation_off():
    from rltune.workload.engine_vllm import engine_arguments, kv_cache_bytes, max_model_len

    cfg = load_workload_config(TINY_VLLM, ["env.context_limit_tokens=120", "env.max_new_tokens=8",
                                           "engine.kv_cache_tokens=1000", "engine.vllm.spec_method=ngram",
                                           "engine.vllm.spec_tokens=0"])
    args = engine_arguments(cfg)
    assert max_model_len(cfg) == args["max_model_len"] == 128
    # tiny: 2 layers x (K and V) x 2 KV heads x 32 dims x 2 bytes (bf16) = 512 bytes a token
    assert kv_cache_bytes(cfg) == args["kv_cache_memory_bytes"] == 1000 * 512
    assert (args["dtype"], args["logprobs_mode"], args["skip_tokenizer_init"]) == ("bfloat16", "processed_logprobs", True)
    assert "spec_tokens" not in args and "spec_method" not in args
    on = engine_arguments(load_workload_config(TINY_VLLM, ["engine.vllm.spec_method=ngram", "engine.vllm.spec_tokens=3"]))
    assert (on["spec_method"], on["spec_tokens"]) == ("ngram", 3)


def test_loading_a_vllm_config_does_not_import_vllm_or_torch():
    import subprocess

    code = ("import sys; from rltune.workload.config import load_workload_config; "
            f"from rltune.workload.engine_vllm import engine_arguments; engine_arguments(load_workload_config({str(TINY_VLLM)!r})); "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-1000:]
    assert out.stdout.strip() == "[]"
