"""Benchmark the delta codec on real AdamW deltas: bytes/change vs the entropy bound and plain zstd.

A transformers Qwen3 model is built from a config (random init; no weights are downloaded) and
trained for a few real AdamW steps on random tokens, with bf16 weights either as fp32 master
copies (published as bf16) or plain bf16, at lr 1e-6 and 1e-5 (on a CPU, plain-bf16 gradients are
computed in fp32 from the same weights and rounded to bf16; see ``real_adamw_delta``). The last step's bf16 wire-bit
delta of every tensor is then coded three ways, on the same changes:

- ``rltune.sync.codec`` (Rice gaps + rANS values, dense when smaller);
- plain zstd (level 3) over u32 index gaps + zigzag values (16-bit, or 32-bit when needed),
  the baseline the design started from; and the same with a byte shuffle of the gaps;
- the order-0 entropy bound (Bernoulli positions at each tensor's density + the empirical
  distribution of its value differences), summed over tensors.

Encode/decode throughput (changes/s) are min/median/max over ``--repeats`` passes. The codec runs
on the CPU (numba); ``--device`` sets where the model trains.

Usage::

    .venv/bin/python bench/sync_codec.py --device cpu --model-size 40m --out bench/results/sync_codec-cpu.json
    .venv/bin/python bench/sync_codec.py --quick --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltune.sync import codec  # noqa: E402
from rltune.sync.bench import git_sha  # noqa: E402  (RLTUNE_GIT_SHA or git's, -dirty when rltune/ changed)
from rltune.sync.kernels.reference import as_bits  # noqa: E402
from rltune.sync.ops import wire_diff  # noqa: E402

MODEL_SIZES = {
    # name: (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied)
    "tiny": (4096, 256, 768, 2, 4, 2, 64, True),
    "40m": (32000, 512, 1536, 8, 8, 4, 64, True),
    "166m": (32000, 1024, 3072, 8, 16, 8, 64, False),  # the H200 probe's model
    "0.6b": (151936, 1024, 3072, 28, 16, 8, 128, True),  # Qwen3-0.6B shape
}


def build_model(size: str, device: str, master: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    v, h, i, n, a, kv, hd, tied = MODEL_SIZES[size]
    cfg = Qwen3Config(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=a,
                      num_key_value_heads=kv, head_dim=hd, max_position_embeddings=2048, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device)
    return model.to(torch.bfloat16) if master == "bf16" else model


def real_adamw_delta(size: str, device: str, master: str, lr: float, steps: int, batch: int, seq: int):
    """Per tensor (numel, idx, diff) of the last of ``steps`` AdamW steps, in bf16 wire bits."""
    model = build_model(size, device, master)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    # A bf16 backward takes minutes on a CPU without bf16 matrix units: there the gradients of a bf16
    # model are computed by an fp32 copy holding the same (exactly upcast) weights, then rounded to bf16.
    # The optimizer step, which is what makes the delta, is the real bf16 AdamW step either way.
    grad_model = build_model(size, device, "fp32") if (master == "bf16" and device == "cpu") else None
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1)

    def wire(p):
        return as_bits(p.detach().to(torch.bfloat16).contiguous()).clone()

    prev = {n: wire(p) for n, p in model.named_parameters()}
    changed_frac = []
    deltas = {}
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        if device == "cuda":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        elif grad_model is not None:
            with torch.no_grad():
                for gp, p in zip(grad_model.parameters(), model.parameters(), strict=True):
                    gp.copy_(p)
            grad_model(input_ids=ids, labels=ids).loss.backward()
            for gp, p in zip(grad_model.parameters(), model.parameters(), strict=True):
                p.grad = gp.grad.to(p.dtype)
                gp.grad = None
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        ch = tot = 0
        for n, p in model.named_parameters():
            cur = wire(p)
            idx = torch.nonzero(cur != prev[n]).reshape(-1)
            ch += idx.numel()
            tot += cur.numel()
            if step == steps - 1 and idx.numel():
                d = wire_diff(prev[n][idx], cur[idx], 16)
                deltas[n] = (cur.numel(), idx.cpu().numpy().astype(np.int64), d.cpu().numpy())
            prev[n] = cur
        changed_frac.append(ch / tot)
    params = sum(p.numel() for p in model.parameters())
    return deltas, changed_frac, params


def zstd_baseline(deltas, shuffle: bool, level: int = 3) -> int:
    total = 0
    comp = zstandard.ZstdCompressor(level=level)
    for _numel, idx, diff in deltas.values():
        gaps = (np.diff(idx, prepend=-1) - 1).astype("<u4")
        zz = codec.zigzag(diff)
        vals = zz.astype("<u2") if zz.max() < 65536 else zz.astype("<u4")
        g = gaps.view(np.uint8)
        if shuffle:
            g = g.reshape(-1, 4).T.copy().reshape(-1)
        total += len(comp.compress(g.tobytes() + vals.tobytes()))
    return total


def measure(deltas, repeats: int):
    blobs, enc_t, dec_t = {}, [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for n, (numel, idx, diff) in deltas.items():
            blobs[n] = codec.encode(idx, diff, 16, 0, numel)
        enc_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for n, (numel, _idx, _diff) in deltas.items():
            codec.decode(blobs[n], 0, numel, 16)
        dec_t.append(time.perf_counter() - t0)
    for n, (numel, idx, diff) in deltas.items():  # a benchmark of a wrong codec is worthless
        i2, d2 = codec.decode(blobs[n], 0, numel, 16)
        if not (np.array_equal(i2, idx) and np.array_equal(d2, diff)):
            raise SystemExit(f"round trip failed on {n}")
    return blobs, enc_t, dec_t


def measure_threads(deltas, repeats: int) -> dict:
    """One step's tensors encoded as the publisher does (``encode_many``): one thread vs all of them."""
    jobs = [(idx, diff, 16, 0, numel) for numel, idx, diff in deltas.values()]
    changes = sum(len(j[0]) for j in jobs)
    threads = codec.encode_threads()
    out = dict(threads=threads)
    for label, n in (("one_thread", 1), ("all_threads", threads)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            blobs = codec.encode_many(jobs, threads=n)
            times.append(time.perf_counter() - t0)
        out[label] = dict(seconds=stats(times), changes_per_s=stats([changes / t for t in times]))
    if blobs != [codec.encode(*j) for j in jobs]:
        raise SystemExit("encode_many differs from encode")
    out["speedup"] = out["one_thread"]["seconds"]["median"] / out["all_threads"]["seconds"]["median"]
    return out


def measure_gpu(deltas, repeats: int) -> dict:
    """The same step's tensors encoded on the GPU (``codec_gpu.encode_many_gpu``) from changes on the
    device, and the copy that would bring them there from pinned host memory; the bytes must equal
    the host codec's."""
    from rltune.sync.codec_gpu import encode_many_gpu

    host_jobs = [(idx, diff.astype(np.int64), 16, 0, numel) for numel, idx, diff in deltas.values()]
    pinned = [(torch.from_numpy(i).pin_memory(), torch.from_numpy(d).pin_memory()) for i, d, *_ in host_jobs]
    changes = sum(len(j[0]) for j in host_jobs)
    copy_t, times = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        on_device = [(i.to("cuda", non_blocking=True), d.to("cuda", non_blocking=True)) for i, d in pinned]
        torch.cuda.synchronize()
        copy_t.append(time.perf_counter() - t0)
    jobs = [(i, d, *job[2:]) for (i, d), job in zip(on_device, host_jobs, strict=True)]
    encode_many_gpu(jobs)  # first call compiles the kernels
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        blobs = encode_many_gpu(jobs)  # returns host bytes: the GPU work is done when it returns
        times.append(time.perf_counter() - t0)
    if blobs != [codec.encode(*j) for j in host_jobs]:
        raise SystemExit("the GPU encoder's bytes differ from the host codec's")
    return dict(seconds=stats(times), changes_per_s=stats([changes / t for t in times]), h2d_copy_seconds=stats(copy_t),
                bytes_equal=True)


def stats(xs):
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs))


def versions() -> dict:
    out = dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
               zstandard=zstandard.__version__)
    try:
        import numba
        out["numba"] = numba.__version__
    except ImportError:
        pass
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-size", default="40m", choices=sorted(MODEL_SIZES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--masters", default="fp32,bf16")
    ap.add_argument("--quick", action="store_true", help="CI-sized: tiny model, one lr, 2 repeats")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.quick:
        args.model_size, args.batch, args.seq, args.repeats, args.lrs, args.masters = "tiny", 2, 64, 2, "1e-5", "fp32"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()

    codec.decode(codec.encode(np.array([1], np.int64), np.array([1], np.int64), 16, 0, 4), 0, 4)  # compile/load numba
    cases = []
    for master in args.masters.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            deltas, frac, params = real_adamw_delta(args.model_size, args.device, master, lr, args.steps,
                                                    args.batch, args.seq)
            changes = sum(len(d[1]) for d in deltas.values())
            bound = sum(codec.order0_bound_bytes(numel, diff) for numel, _i, diff in deltas.values())
            blobs, enc_t, dec_t = measure(deltas, args.repeats)
            coded = sum(len(b) for b in blobs.values())
            dense = sum(1 for b in blobs.values() if b[0] == codec.MODE_DENSE)
            z_plain, z_shuf = zstd_baseline(deltas, False), zstd_baseline(deltas, True)
            case = dict(master=master, lr=lr, params=params, changed_frac_per_step=frac, changes=changes,
                        tensors_changed=len(deltas), tensors_dense=dense,
                        codec_bytes_per_change=coded / changes, bound_bytes_per_change=bound / changes,
                        ratio_to_bound=coded / bound,
                        zstd_bytes_per_change=z_plain / changes, zstd_shuffled_bytes_per_change=z_shuf / changes,
                        ratio_to_zstd=coded / z_plain, ratio_to_zstd_shuffled=coded / z_shuf,
                        encode_changes_per_s=stats([changes / t for t in enc_t]),
                        decode_changes_per_s=stats([changes / t for t in dec_t]),
                        encode_many=measure_threads(deltas, args.repeats))
            if args.device == "cuda":
                case["encode_gpu"] = measure_gpu(deltas, args.repeats)
                case["encode_gpu"]["speedup_over_all_threads"] = (case["encode_many"]["all_threads"]["seconds"]["median"]
                                                                  / case["encode_gpu"]["seconds"]["median"])
            cases.append(case)
            print(f"{master} lr={lr:g}: {changes} changes ({frac[-1]:.2%}), codec {case['codec_bytes_per_change']:.3f} "
                  f"B/change, bound {case['bound_bytes_per_change']:.3f} (x{case['ratio_to_bound']:.3f}), zstd "
                  f"{case['zstd_bytes_per_change']:.3f} (x{case['ratio_to_zstd']:.3f}), enc "
                  f"{case['encode_changes_per_s']['median'] / 1e6:.1f} M/s, dec "
                  f"{case['decode_changes_per_s']['median'] / 1e6:.1f} M/s; step on {case['encode_many']['threads']} "
                  f"threads x{case['encode_many']['speedup']:.2f}"
                  + (f"; GPU encode {case['encode_gpu']['changes_per_s']['median'] / 1e6:.1f} M/s"
                     if "encode_gpu" in case else ""), file=sys.stderr)
    record = dict(benchmark="sync_codec", config=vars(args), device=args.device, device_name=device_name,
                  versions=versions(), git_sha=git_sha(), time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  cases=cases)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(dict(out=str(out), worst_ratio_to_bound=max(c["ratio_to_bound"] for c in cases))))


if __name__ == "__main__":
    main()
