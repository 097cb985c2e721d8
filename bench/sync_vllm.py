"""Benchmark sparse delta updates of a real vLLM engine against vLLM's own ``reload_weights``, in one run.

A Qwen3 built from a config (random init, bf16; nothing is downloaded) trains with real AdamW
steps on random token batches and publishes through DeltaPublisher. Two vLLM engines start from
the same boot checkpoint in this process: engine A is attached through ``rltune.sync.vllm`` (the
worker extension), engine B is plain vLLM. After each step:

- the trainer publishes the delta (timed) and writes the step's Hugging Face checkpoint (timed:
  what B's reload needs);
- A's workers start reading and decoding the delta (``prepare``) and A generates a batch while they
  run (timed: generation with the prefetch overlapping it); then A's dispatch-blocking update
  (pause -> apply + verify -> resume) is timed;
- B's ``reload_weights(weights_path=checkpoint)`` of the same weights is timed (the baseline);
- A generates the same batch again with nothing in flight (timed: generation without prefetch), and
  both engines' greedy tokens are compared (A computes with plain weights, B with vLLM's repacked
  ones, so this shows whether the two GEMM paths round alike here; exactness against a fresh
  engine is bench/sync_vllm_exactness.py's job).

Min/median/max over the steps after ``--warmup`` and the ratio of the medians go into the JSON
record with the config, device, versions and git SHA.

Usage (the CPU, in-process engines)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_HOST_IP=127.0.0.1 \\
        python bench/sync_vllm.py --steps 8 --out bench/results/sync_vllm-cpu.json
    python bench/sync_vllm.py --experts 16 --hidden 512 --heads 8 --layers 8 --steps 8 \\
        --out bench/results/sync_vllm-moe-cpu.json             # a Qwen3-MoE (vLLM's fused experts)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# KV caches are sized with kv_cache_memory_bytes (VLLM_CPU_KVCACHE_SPACE, if set, overrides it)
for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_HOST_IP", "127.0.0.1")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltune.sync.bench import git_sha  # noqa: E402


def stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(min=min(values), median=statistics.median(values), max=max(values))


def build_trainer(args, workdir: Path):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 head_dim=args.hidden // args.heads, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    if args.experts:  # Qwen3-MoE: every layer's MLP is routed experts (vLLM's CPU fused-MoE path repacks them)
        cfg = Qwen3MoeConfig(**shape, num_experts=args.experts, num_experts_per_tok=args.top_k,
                             moe_intermediate_size=args.expert_intermediate, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    return model, opt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: a dense Qwen3)")
    parser.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")
    parser.add_argument("--expert-intermediate", type=int, default=512, help="MoE: each expert's width")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temporary directory)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    from rltune.sync.sender import DeltaPublisher
    from rltune.sync.vllm import WORKER_EXTENSION, VllmReceiver

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rltune-sync-vllm-"))
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    model, opt = build_trainer(args, workdir)
    n_params = sum(p.numel() for p in model.parameters())
    boot = workdir / "checkpoint-0"
    model.save_pretrained(boot)
    pub = DeltaPublisher(model, opt, workdir / "broadcast", interval=10 ** 6, run_id="sync-vllm-bench")
    pub.publish(0)
    kw = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=512,
              kv_cache_memory_bytes=256 << 20, seed=0)
    t0 = time.perf_counter()
    engine_a = LLM(model=str(boot), worker_extension_cls=WORKER_EXTENSION, **kw)
    boot_a_s = time.perf_counter() - t0
    engine_b = LLM(model=str(boot), **kw)
    rx = VllmReceiver(engine_a, str(workdir / "broadcast"))
    (attach,) = rx.attach()
    sampling = SamplingParams(max_tokens=args.gen_tokens, temperature=0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [{"prompt_token_ids": torch.randint(0, args.vocab, (16,), generator=gen).tolist()}
               for _ in range(args.prompts)]

    def generate(llm) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    generate(engine_a)  # the first request pays for lazy set-up in both engines
    generate(engine_b)
    rows = []
    for step in range(1, args.warmup + args.steps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        t1 = time.perf_counter()
        pub.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        manifest = pub.publish(step)
        t3 = time.perf_counter()
        ckpt = workdir / f"checkpoint-{step}"
        model.save_pretrained(ckpt)
        t4 = time.perf_counter()

        rx.prepare(step)
        gen_with_prefetch_s, _ = generate(engine_a)
        update = rx.update(step)
        (worker,) = update.workers
        gen_plain_s, tokens_a = generate(engine_a)

        t5 = time.perf_counter()
        engine_b.collective_rpc("reload_weights", kwargs=dict(weights_path=str(ckpt), is_checkpoint_format=True))
        reload_s = time.perf_counter() - t5
        _, tokens_b = generate(engine_b)
        shutil.rmtree(workdir / f"checkpoint-{step - 1}", ignore_errors=True) if step > 1 else None

        row = dict(step=step, warmup=step <= args.warmup, forward_backward_s=t1 - t0, optimizer_step_s=t2 - t1,
                   publish_s=t3 - t2, save_checkpoint_s=t4 - t3, delta_bytes=sum(f["bytes"] for f in manifest["parts"]),
                   changes=update.changes, changed_frac=update.changes / n_params, action=update.action,
                   prefetched=update.prefetched, prestaged=step in worker.get("prestaged", []),
                   prefetch_s=worker.get("prefetch_s"),
                   pause_s=update.pause_s, apply_s=update.apply_s, resume_s=update.resume_s,
                   dispatch_blocking_s=update.dispatch_blocking_s, worker_update_s=worker["worker_s"],
                   reload_weights_s=reload_s, generate_with_prefetch_s=gen_with_prefetch_s,
                   generate_plain_s=gen_plain_s, greedy_equal_to_reload=tokens_a == tokens_b,
                   **{f"worker_{k}_s": v for k, v in worker["phases"].items()})
        rows.append(row)
        print(f"step {step}: update {row['dispatch_blocking_s'] * 1e3:.1f} ms (prefetch {row['prefetch_s'] * 1e3:.0f} ms "
              f"while generating {gen_with_prefetch_s * 1e3:.0f} ms), reload_weights {reload_s * 1e3:.0f} ms, "
              f"{update.changes} changes, greedy equal {row['greedy_equal_to_reload']}", file=sys.stderr, flush=True)

    measured = [r for r in rows if not r["warmup"]]
    columns = [k for k, v in rows[0].items() if isinstance(v, float | int) and not isinstance(v, bool) and k != "step"]
    summary = {c: stats([r[c] for r in measured]) for c in columns}
    ratio = summary["reload_weights_s"]["median"] / summary["dispatch_blocking_s"]["median"]
    record = dict(
        kind="rltune-bench-sync-vllm", created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), git_sha=git_sha(),
        config=dict(vars(args), workdir=str(workdir), out=str(args.out)),
        model=dict(params=n_params, dtype="bfloat16", architecture=f"{type(model).__name__} (random init)"),
        device=dict(type="cpu", cpu=platform.processor() or platform.machine(), count=os.cpu_count(),
                    python=platform.python_version(), torch=torch.__version__, vllm=vllm.__version__,
                    transformers=transformers.__version__),
        engine=dict(boot_s=boot_a_s, attach=attach), summary_over="steps after --warmup (min/median/max)",
        summary=summary, reload_over_update_median=ratio,
        greedy_equal_to_reload=all(r["greedy_equal_to_reload"] for r in rows),
        all_prefetched=all(r["prefetched"] for r in rows), all_prestaged=all(r["prestaged"] for r in rows), rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"dispatch-blocking update median {summary['dispatch_blocking_s']['median'] * 1e3:.1f} ms, "
          f"reload_weights median {summary['reload_weights_s']['median'] * 1e3:.0f} ms: {ratio:.1f}x; wrote {args.out}",
          file=sys.stderr)
    if args.workdir is None:  # the boot, last step's checkpoint and the store: gigabytes at the larger sizes
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
