"""Host-side rates of the delta sync that the cost model needs and no other record measures (CPU or H200).

What it measures, each with its own baseline in the same run:

- ``framing``: bytes one delta entry costs beyond its changes (codec stream header, block table and
  block header of a 1-change stream; the entry's JSON in the part header), and per extra 65,536-change
  block. Exact byte counts, no timing.
- ``publish_overhead``: ``DeltaPublisher.publish`` of a delta step against the number of tensors
  (T tensors of 64 bf16 elements, AdamW), on tmpfs and on the local disk; a least-squares line
  ``a + b * T`` per storage (a: per publish, b: per tensor).
- ``reader_overhead``: the receiver's ``prefetch`` (read + decode + stage) and ``apply`` (the compiled
  CPU pass + checksum verification) of the same steps against T.
- ``anchor``: the anchor path's host rate: a publish carrying an anchor minus a delta-only publish of
  the same model (8 tensors of 16 M bf16 elements), per GB of anchor; and ``load_latest`` of that
  anchor by a fresh engine, per GB.
- ``storage``: a 512 MiB file written with fsync and read back with its pages evicted
  (``posix_fadvise(DONTNEED)``), then read again from the page cache, on the local disk and on
  /dev/shm.

``--device cuda`` runs the same sections the way a GPU trainer and a GPU engine do: the weights and
the engine on the GPU, torch's fused AdamW with the diff inside its update (``differ="auto"``), the
GPU encoder, the receiver staging each delta on the device and applying it with the fused Triton
kernel; the anchor is 1 GiB (8 tensors of 64 M bf16 elements) and a fresh GPU engine loads it. The
tensor sweep goes to 16,384 tensors (a 30 B MoE checkpoint holds ~19,000, a 235 B one ~37,000). On
one H200 with its host the whole run takes about 4-6 minutes.

Usage::

    .venv/bin/python bench/sync_estimate_rates.py --out bench/results/sync_estimate_rates-cpu-<git>.json
    .venv/bin/python bench/sync_estimate_rates.py --device cuda --out bench/results/sync_estimate_rates-h200-<git>.json
    .venv/bin/python bench/sync_estimate_rates.py --quick --out /tmp/rates.json
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

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltune.sync import codec  # noqa: E402
from rltune.sync import format as fmt  # noqa: E402
from rltune.sync.bench import git_sha  # noqa: E402
from rltune.sync.indexmap import IndexMap  # noqa: E402
from rltune.sync.receiver import DeltaReceiver  # noqa: E402
from rltune.sync.sender import DeltaPublisher  # noqa: E402


class FlatModel(nn.Module):
    """T independent bf16 parameters (what a checkpoint of T tensors looks like to the sync path)."""

    def __init__(self, tensors: int, elements: int, seed: int = 0, device: str = "cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.ParameterList(
            [nn.Parameter((torch.randn(elements, generator=g) * 0.02).to(torch.bfloat16).to(device))
             for _ in range(tensors)])


class FlatEngine(nn.Module):
    """The engine side of FlatModel: the same tensors under the same names, loaded by name."""

    def __init__(self, tensors: int, elements: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.w = nn.ParameterList([nn.Parameter(torch.zeros(elements, dtype=dtype), requires_grad=False)
                                   for _ in range(tensors)])

    @torch.no_grad()
    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].copy_(t)


def _stats(xs):
    return dict(min=min(xs), median=statistics.median(xs), max=max(xs), n=len(xs))


def _fit(xs, ys):
    """Least squares y = a + b x; (a, b, max relative residual)."""
    a_mat = np.stack([np.ones(len(xs)), np.asarray(xs, float)], 1)
    (a, b), *_ = np.linalg.lstsq(a_mat, np.asarray(ys, float), rcond=None)
    pred = a + b * np.asarray(xs, float)
    return float(a), float(b), float(np.max(np.abs(pred - ys) / np.asarray(ys)))


def framing() -> dict:
    one = codec.encode(np.array([5], np.int64), np.array([1], np.int64), 16, 0, 1 << 20)
    rng = np.random.default_rng(0)
    sizes = {}
    for blocks in (1, 2, 4):
        n = 65536 * blocks
        idx = np.sort(rng.choice(100 * n, n, replace=False)).astype(np.int64)
        diff = rng.choice([-1, 1], n).astype(np.int64)
        sizes[blocks] = len(codec.encode(idx, diff, 16, 0, 100 * n))
    entry = dict(name="model.layers.47.mlp.experts.127.down_proj.weight", start=0, stop=1572864, offset=123456789,
                 length=4567, crc32=4294967295, changes=15728)
    return dict(one_change_stream_bytes=len(one), entry_json_bytes=len(json.dumps(entry)) + 1,
                entry_json_example=entry, stream_bytes_by_blocks=sizes)


def _train(model, opt, steps_done):
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(steps_done)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, device=p.device).to(p.dtype)


def _optimizer(model, lr: float, device: str) -> torch.optim.Optimizer:
    """torch's fused AdamW on a GPU (the publisher's kernels step its updates with the diff inside);
    the per-tensor loop on the CPU, as before."""
    if device == "cuda":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)


def _publisher(model, opt, root, interval: int, chunk_elements: int, device: str) -> DeltaPublisher:
    # the CPU path as recorded before (torch differ, host encoder); a GPU trainer's defaults on CUDA
    # AdamW moves every element of these small tensors: the kernels' change buffers must hold them all,
    # or each step overflows and goes out as a full checkpoint (which prefetch does not stage)
    if device == "cuda":
        return DeltaPublisher(model, opt, root, interval=interval, differ="auto", chunk_elements=chunk_elements,
                              change_capacity=1.0)
    return DeltaPublisher(model, opt, root, interval=interval, differ="torch", chunk_elements=chunk_elements)


def _receiver(root, engine, imap, device: str) -> DeltaReceiver:
    # a GPU engine: changes staged on the device at prefetch, the fused Triton apply; the CPU: numba
    return DeltaReceiver(root, engine, imap, fused=True, fused_backend="auto" if device == "cuda" else "numba")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def overheads(counts: list[int], roots: dict[str, Path], steps: int, elements: int = 64, device: str = "cpu") -> dict:
    out = {}
    for where, base in roots.items():
        rows = []
        for t in counts:
            root = Path(tempfile.mkdtemp(dir=base, prefix="rates-"))
            try:
                model = FlatModel(t, elements, device=device)
                opt = _optimizer(model, 1e-2, device)
                pub = _publisher(model, opt, root, 1 << 30, 1 << 20, device)
                m0 = pub.publish(0)
                spec = {n: (x["shape"], x["dtype"]) for n, x in m0["tensors"].items()}
                imap = IndexMap.record(lambda dt, t=t: FlatEngine(t, elements, dt), spec)
                engine = FlatEngine(t, elements).to(device)
                rx = _receiver(root, engine, imap, device)
                rx.load_latest()
                pubs, pre, app, changes = [], [], [], []
                for s in range(1, steps + 2):
                    _train(model, opt, s)
                    pub.step()
                    opt.zero_grad(set_to_none=True)
                    _sync(device)
                    t0 = time.perf_counter()
                    m = pub.publish(s)
                    _sync(device)
                    t1 = time.perf_counter()
                    if not rx.prefetch(s):
                        raise SystemExit(f"prefetch of step {s} ({t} tensors) staged nothing: manifest kind "
                                         f"{m.get('kind')!r}, error {rx.last_prefetch_error}")
                    _sync(device)
                    t2 = time.perf_counter()
                    rep = rx.apply(s)
                    _sync(device)
                    t3 = time.perf_counter()
                    if s > 1:  # the first step compiles and warms caches
                        pubs.append(t1 - t0)
                        pre.append(t2 - t1)
                        app.append(t3 - t2)
                        changes.append(rep.changes_applied)
                    assert m["kind"] == "delta"
                rows.append(dict(tensors=t, elements=t * elements, changes=_stats(changes), publish_s=_stats(pubs),
                                 prefetch_s=_stats(pre), apply_s=_stats(app)))
                print(f"{where} T={t}: publish {statistics.median(pubs) * 1e3:.1f} ms, prefetch "
                      f"{statistics.median(pre) * 1e3:.1f} ms, apply {statistics.median(app) * 1e3:.1f} ms", flush=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        fit = {}
        for key in ("publish_s", "prefetch_s", "apply_s"):
            a, b, res = _fit([r["tensors"] for r in rows], [r[key]["median"] for r in rows])
            fit[key] = dict(per_call_s=a, per_tensor_s=b, max_rel_residual=res)
        out[where] = dict(rows=rows, fit=fit)
    return out


def anchor(base: Path, tensors: int, elements: int, repeats: int, device: str = "cpu") -> dict:
    root = Path(tempfile.mkdtemp(dir=base, prefix="rates-anchor-"))
    try:
        model = FlatModel(tensors, elements, device=device)
        opt = _optimizer(model, 1e-6, device)
        pub = _publisher(model, opt, root, 2, 1 << 24, device)
        m0 = pub.publish(0)
        nbytes = sum(f["bytes"] for f in m0["anchors"])
        spec = {n: (x["shape"], x["dtype"]) for n, x in m0["tensors"].items()}
        imap = IndexMap.record(lambda dt: FlatEngine(tensors, elements, dt), spec)
        with_anchor, delta_only, loads, reads = [], [], [], []
        for s in range(1, 2 * repeats + 1):
            _train(model, opt, s)
            pub.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            m = pub.publish(s)
            _sync(device)
            dt = time.perf_counter() - t0
            (with_anchor if m["kind"] == "anchor" else delta_only).append(dt)
            if m["kind"] == "anchor":
                # what a GPU engine does on its host to load an anchor: read every entry, CRC-checked (then it
                # copies the bytes to the device and checks the checksums there)
                t0 = time.perf_counter()
                got = 0
                for f in m["anchors"]:
                    path = root / fmt.step_dir_name(s) / f["file"]
                    header, start = fmt.read_part_header(path, expect_bytes=f["bytes"])
                    for e in header["entries"]:
                        got += len(fmt.read_anchor_range(path, start, e, 0, e["length"]))
                reads.append(got / (time.perf_counter() - t0) / 1e9)
                engine = FlatEngine(tensors, elements).to(device)
                rx = _receiver(root, engine, imap, device)
                _sync(device)
                t0 = time.perf_counter()
                rep = rx.load_latest()
                _sync(device)
                loads.append(time.perf_counter() - t0)
                assert rep.action == "reload" and rep.anchor == s
                del engine, rx
        extra = [a - statistics.median(delta_only) for a in with_anchor]
        return dict(anchor_bytes=nbytes, publish_with_anchor_s=_stats(with_anchor), publish_delta_s=_stats(delta_only),
                    anchor_extra_s=_stats(extra), anchor_write_GBps=_stats([nbytes / e / 1e9 for e in extra]),
                    anchor_load_s=_stats(loads), anchor_load_GBps=_stats([nbytes / x / 1e9 for x in loads]),
                    anchor_read_crc_GBps=_stats(reads))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def storage(base: Path, mib: int, repeats: int) -> dict:
    data = np.random.default_rng(0).integers(0, 255, mib << 20, dtype=np.uint8).tobytes()
    buffer = bytearray(len(data))
    view = memoryview(buffer)
    view[:] = data  # touch every page once
    writes, cold, warm = [], [], []
    for r in range(repeats):
        path = base / f".rates-io-{os.getpid()}-{r}"
        try:
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            writes.append(len(data) / (time.perf_counter() - t0) / 1e9)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            for into in (cold, warm):
                t0 = time.perf_counter()
                with open(path, "rb", buffering=0) as f:
                    got = f.readinto(view)  # into a buffer allocated once: the read, not page faults
                into.append(got / (time.perf_counter() - t0) / 1e9)
        finally:
            path.unlink(missing_ok=True)
    return dict(bytes=len(data), write_fsync_GBps=_stats(writes), read_evicted_GBps=_stats(cold),
                read_page_cache_GBps=_stats(warm))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--disk-dir", type=Path, default=Path(__file__).resolve().parents[1] / "runs")
    ap.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: the host paths; cuda: weights, encoder and engine on the GPU (as on the H200)")
    ap.add_argument("--sections", default="framing,overheads,anchor,storage",
                    help="comma list of framing, overheads, anchor, storage")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    roots = {"shm": args.shm_dir, "disk": args.disk_dir}
    gpu = args.device == "cuda"
    if args.quick:
        counts = [16, 64, 256]
    else:
        counts = [32, 128, 512, 2048, 8192, 16384] if gpu else [32, 128, 512, 2048, 4096]
    anchor_elements = (1 << 18) if args.quick else ((1 << 26) if gpu else (1 << 24))
    load = [os.getloadavg()]
    versions = dict(python=platform.python_version(), torch=torch.__version__, numpy=np.__version__)
    if gpu:
        import triton

        versions.update(triton=triton.__version__, cuda=torch.version.cuda)
    record = dict(benchmark="sync_estimate_rates", git_sha=git_sha(), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  device=args.device, gpu=torch.cuda.get_device_name(0) if gpu else None, cpus=os.cpu_count(),
                  host=platform.node(), versions=versions, quick=args.quick, counts=counts,
                  anchor_elements=anchor_elements)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - {"framing", "overheads", "anchor", "storage"})
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from framing, overheads, anchor, storage")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(done: str) -> None:
        """Written after every section, so that a run cut short still leaves what it measured."""
        load.append(os.getloadavg())
        record["load_average"] = [[round(x, 2) for x in v] for v in load]
        record["sections_done"] = [*record.get("sections_done", []), done]
        args.out.write_text(json.dumps(record, indent=2))
        print(f"{done} done ({time.perf_counter() - started:.0f} s); wrote {args.out}", flush=True)

    started = time.perf_counter()
    if "framing" in sections:
        record["framing"] = framing()
        save("framing")
    if "overheads" in sections:
        record["overheads"] = overheads(counts, roots, steps=3 if args.quick else 5, device=args.device)
        save("overheads")
    if "anchor" in sections:
        record["anchor"] = {w: anchor(b, 8, anchor_elements, 2 if args.quick else 3, device=args.device)
                            for w, b in roots.items()}
        save("anchor")
    if "storage" in sections:
        record["storage"] = {w: storage(b, 64 if args.quick else 512, 2 if args.quick else 3) for w, b in roots.items()}
        save("storage")
    print(json.dumps({k: record[k] for k in ("framing", "anchor", "storage") if k in record}, indent=1))
    for w, o in record.get("overheads", {}).items():
        print(w, json.dumps(o["fit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
