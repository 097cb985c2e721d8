"""Build rltune/sync/data/rates.yaml, the cost model's inputs, from the committed benchmark records.

Each rate is the min and max of what the records it names measured, with the record's path and git
SHA (its own ``git_sha`` field) beside it, so every figure the model projects from can be traced to a
run, and the machine it was measured on: H200 (its GPU), H200 host, H200 and CPU (bytes, the same on
both), exact, or CPU (no H200 record measures it yet: the 2-core machine's figure stands in, and the
model marks every output that depends on it). The host rates of a GPU trainer and engine come from
``bench/results/sync_estimate_rates-h200-*.json`` (``bench/sync_estimate_rates.py --device cuda``)
once such a record is committed, and from this CPU's records until then.
``tests/sync/test_estimate.py`` rebuilds the file from the records and fails when it differs.

Usage::

    .venv/bin/python bench/build_sync_rates.py            # rewrite rltune/sync/data/rates.yaml
    .venv/bin/python bench/build_sync_rates.py --check    # exit 1 when the file is not current
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RATES_VERSION = 3  # raise with every change of a value (2: the H200 host sweep of git e3265b8 replaces the CPU stand-ins;
# 3: both anchor rates from the H200 host's anchor section, git 992d280)
OUT = ROOT / "rltune" / "sync" / "data" / "rates.yaml"
RESULTS = ROOT / "bench" / "results"
# sync-bench records with the GPU encoder and the receiver staging on the device (git 50e783e onwards)
SYNCBENCH = ["syncbench-h200-50e783e", "syncbench-h200-57febe3", "syncbench-h200-899adf5-auto",
             "syncbench-h200-9e5c8ea", "syncbench-h200-fb1bc9c"]
CPU_RATES = "sync_estimate_rates-cpu-4535e00.json"  # bench/sync_estimate_rates.py, all sections
CPU_ANCHOR = "sync_estimate_rates-cpu-5dddd5e-anchor.json"  # the same, --sections anchor (host read + CRC)
# bench/sync_estimate_rates.py --device cuda: the host rates of a GPU trainer and engine on the H200. While
# no such record exists, those rates come from the CPU records and are marked machine: CPU.
H200_RATES_GLOB = "sync_estimate_rates-h200-*.json"
SMALL_MODEL_TENSORS = 289  # the sync-bench 'small' preset's parameter tensors


def rel(path: str | Path) -> str:
    return str(Path(path).resolve().relative_to(ROOT))


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def short(sha: str | None) -> str:
    return (sha or "unknown")[:7] + ("-dirty" if sha and sha.endswith("-dirty") else "")


def entropy_bits(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def rate(values: list[float], unit: str, machine: str, what: str, sources: list[dict]) -> dict:
    if not values:
        raise SystemExit(f"no values for {what!r}: a record is missing")
    return dict(min=float(min(values)), max=float(max(values)), unit=unit, machine=machine, what=what, sources=sources)


def _host_fits(record: dict) -> dict[str, list[float]]:
    """Host work against the number of tensors, from one sync_estimate_rates record's ``overheads``: per
    storage the line's slope and intercept, and the steepest slope between two neighbouring tensor counts
    (host work per tensor grows faster than linearly on the CPU, so the largest counts' segment bounds an
    extrapolation to a real checkpoint's tensors). The intercept is kept within [0, the smallest count's
    whole call]: the least-squares line is set by the largest counts, and where the sweep bends (the H200's
    16,384-tensor point lies below the line) its intercept exceeds what a whole call at 32 tensors took."""
    fits = record["overheads"]
    out: dict[str, list[float]] = {}
    for key, scale in (("publish_s", 1e3), ("prefetch_s", 1e3), ("apply_s", 1e6)):
        slopes, calls = [], []
        for w in fits:
            slopes.append(fits[w]["fit"][key]["per_tensor_s"] * scale)
            rows = sorted(fits[w]["rows"], key=lambda r: r["tensors"])
            slopes.append(max((b[key]["median"] - a[key]["median"]) / (b["tensors"] - a["tensors"])
                              for a, b in zip(rows, rows[1:], strict=False)) * scale)
            calls.append(min(max(0.0, fits[w]["fit"][key]["per_call_s"]), rows[0][key]["median"]) * 1e3)
        out[key + "_per_tensor"], out[key + "_per_call"] = slopes, calls
    return out


def build() -> dict:
    import pyarrow.parquet as pq

    rates: dict[str, dict] = {}

    # --- trainer: the diff inside the optimizer step (H200)
    fused, staged, srcs = [], [], []
    for f in sorted(glob.glob(str(RESULTS / "sync_kernels_adamw-h200-*.json"))):
        d = load(f)
        fused += [a["extra_ms_per_gib_fused"] for a in d["adamw"]]
        staged += [a["extra_ms_per_gib_staged"] for a in d["adamw"]]
        srcs.append(dict(record=rel(f), git=short(d["git_sha"]), fields="adamw[*].extra_ms_per_gib_fused / _staged "
                         "(1 and 4 GiB; step minus the plain fused AdamW step, per GiB)"))
    rates["diff_fused_ms_per_GiB"] = rate(fused, "ms per GiB of bf16 weights per trainer rank", "H200",
                                          "extra of torch's fused AdamW step with the diff inside each update", srcs)
    rates["diff_staged_ms_per_GiB"] = rate(staged, "ms per GiB of bf16 weights per trainer rank", "H200",
                                           "extra of the step with the diff staged (copy before, two passes after)", srcs)

    # --- trainer: GPU encoder (H200); codec bytes (machine-independent: every record); host decoder (the H200's host)
    enc, ratio, value, decode = [], [], [], []
    enc_src, codec_src, dec_src = [], [], []
    for f in sorted(glob.glob(str(RESULTS / "sync_codec-*.json"))):
        d = load(f)
        on_h200 = d["device"] == "cuda"
        for c in d["cases"]:
            ratio.append(c["ratio_to_bound"])
            p = c["changes"] / c["params"]
            value.append(c["bound_bytes_per_change"] - entropy_bits(p) / (8 * p))
            if on_h200:
                decode += [c["decode_changes_per_s"]["min"] / 1e6, c["decode_changes_per_s"]["max"] / 1e6]
            if "encode_gpu" in c:
                enc += [c["encode_gpu"]["changes_per_s"]["min"] / 1e6, c["encode_gpu"]["changes_per_s"]["max"] / 1e6]
        machine = "H200 host" if on_h200 else "CPU"
        codec_src.append(dict(record=rel(f), git=short(d["git_sha"]),
                              fields=f"cases[*].ratio_to_bound; bound_bytes_per_change - H(p)/(8p) at p = changes/params ({machine})"))
        if on_h200:
            dec_src.append(dict(record=rel(f), git=short(d["git_sha"]),
                                fields="cases[*].decode_changes_per_s min/max (H200 host, one thread)"))
        if any("encode_gpu" in c for c in d["cases"]):
            enc_src.append(dict(record=rel(f), git=short(d["git_sha"]), fields="cases[*].encode_gpu.changes_per_s min/max"))
    rates["encode_gpu_Mchanges_per_s"] = rate(enc, "M changes per s", "H200", "GPU encoder (codec_gpu.encode_many_gpu)",
                                              enc_src)
    rates["codec_over_bound"] = rate(ratio, "ratio", "H200 and CPU",
                                     "codec bytes over the order-0 entropy bound on real AdamW deltas (bytes: the same "
                                     "on any machine)", codec_src)
    rates["value_bytes_per_change"] = rate(value, "bytes per change", "H200 and CPU",
                                           "the bound's value part: the bound minus the position entropy H(p)/p at the "
                                           "step's mean density", codec_src)
    rates["decode_Mchanges_per_s"] = rate(decode, "M changes per s", "H200 host",
                                          "host decoder, one thread (codec.decode: Rice gaps + rANS values)", dec_src)

    # --- the fused apply + verify kernel (H200)
    kernels = sorted(glob.glob(str(RESULTS / "sync_kernels-h200-*.json")))
    slopes, intercepts, k_src = [], [], []
    for f in kernels:
        d = load(f)
        pts = sorted((a["changes"], a["fused_apply_verify"]["median_ms"]) for a in d["apply"] if "fused_apply_verify" in a)
        (c1, t1), (c4, t4) = pts[0], pts[-1]
        slope = (t4 - t1) / (c4 - c1)  # ms per change
        slopes.append(slope * 1e9)  # ps per change
        intercepts.append(t1 - slope * c1)
        k_src.append(dict(record=rel(f), git=short(d["git_sha"]),
                          fields="apply[*].fused_apply_verify.median_ms at 1 % and 4 % of 1 GiB: the line through them"))
    rates["apply_per_call_ms"] = rate(intercepts, "ms per update", "H200", "fused apply + verify kernel: the line's "
                                      "value at zero changes (launch, tables, checksum sums)", k_src)
    rates["apply_ps_per_change"] = rate(slopes, "ps per change", "H200", "fused apply + verify kernel, per change", k_src)

    # --- framing: exact byte counts (the CPU record; bytes do not depend on the machine)
    cpu = RESULTS / CPU_RATES
    c = load(cpu)
    cpu_src = lambda what: dict(record=rel(cpu), git=short(c["git_sha"]), fields=what)  # noqa: E731
    framing = c["framing"]["one_change_stream_bytes"] + c["framing"]["entry_json_bytes"]
    rates["entry_framing_bytes"] = rate([framing], "bytes per entry", "exact",
                                        "one delta entry beyond its changes: codec stream header, block table and block "
                                        "header of a 1-change stream, and its JSON in the part header",
                                        [cpu_src("framing.one_change_stream_bytes + framing.entry_json_bytes")])

    # --- host work per tensor and per entry, and the anchor path: the H200's own sweep when it exists
    h200 = [Path(f) for f in sorted(glob.glob(str(RESULTS / H200_RATES_GLOB)))]
    h200 = [f for f in h200 if load(f)["device"] == "cuda" and not load(f)["quick"]]
    # a run cut short keeps the sections it finished: each family of rates takes the H200 where it was measured
    h200_anchor = [f for f in h200 if "anchor" in load(f)]
    h200 = [f for f in h200 if "overheads" in load(f)]
    if h200:
        fits = {k: [] for k in ("publish_s_per_tensor", "publish_s_per_call", "prefetch_s_per_tensor",
                                "apply_s_per_tensor", "apply_s_per_call")}
        h_src = []
        for f in h200:
            d = load(f)
            for k, v in _host_fits(d).items():
                if k in fits:
                    fits[k] += v
            h_src.append(dict(record=rel(f), git=short(d["git_sha"]), fields="overheads.{shm,disk}: the line over the "
                              "tensors (publish_s, prefetch_s, apply_s) and its steepest segment; per call its "
                              "intercept, within [0, the smallest count's median call] (H200 host, 64 elements a "
                              "tensor, change buffers for every element: change_capacity=1.0)"))
        host_machine, pub_t, pub_c, pre_t, app_t, app_c = ("H200 host", fits["publish_s_per_tensor"],
                                                           fits["publish_s_per_call"], fits["prefetch_s_per_tensor"],
                                                           fits["apply_s_per_tensor"], fits["apply_s_per_call"])
        pub_src = pre_src = app_src = h_src
    else:
        # the CPU's sweep, with the H200's 289-tensor sync-bench runs beside it: there the host work left after the
        # encoder and the write (publish) and after the fused kernel (update) is all put on the tensors, since one
        # tensor count cannot split it into per call and per tensor
        f = _host_fits(c)
        enc_mid = math.sqrt(rates["encode_gpu_Mchanges_per_s"]["min"] * rates["encode_gpu_Mchanges_per_s"]["max"]) * 1e6

        def kernel_ms(ch: float) -> float:  # the fused kernel at the records' mean line
            return sum(intercepts) / len(intercepts) + ch * (sum(slopes) / len(slopes)) / 1e9

        pub_h200, upd_h200, sb_src = [], [], []
        for name in SYNCBENCH:
            rec = load(RESULTS / name / "sync-bench.json")
            rows = [r for r in pq.read_table(RESULTS / name / "sync-bench.parquet").to_pylist() if not r["warmup"]]
            # the machine's write rate from the same run: the filesystem transport's checkpoint bytes / publish
            fs = sorted(r["bytes"] / r["publish_s"] for r in rows if r["transport"] == "filesystem")
            write_rate = fs[len(fs) // 2]
            for r in rows:
                if r["transport"] != "sparse" or r.get("anchor") == 1.0 or not r.get("changes"):
                    continue
                residual = r["publish_s"] - r["changes"] / enc_mid - r["bytes"] / write_rate
                pub_h200.append(residual / SMALL_MODEL_TENSORS * 1e3)
                upd_h200.append((r["dispatch_blocking_s"] * 1e3 - kernel_ms(r["changes"])) / SMALL_MODEL_TENSORS * 1e3)
            sb_src.append(dict(record=rel(RESULTS / name / "sync-bench.parquet"), git=short(rec["git_sha"]),
                               fields=f"H200 host at {SMALL_MODEL_TENSORS} tensors, sparse rows after warm-up: (publish_s - "
                                      "changes/encode - bytes/write rate of the run's filesystem rows) / "
                                      f"{SMALL_MODEL_TENSORS}; (dispatch_blocking_s - fused kernel) / {SMALL_MODEL_TENSORS}"))
        host_machine = "CPU"
        pub_t, pub_c = f["publish_s_per_tensor"] + pub_h200, [0.0] + f["publish_s_per_call"]
        pre_t = f["prefetch_s_per_tensor"]
        app_t, app_c = f["apply_s_per_tensor"] + upd_h200, [0.0] + f["apply_s_per_call"]
        line = "overheads.{shm,disk}: %s per tensor, the line over T and its steepest segment (CPU)"
        pub_src = [cpu_src(line % "publish_s"), *sb_src]
        pre_src = [cpu_src(line % "prefetch_s")]
        app_src = [cpu_src(line % "apply_s"), *sb_src]
    rates["publish_per_call_ms"] = rate(pub_c, "ms per publish", host_machine,
                                        "publish()'s host work that does not grow with the tensors" +
                                        (" (at most a whole 32-tensor publish)" if h200 else " (0 in the range: the H200's 289-tensor runs put all of "
                                                         "it on the tensors)"), pub_src[:1])
    rates["publish_per_tensor_ms"] = rate(pub_t, "ms per tensor per rank", host_machine,
                                          "publish()'s host work per tensor (live-weight checksum, entry, framing)", pub_src)
    rates["prefetch_per_entry_ms"] = rate(pre_t, "ms per entry decoded", host_machine,
                                          "prefetch's host work per delta entry (read, CRC, decode set-up, locate, stage)",
                                          pre_src)
    rates["update_host_per_call_ms"] = rate(app_c, "ms per update", host_machine,
                                            "the update's host work that does not grow with the tensors" +
                                            (" (at most a whole 32-tensor update)" if h200 else " (0 in the range, as for publish_per_call_ms)"),
                                            app_src[:1])
    rates["update_host_per_tensor_us"] = rate(app_t, "us per tensor held", host_machine,
                                              "the update's host work per tensor (plan, checks, verify loop)", app_src)

    # --- anchors: write per trainer rank and a fresh engine worker's load
    if h200_anchor:
        w_vals, l_vals, a_src = [], [], []
        for f in h200_anchor:
            d = load(f)
            for w in d["anchor"]:
                w_vals += [d["anchor"][w]["anchor_write_GBps"][k] for k in ("min", "max")]
                l_vals += [d["anchor"][w]["anchor_load_GBps"][k] for k in ("min", "max")]
            a_src.append(dict(record=rel(f), git=short(d["git_sha"]),
                              fields="anchor.{shm,disk}.anchor_write_GBps and .anchor_load_GBps min/max (1 GiB anchor)"))
        rates["anchor_write_GBps"] = rate(w_vals, "GB/s per trainer rank", "H200 host",
                                          "the anchor path of publish() on a GPU trainer (checksums on the GPU, copy to "
                                          "the host, CRC-32 per 1 MiB block, framing, write, fsync)", a_src)
        rates["anchor_load_GBps"] = rate(l_vals, "GB/s per engine worker", "H200 host",
                                         "a fresh GPU engine's load_latest: read its rows (CRC-32 per block), copy them "
                                         "into its parameters, verify on the device", a_src)
    else:
        old = load(RESULTS / "syncbench-h200-1683123" / "sync-bench.json")
        extra = old["transports"]["sparse"]["anchor_extra_publish_s"]
        rates["anchor_write_GBps"] = rate([old["model"]["param_bytes"] / extra / 1e9], "GB/s per trainer rank",
                                          "H200 host",
                                          "the anchor path of publish() on a GPU trainer (checksums on the GPU, copy to "
                                          "the host, CRC-32 per 1 MiB block, framing, write, fsync to the machine's disk)",
                                          [dict(record=rel(RESULTS / "syncbench-h200-1683123" / "sync-bench.json"),
                                                git=short(old["git_sha"]),
                                                fields="model.param_bytes / transports.sparse.anchor_extra_publish_s "
                                                       "(code of commit 1683123; the record's git_sha field is stale, "
                                                       "docs/BENCHMARKS.md)")])
        anchor = RESULTS / CPU_ANCHOR
        a = load(anchor)
        anchor_l = [a["anchor"][w]["anchor_read_crc_GBps"][k] for w in a["anchor"] for k in ("min", "max")]
        rates["anchor_load_GBps"] = rate(anchor_l, "GB/s per engine worker", "CPU",
                                         "a GPU engine's host work to load an anchor: read every block of its rows and "
                                         "check its CRC-32 (the copy to the device and the checksums on it are not in it)",
                                         [dict(record=rel(anchor), git=short(a["git_sha"]),
                                               fields="anchor.{shm,disk}.anchor_read_crc_GBps min/max")])
    order = ["diff_fused_ms_per_GiB", "diff_staged_ms_per_GiB", "encode_gpu_Mchanges_per_s", "codec_over_bound",
             "value_bytes_per_change", "entry_framing_bytes", "publish_per_call_ms", "publish_per_tensor_ms",
             "decode_Mchanges_per_s", "prefetch_per_entry_ms", "apply_per_call_ms", "apply_ps_per_change",
             "update_host_per_call_ms", "update_host_per_tensor_us", "anchor_write_GBps", "anchor_load_GBps"]
    return dict(schema_version=1, rates_version=RATES_VERSION, built_by="bench/build_sync_rates.py",
                rates={k: rates[k] for k in order})


def render(data: dict) -> str:
    import yaml

    head = ("# The sparse delta sync cost model's input rates (rltune.sync.estimate). Generated by\n"
            "# bench/build_sync_rates.py from the records named under each rate; do not edit by hand.\n")
    class NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data):  # each rate lists its sources in full
            return True

    return head + yaml.dump(data, Dumper=NoAliases, sort_keys=False, width=110, allow_unicode=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when rates.yaml differs from what the records give")
    args = ap.parse_args()
    text = render(build())
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("rates.yaml is current" if same else "rates.yaml differs from the records: run bench/build_sync_rates.py")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {rel(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
