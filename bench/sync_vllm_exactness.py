"""Exactness of sparse delta updates in a real vLLM engine, every step of a run, at TP 1 or TP 2.

A small Qwen3 (random init, bf16, vocabulary padded by vLLM) trains with real AdamW steps and
publishes through DeltaPublisher; one vLLM engine attached through ``rltune.sync.vllm`` follows
every step (``prepare`` while it generates, ``update`` in the pause). After each step the trainer's
Hugging Face checkpoint of that step is handed to a **fresh** engine, started in a process of its
own (vLLM's parallel state is per process), which reports its greedy tokens for fixed prompts and
the SHA-256 of every parameter as vLLM's own loader wrote it (plain weights, before repacking). The
run records, per step, whether the followed engine's greedy tokens and parameter bytes (per TP
rank) equal the fresh engine's.

Usage::

    python bench/sync_vllm_exactness.py --steps 20 --tp 1 --out bench/results/sync_vllm_exactness-tp1.json
    VLLM_CPU_OMP_THREADS_BIND="0|1" python bench/sync_vllm_exactness.py --steps 20 --tp 2 \\
        --out bench/results/sync_vllm_exactness-tp2.json
    python bench/sync_vllm_exactness.py --experts 4 --steps 20 --tp 1 --out ...   # a Qwen3-MoE
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# KV caches are sized with kv_cache_memory_bytes (VLLM_CPU_KVCACHE_SPACE, if set, overrides it)
for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1")):
    os.environ.setdefault(key, value)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[11 + i, 7, 400 + 3 * i, 5, 900 - i] for i in range(8)]


def engine(model_dir: str, tp: int, extension: bool):
    from vllm import LLM

    from rltune.sync.vllm import WORKER_EXTENSION

    kw = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
              kv_cache_memory_bytes=16 << 20, tensor_parallel_size=tp, seed=0)
    if tp > 1:
        kw["distributed_executor_backend"] = "mp"
    return LLM(model=model_dir, worker_extension_cls=WORKER_EXTENSION if extension else None, **kw)


def greedy(llm, tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=tokens, temperature=0),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference(model_dir: str, tp: int, tokens: int, out: str) -> int:
    """Child process: a fresh engine on ``model_dir``; its greedy tokens and plain-weight digests."""
    from rltune.sync.vllm.receiver import VllmReceiver

    llm = engine(model_dir, tp, extension=True)
    tokens_out = greedy(llm, tokens)  # generated with vLLM's own (repacked) weights, before anything changes
    digests = [{n: w["sha256"] for n, w in r["weights"].items()}
               for r in VllmReceiver(llm, "unused")._call("rltune_weights", dict(plain=True))]
    Path(out).write_text(json.dumps(dict(tokens=tokens_out, digests=digests)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--interval", type=int, default=7, help="anchor every N steps (followed as deltas)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: a dense Qwen3)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reference", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reference:
        return reference(args.reference[0], args.tp, args.tokens, args.reference[1])

    import torch
    import transformers
    import vllm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rltune.sync.bench import git_sha
    from rltune.sync.sender import DeltaPublisher
    from rltune.sync.vllm import VllmReceiver

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rltune-exactness-"))
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    shape = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    if args.experts:  # Qwen3-MoE: transformers fuses the experts, vLLM stacks and repacks them
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(**shape, num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=64,
                             norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    else:
        cfg = Qwen3Config(**shape)
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    pub = DeltaPublisher(model, opt, workdir / "broadcast", args.interval, run_id="exactness")
    pub.publish(0)
    model.save_pretrained(workdir / "checkpoint-0")
    llm = engine(str(workdir / "checkpoint-0"), args.tp, extension=True)
    rx = VllmReceiver(llm, str(workdir / "broadcast"))
    rx.attach()
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        pub.step()
        opt.zero_grad(set_to_none=True)
        manifest = pub.publish(step)
        ckpt = workdir / f"checkpoint-{step}"
        model.save_pretrained(ckpt)
        rx.prepare(step)
        greedy(llm, args.tokens)  # serving while the workers read the step
        summary = rx.update(step)
        got_tokens = greedy(llm, args.tokens)
        got_digests = [{n: w["sha256"] for n, w in r.items()} for r in rx.weights()]
        ref_out = workdir / f"reference-{step}.json"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--tp", str(args.tp), "--tokens", str(args.tokens),
                        "--reference", str(ckpt), str(ref_out)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        ref = json.loads(ref_out.read_text())
        row = dict(step=step, kind=manifest["kind"], action=summary.action, changes=summary.changes,
                   prefetched=summary.prefetched,
                   prestaged=all(step in w.get("prestaged", []) for w in summary.workers),
                   dispatch_blocking_s=summary.dispatch_blocking_s,
                   greedy_equal=got_tokens == ref["tokens"], bytes_equal=got_digests == ref["digests"],
                   ranks=len(got_digests), reference_s=time.perf_counter() - t0)
        rows.append(row)
        print(f"step {step} ({row['kind']}): {row['action']}, {row['changes']} changes, greedy equal "
              f"{row['greedy_equal']}, bytes equal {row['bytes_equal']} on {row['ranks']} rank(s)", file=sys.stderr,
              flush=True)
        shutil.rmtree(workdir / f"checkpoint-{step - 1}", ignore_errors=True)
    record = dict(kind="rltune-bench-sync-vllm-exactness", created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  git_sha=git_sha(), config=dict(steps=args.steps, tp=args.tp, interval=args.interval, lr=args.lr,
                                                 tokens=args.tokens, prompts=len(PROMPTS), experts=args.experts),
                  model=dict(architecture=type(model).__name__, params=sum(p.numel() for p in model.parameters()),
                             vocab=cfg.vocab_size,
                             padded_vocab=-(-cfg.vocab_size // 64) * 64),
                  versions=dict(torch=torch.__version__, vllm=vllm.__version__, transformers=transformers.__version__),
                  all_greedy_equal=all(r["greedy_equal"] for r in rows),
                  all_bytes_equal=all(r["bytes_equal"] for r in rows),
                  all_deltas_in_place=all(r["action"] == "delta" for r in rows),
                  all_prestaged=all(r["prestaged"] for r in rows), rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"greedy equal {record['all_greedy_equal']}, bytes equal {record['all_bytes_equal']} over {args.steps} "
          f"steps; wrote {args.out}", file=sys.stderr)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if record["all_greedy_equal"] and record["all_bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
