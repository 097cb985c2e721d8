"""Benchmark of the weight-sync kernels against torch baselines measured in the same run.

Sections (each reports min/median/max ms, GB/s and the ratio to its baseline):

- apply:     fused multi-tensor apply (+ verify: per-entry running checksums compared on the host)
             of 1 % and 4 % changes into 1 GiB of bf16 vs a plain ``index_put_`` scatter of the same changes;
- diff:      diff/extract of 1 GiB of bf16 in 64 M-element chunks vs ``torch.nonzero(a != b)``;
- checksum:  full checksum of 1 GiB vs a device copy of it (copy bandwidth counts read + write);
- verify2:   the second checksum (checksum2, hash-weighted, two lanes mod 2^31 - 1): fused apply + verify of
             both checksums (what every engine update now runs) vs the position-weighted checksum alone vs
             a plain ``index_put_`` scatter of the same changes measured in the same run, at 1 % and 4 %
             changes into 1 and 4 GiB of bf16 (``--verify2-gib``; target: apply + verify <= 1.5x the
             scatter at 1 %); the full checksum2 of the same weights (anchor loads, the trainer's live
             check) vs the full checksum and a copy; every result checked against the torch references;
- step:      AdamW (fused) on ~0.5 B bf16 parameters: chunked step with the delta recorder vs a plain step;
- adamw:     AdamW (fused) on 1 and 4 GiB of bf16 in 64 M-element parameters, changes in device memory:
             the plain step vs the chunked step with the diff staged around each update (a copy before,
             both passes after) and with its pass 1 fused into the update; all three must stay bit-identical;
- tune:      (GPU, runs first when asked for) launch configurations of checksum, diff and apply; the
             other sections then run with the fastest, recorded as ``launch_config``.

Usage (GPU; one command, no input, fails loudly)::

    python bench/sync_kernels.py --out bench/results/sync_kernels_h200.json
    python bench/sync_kernels.py --sections tune,verify2 --verify2-gib 1,4 --out bench/results/sync_kernels_verify2-h200.json
    python bench/sync_kernels.py --device cpu --tiny --out /tmp/sync_kernels_cpu.json   # smoke check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltune.sync import kernels as K  # noqa: E402
from rltune.sync.chunked import DeltaRecorder, chunked_step  # noqa: E402
from rltune.sync.kernels.reference import MASK64, P31, as_bits  # noqa: E402

GIB = 1 << 30


class Timer:
    """CUDA-event timing on a GPU, perf_counter on the CPU; warm-up, then ``repeats`` timed runs."""

    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return dict(min_ms=min(times), median_ms=statistics.median(times), max_ms=max(times), repeats=len(times))


def with_rate(stats: dict, nbytes: int) -> dict:
    return dict(stats, bytes=nbytes, GBps=nbytes / (stats["median_ms"] * 1e-3) / 1e9)


def random_changes(numels: list[int], fraction: float, device: torch.device, seed: int):
    """Unique sorted indices per tensor (entry), their global flat index and new bf16 bits."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx_parts, global_parts, offsets, base = [], [], [0], 0
    for n in numels:
        k = int(n * fraction)
        idx = torch.randperm(n, generator=g, device=device)[:k].sort().values
        idx_parts.append(idx)
        global_parts.append(idx + base)
        offsets.append(offsets[-1] + k)
        base += n
    idx = torch.cat(idx_parts)
    vals = torch.randint(-(1 << 15), 1 << 15, (idx.numel(),), generator=g, device=device, dtype=torch.int16)
    return idx, torch.cat(global_parts), torch.tensor(offsets, device=device), vals


def apply_setup(dev, total: int, tensors: int):
    """``tensors`` equal bf16 parameters of ``total`` elements in one flat buffer, and the apply plan of them:
    (elements per tensor, the flat buffer, the parameters' bits, the plan, each entry's tensor)."""
    per = total // tensors
    flat = torch.randn(per * tensors, device=dev).to(torch.bfloat16)
    params = list(as_bits(flat).view(tensors, per).unbind(0))
    plan = K.ApplyPlan(params, [K.strided_layout(t, [per]) for t in range(tensors)])
    return per, flat, params, plan, torch.arange(tensors, device=dev)


def bench_apply(dev, timer, total, tensors, fractions) -> list[dict]:
    per, flat, params, plan, entry_tensor = apply_setup(dev, total, tensors)
    flat_bits = as_bits(flat)
    out = []
    for fraction in fractions:
        idx, gidx, offsets, vals = random_changes([per] * tensors, fraction, dev, seed=int(fraction * 1e4))
        val32 = vals.to(torch.int32)
        scatter = timer(lambda gidx=gidx, vals=vals: flat_bits.index_put_((gidx,), vals))
        fused = timer(lambda idx=idx, val32=val32, offsets=offsets: plan.apply(entry_tensor, offsets, idx, val32,
                                                                              add=False))
        # verify = running checksums (kept per tensor, moved by each apply) against the trainer's checksums;
        # after one application the patched state is fixed, so its full checksums are what the trainer sends
        plan.apply(entry_tensor, offsets, idx, val32, add=False)
        trainer = [K.checksum(p) for p in params]

        # what the engine does (DeltaReceiver._apply_fused): one copy and one host sync bring the
        # per-entry checksum changes and counts, which move the running checksums it compares with
        # the trainer's

        running = np.array(trainer, dtype=np.uint64)  # uint64 arithmetic wraps mod 2**64, as checksums do
        expected = np.array(trainer, dtype=np.uint64)

        def apply_verify(idx=idx, val32=val32, offsets=offsets, running=running, expected=expected):
            sums = plan.apply(entry_tensor, offsets, idx, val32, add=False).to_numpy()
            if not np.array_equal(running + sums[0].view(np.uint64), expected) or int(sums[1].sum()) != idx.numel():
                raise RuntimeError("running checksums after apply differ from the trainer's")

        fused_verify = timer(apply_verify)
        # exactness at this size: the fused kernel and index_put leave the same bits
        ref = flat_bits.clone()
        ref.index_put_((gidx,), vals)
        plan.apply(entry_tensor, offsets, idx, val32, add=False)
        if not torch.equal(ref, flat_bits):
            raise RuntimeError("fused apply differs from index_put at benchmark size")
        changes = idx.numel()
        moved = changes * (8 + 2 + 2)
        out.append(dict(fraction=fraction, changes=changes, tensors=tensors, bytes_param=total * 2,
                        index_put=with_rate(scatter, moved), fused_apply=with_rate(fused, moved),
                        fused_apply_verify=with_rate(fused_verify, moved),
                        ratio_apply=fused["median_ms"] / scatter["median_ms"],
                        ratio_apply_verify=fused_verify["median_ms"] / scatter["median_ms"]))
    return out


def bench_verify2(dev, timer, total, tensors, fractions) -> dict:
    """The engine update with both checksums against the position-weighted one alone and the scatter.

    Each arm is one fused apply (new bits written in place, as the ``apply`` section) followed by what
    ``DeltaReceiver._apply_fused`` does with its result: one host sync, the running checksums of every
    entry moved by its changes and compared with the trainer's. After the first application the state
    is fixed, so the trainer's checksums (computed once, in full) are what every later one must match.
    """
    from rltune.sync.kernels import reference as R

    per, flat, params, plan, entry_tensor = apply_setup(dev, total, tensors)
    flat_bits = as_bits(flat)
    rows = []
    for fraction in fractions:
        idx, gidx, offsets, vals = random_changes([per] * tensors, fraction, dev, seed=int(fraction * 1e4) + 1)
        val32 = vals.to(torch.int32)
        scatter = timer(lambda gidx=gidx, vals=vals: flat_bits.index_put_((gidx,), vals))
        first = plan.apply(entry_tensor, offsets, idx, val32, add=False, mix=True)
        first.to_numpy()
        c1 = np.array([K.checksum(p) for p in params], dtype=np.uint64)
        c2 = np.array([R.checksum2_lanes(K.checksum2(p)) for p in params], dtype=np.int64)  # [E, 2]

        def verify_c1(idx=idx, val32=val32, offsets=offsets, c1=c1):
            sums = plan.apply(entry_tensor, offsets, idx, val32, add=False).to_numpy()
            if not np.array_equal(c1 + sums[0].view(np.uint64), c1) or int(sums[1].sum()) != idx.numel():
                raise RuntimeError("running checksums after apply differ from the trainer's")

        def verify_both(idx=idx, val32=val32, offsets=offsets, c1=c1, c2=c2):
            sums = plan.apply(entry_tensor, offsets, idx, val32, add=False, mix=True).to_numpy()
            if not np.array_equal(c1 + sums[0].view(np.uint64), c1) or int(sums[1].sum()) != idx.numel() \
                    or not np.array_equal((c2[:, 0] + sums[2]) % P31, c2[:, 0]) \
                    or not np.array_equal((c2[:, 1] + sums[3]) % P31, c2[:, 1]):
                raise RuntimeError("running checksum2 after apply differs from the trainer's")

        only_c1 = timer(verify_c1)
        both = timer(verify_both)
        # exactness at this size: from a fresh copy, the kernel's checksum2 changes equal the reference's
        # and the full checksum2 after it equals the running one
        ref = [p.clone() for p in params]
        got = K.ApplyPlan(ref, [K.strided_layout(t, [per]) for t in range(tensors)]).apply(
            entry_tensor, offsets, idx, val32 + 1, add=True, mix=True)
        want = R.apply_deltas_ref([p.clone() for p in params], [K.strided_layout(t, [per]) for t in range(tensors)],
                                  entry_tensor, offsets, idx, val32 + 1, True, mix=True)
        if got.checksums2() != want[2] or got.checksums() != want[0]:
            raise RuntimeError("fused apply's checksum2 changes differ from apply_deltas_ref at benchmark size")
        for t in (0, tensors - 1):
            running = R.checksum2_add(K.checksum2(params[t]), want[2][t])
            if running != K.checksum2(ref[t]):
                raise RuntimeError("running checksum2 differs from a full recompute at benchmark size")
        moved = idx.numel() * (8 + 2 + 2)
        rows.append(dict(fraction=fraction, changes=idx.numel(), tensors=tensors, bytes_param=total * 2,
                         index_put=with_rate(scatter, moved), apply_verify_checksum=with_rate(only_c1, moved),
                         apply_verify_both=with_rate(both, moved),
                         ratio_checksum=only_c1["median_ms"] / scatter["median_ms"],
                         ratio_both=both["median_ms"] / scatter["median_ms"],
                         checksum2_cost_ms=both["median_ms"] - only_c1["median_ms"], exact=True))
    src = flat
    dst = torch.empty_like(src)
    copy = with_rate(timer(lambda: dst.copy_(src)), total * 4)
    full1 = with_rate(timer(lambda: K.checksum(flat_bits)), total * 2)
    full2 = with_rate(timer(lambda: K.checksum2(flat_bits)), total * 2)
    sample = flat_bits[: 1 << 24]
    if K.checksum2(sample, offset=12345) != R.checksum2_ref(sample, 12345):
        raise RuntimeError("checksum2 kernel differs from checksum2_ref at benchmark size")
    return dict(apply=rows, full=dict(elements=total, copy=copy, checksum=full1, checksum2=full2,
                                      checksum2_vs_checksum=full2["median_ms"] / full1["median_ms"],
                                      checksum2_fraction_of_copy_bandwidth=full2["GBps"] / copy["GBps"]),
                target="apply + verify of both checksums <= 1.5x the scatter",
                met=all(r["ratio_both"] <= 1.5 for r in rows if r["fraction"] == 0.01))


def bench_diff(dev, timer, total, chunk, fractions) -> list[dict]:
    from rltune.sync.kernels import triton_kernels as tk

    old = as_bits(torch.randn(total, device=dev).to(torch.bfloat16))
    out = []
    for fraction in fractions:
        g = torch.Generator(device=dev).manual_seed(7)
        new = old.clone()
        changed = torch.rand(total, generator=g, device=dev) < fraction
        new[changed] ^= 1
        baseline = timer(lambda new=new: torch.nonzero(old != new))
        row = dict(fraction=fraction, elements=total, chunk=chunk, nonzero=with_rate(baseline, total * 4))
        if dev.type == "cuda":
            n = min(chunk, total)
            chunks = -(-total // n)
            scratch = tk.DiffScratch(n, dev, chunks)
            cap = int(total * fraction * 1.2) + 1024
            outs = (torch.empty(cap, dtype=torch.int64, device=dev), torch.empty(cap, dtype=torch.int32, device=dev),
                    torch.empty(cap, dtype=torch.int32, device=dev))
            starts = torch.zeros(chunks + 1, dtype=torch.int64, device=dev)
            sums = torch.zeros(chunks, dtype=torch.int64, device=dev)

            def to_device(new=new, scratch=scratch, outs=outs, starts=starts, sums=sums, cap=cap, n=n):
                sums.zero_()  # the chunks' checksum changes and block counts are added (a step's sink does the same)
                scratch.reset()
                for k, a in enumerate(range(0, total, n)):
                    tk.diff_extract_launch(old[a:a + n], new[a:a + n], a, 0xFFFF, scratch, starts, k, outs, cap, sums)

            row["diff_extract_device"] = with_rate(timer(to_device), total * 4)
            to_device()
            if int(starts[-1]) != int(changed.sum()):
                raise RuntimeError(f"diff/extract found {int(starts[-1])} changes, expected {int(changed.sum())}")
            # exactness at this size: positions, values and checksum change equal the torch reference's
            from rltune.sync.kernels.reference import diff_extract_ref

            want = diff_extract_ref(old, new, 0)
            count = int(starts[-1])
            got = (outs[0][:count], outs[1][:count], outs[2][:count])
            if not all(torch.equal(g, w) for g, w in zip(got, want[:3], strict=True)) \
                    or int(sums.sum()) & MASK64 != want[3]:
                raise RuntimeError("diff/extract differs from diff_extract_ref at benchmark size")
        sink = K.ChangeSink(int(total * fraction * 1.2) + 1024, min(chunk, total), -(-total // chunk), dev)

        def to_sink(new=new, sink=sink):
            sink.reset()
            for a in range(0, total, chunk):
                sink.append(old[a:a + chunk], new[a:a + chunk], a, a)
            sink.finish()
            sink.collect()

        row["diff_extract_pinned"] = with_rate(timer(to_sink), total * 4)
        per_gib = GIB / (total * 2)
        key = "diff_extract_device" if "diff_extract_device" in row else "diff_extract_pinned"
        row["ms_per_GiB"] = row[key]["median_ms"] * per_gib
        row["ratio_vs_nonzero"] = row[key]["median_ms"] / baseline["median_ms"]
        out.append(row)
    return out


def bench_checksum(dev, timer, total) -> dict:
    src = torch.randn(total, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy = with_rate(timer(lambda: dst.copy_(src)), total * 4)
    bits = as_bits(src)
    got = timer(lambda: K.checksum(bits))
    chk = with_rate(got, total * 2)
    from rltune.sync.kernels.reference import checksum_ref

    exact = K.checksum(bits) == checksum_ref(bits) & MASK64
    if not exact:
        raise RuntimeError("checksum kernel differs from checksum_ref at benchmark size")
    return dict(elements=total, copy=copy, checksum=chk, fraction_of_copy_bandwidth=chk["GBps"] / copy["GBps"],
                exact=exact)


def bench_step(dev, timer, total, tensors, chunk) -> dict:
    per = total // tensors
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(per, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    fused = dev.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-6, fused=fused)  # lr of the probe's 0.65-1.6 % bf16 steps
    plain = timer(opt.step)
    no_hook = timer(lambda: chunked_step(opt, None, chunk))
    rec = DeltaRecorder([(f"w{i}", p) for i, p in enumerate(params)], chunk, capacity_fraction=0.25)
    fractions = []

    def recorded():
        chunked_step(opt, rec, chunk)
        fractions.append(sum(c.idx_C.numel() for c in rec.collect().values()) / total)

    with_rec = timer(recorded)
    return dict(params=total, tensors=tensors, chunk=chunk, fused_adamw=fused, plain_step=plain,
                chunked_step=no_hook, chunked_step_with_recorder=with_rec,
                extra_ms=with_rec["median_ms"] - plain["median_ms"], ratio=with_rec["median_ms"] / plain["median_ms"],
                changed_fraction=statistics.median(fractions))


def bench_adamw(dev, timer, total, tensors, chunk) -> dict:
    per = total // tensors
    gen = torch.Generator(device=dev).manual_seed(1)
    grads = [(torch.randn(per, device=dev, generator=gen) * 1e-3).to(torch.bfloat16) for _ in range(tensors)]
    arms = {}
    for name in ("plain", "staged", "fused"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter((torch.randn(per, device=dev) * 0.02).to(torch.bfloat16)) for _ in range(tensors)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g  # read only by the step: shared by the arms
        opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01, fused=dev.type == "cuda" or None)
        rec = None if name == "plain" else DeltaRecorder(
            [(f"w{i}", p) for i, p in enumerate(params)], chunk, capacity_fraction=0.25, outputs="device",
            fuse_adamw="auto" if name == "fused" else False)
        arms[name] = (params, opt, rec)
    fractions: dict[str, list[float]] = {"staged": [], "fused": []}

    def step(name):
        _, opt, rec = arms[name]
        if rec is None:
            opt.step()
            return
        chunked_step(opt, rec, chunk)
        fractions[name].append(sum(c.idx_C.numel() for c in rec.collect().values()) / total)

    timed = {name: timer(lambda name=name: step(name)) for name in arms}
    ref_params, ref_opt, _ = arms["plain"]
    identical = all(torch.equal(as_bits(p.detach()), as_bits(q.detach())) and
                    torch.equal(ref_opt.state[p]["exp_avg"], arms[name][1].state[q]["exp_avg"])
                    for name in ("staged", "fused") for p, q in zip(ref_params, arms[name][0], strict=True))
    if not identical:
        raise RuntimeError("a chunked AdamW step left the plain step's weights or moments")
    gib = total * 2 / GIB
    plain = timed["plain"]["median_ms"]
    return dict(params=total, tensors=tensors, chunk=chunk, fused_adamw=dev.type == "cuda",
                fused_kernel=bool(arms["fused"][2].sink.fuse_adamw), plain_step=timed["plain"],
                staged_step=timed["staged"], fused_step=timed["fused"],
                extra_ms_per_gib_staged=(timed["staged"]["median_ms"] - plain) / gib,
                extra_ms_per_gib_fused=(timed["fused"]["median_ms"] - plain) / gib,
                changed_fraction={k: statistics.median(v) for k, v in fractions.items()}, identical=identical)


CHECKSUM_CONFIGS = ((512, 16, 4), (1024, 8, 4), (1024, 4, 4), (2048, 4, 8), (1024, 16, 8), (2048, 8, 8),
                    (512, 32, 4), (4096, 4, 8))
# diff: (32-element rows per block, warps of both passes, changes per copy iteration of pass 2)
DIFF_CONFIGS = ((128, 4, 64), (256, 4, 64), (256, 2, 64), (256, 4, 128), (256, 8, 128), (512, 4, 64), (512, 4, 128))
APPLY_CONFIGS = ((1024, 4), (512, 4), (1024, 8), (2048, 8), (4096, 8), (256, 2))


def bench_tune(dev, timer, total, tensors) -> dict:
    """Launch configurations of the checksum, diff and apply kernels, each timed on the same data.

    Returns every timing and the fastest configuration of each kernel, which the other sections
    then run with (recorded as ``launch_config``).
    """
    from rltune.sync.kernels import triton_kernels as tk

    bits = as_bits(torch.randn(total, device=dev).to(torch.bfloat16))
    new = bits.clone()
    new[::97] ^= 1
    out = dict(checksum={}, diff={}, apply={})
    for block, tiles, warps in CHECKSUM_CONFIGS:
        tk.CHECKSUM_BLOCK, tk.CHECKSUM_TILES, tk.CHECKSUM_WARPS = block, tiles, warps
        out["checksum"][f"{block}x{tiles}w{warps}"] = timer(lambda: K.checksum(bits))["median_ms"]
    chunk = min(total, 1 << 26)
    cap = total // 50
    outs = (torch.empty(cap, dtype=torch.int64, device=dev), torch.empty(cap, dtype=torch.int32, device=dev),
            torch.empty(cap, dtype=torch.int32, device=dev))
    starts = torch.zeros(-(-total // chunk) + 1, dtype=torch.int64, device=dev)
    sums = torch.zeros(-(-total // chunk), dtype=torch.int64, device=dev)
    for rows, warps, copy in DIFF_CONFIGS:
        tk.DIFF_ROWS, tk.DIFF_WARPS, tk.DIFF_COPY = rows, warps, copy
        programs = tk.diff_programs(chunk)
        scratch = tk.DiffScratch(chunk, dev, -(-total // chunk))

        def both(scratch=scratch):
            sums.zero_()
            scratch.reset()
            for k, a in enumerate(range(0, total, chunk)):
                tk.diff_extract_launch(bits[a:a + chunk], new[a:a + chunk], a, 0xFFFF, scratch, starts, k, outs, cap,
                                       sums)

        def mask_only(scratch=scratch, programs=programs):
            for a in range(0, total, chunk):
                tk._diff_mask_kernel[(programs,)](bits[a:a + chunk], new[a:a + chunk], chunk, scratch.words,
                                                  scratch.count_P, scratch.tile_KT[0], scratch.count_P,
                                                  scratch.count_P, ROWS=tk.DIFF_ROWS, TILE=tk.DIFF_TILE, ASM=True,
                                                  GROUPED=False, num_warps=tk.DIFF_WARPS)  # no group: tables unread

        out["diff"][f"{rows}w{warps}c{copy}"] = dict(both_ms=timer(both)["median_ms"],
                                                     mask_only_ms=timer(mask_only)["median_ms"])
    per = total // tensors
    params = list(bits.view(tensors, per).unbind(0))
    plan = K.ApplyPlan(params, [K.strided_layout(t, [per]) for t in range(tensors)])
    idx, _, offsets, vals = random_changes([per] * tensors, 0.01, dev, seed=5)
    val32, entry_tensor = vals.to(torch.int32), torch.arange(tensors, device=dev)
    for block, warps in APPLY_CONFIGS:
        tk.APPLY_BLOCK, tk.APPLY_WARPS = block, warps
        out["apply"][f"{block}w{warps}"] = timer(
            lambda: plan.apply(entry_tensor, offsets, idx, val32, add=False))["median_ms"]
    best = {k: min(v, key=lambda c: v[c]["both_ms"] if k == "diff" else v[c]) for k, v in out.items()}
    out["best"] = best
    return out


def set_launch_config(best: dict) -> dict:
    """Set the kernels' launch constants to the tuned ones; returns the configuration in force."""
    import re

    from rltune.sync.kernels import triton_kernels as tk

    if "checksum" in best:
        tk.CHECKSUM_BLOCK, tk.CHECKSUM_TILES, tk.CHECKSUM_WARPS = map(int, re.findall(r"\d+", best["checksum"]))
    if "diff" in best:
        tk.DIFF_ROWS, tk.DIFF_WARPS, tk.DIFF_COPY = map(int, re.findall(r"\d+", best["diff"]))
    if "apply" in best:
        tk.APPLY_BLOCK, tk.APPLY_WARPS = map(int, re.findall(r"\d+", best["apply"]))
    return dict(checksum=[tk.CHECKSUM_BLOCK, tk.CHECKSUM_TILES, tk.CHECKSUM_WARPS], diff=[tk.DIFF_ROWS, tk.DIFF_WARPS, tk.DIFF_COPY],
                apply=[tk.APPLY_BLOCK, tk.APPLY_WARPS])


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small sizes and few repeats (smoke check)")
    ap.add_argument("--out", required=True, type=Path, help="JSON record to write")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--git-sha", default=None, help="commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--sections", default="apply,verify2,diff,checksum,step,adamw")
    ap.add_argument("--adamw-gib", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4],
                    help="sizes of the adamw section, in GiB of bf16 parameters")
    ap.add_argument("--verify2-gib", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4],
                    help="sizes of the verify2 section, in GiB of bf16 weights")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --device cpu --tiny for the smoke check")
    total = (1 << 20) if args.tiny else GIB // 2  # bf16 elements: 1 GiB at full size
    repeats = args.repeats or (3 if args.tiny else 20)
    timer = Timer(dev, warmup=1 if args.tiny else 3, repeats=repeats)
    sections = set(args.sections.split(","))
    import triton

    record = dict(benchmark="sync_kernels", device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                  platform.processor() or "cpu", torch=torch.__version__, triton=triton.__version__,
                  git_sha=args.git_sha or git_sha(), tiny=args.tiny, repeats=repeats, bf16_elements=total,
                  time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    chunk = (1 << 16) if args.tiny else (1 << 26)
    if "tune" in sections and dev.type == "cuda":
        # first, so every other section runs with the fastest launch configuration measured here
        record["tune"] = bench_tune(dev, timer, total, 64)
        record["launch_config"] = set_launch_config(record["tune"]["best"])
    else:
        record["launch_config"] = set_launch_config({})
    if "apply" in sections:
        record["apply"] = bench_apply(dev, timer, total, 8 if args.tiny else 64, [0.01, 0.04])
    if "verify2" in sections:
        # one row per size: the scatter baseline is measured again at each, on the same changes
        record["verify2"] = [dict(gib=total * gib * 2 / GIB, **bench_verify2(dev, timer, total * gib, 8 if args.tiny else 64 * gib,
                                                           [0.01, 0.04]))
                             for gib in args.verify2_gib]
        record["verify2_met"] = all(v["met"] for v in record["verify2"])
    if "diff" in sections:
        record["diff"] = bench_diff(dev, timer, total, chunk, [0.01, 0.04])
    if "checksum" in sections:
        record["checksum"] = bench_checksum(dev, timer, total)
    if "step" in sections:
        record["step"] = bench_step(dev, timer, total, 4 if args.tiny else 16, chunk)
    if "adamw" in sections:
        # at 1 GiB like the other sections, and larger: the step's fixed host latency spreads over more GiB
        record["adamw"] = [bench_adamw(dev, timer, total * gib, 2 * gib if args.tiny else 8 * gib, chunk)
                           for gib in args.adamw_gib]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    for v in record.get("verify2", []):
        for r in v["apply"]:
            print(f"verify2 {v['gib']:g} GiB, {r['fraction']:.0%} changes: scatter {r['index_put']['median_ms']:.3f} ms, "
                  f"apply+verify both {r['apply_verify_both']['median_ms']:.3f} ms (x{r['ratio_both']:.2f}), "
                  f"position-weighted only x{r['ratio_checksum']:.2f}", file=sys.stderr)
        print(f"verify2 {v['gib']:g} GiB: full checksum2 {v['full']['checksum2']['GBps']:.0f} GB/s, "
              f"{v['full']['checksum2_fraction_of_copy_bandwidth']:.0%} of copy; target met: {v['met']}", file=sys.stderr)


if __name__ == "__main__":
    main()
