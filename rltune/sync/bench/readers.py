"""``rltune sync-bench --readers``: many engine readers on one store directory while a writer publishes.

One writer (this process) trains a real Qwen3 (transformers, bf16, random init, real AdamW steps)
and publishes each step through :class:`rltune.sync.sender.DeltaPublisher` into a store on local
disk or on a tmpfs (``/dev/shm``). N reader processes (forked from a server that imported torch
once, so N copies of torch cost little memory) each hold a :class:`rltune.sync.toy_engine.ToyEngine`
with a :class:`rltune.sync.receiver.DeltaReceiver` on that store, and for every step:

1. wait for the step through the store's public API (``BroadcastStore.is_complete`` re-lists the
   root and the step directory before it says no), backing off exponentially with jitter from
   ``poll_min_s`` to ``poll_max_s``: never a file of a step before its COMPLETE marker;
2. ``prefetch(step)``: read + decode (timed; the reads inside it are timed apart by wrapping the
   two read functions of :mod:`rltune.sync.format` in the reader process, so decode = prefetch -
   read; the reader process's CPU time over the same call beside it, so that a prefetch slowed by
   readers waiting for a core shows as CPU time flat against N while the wall time grows);
3. ``apply(step)`` and its checksum verification (timed);
4. SHA-256 of every engine parameter, compared afterwards with the digest of a reference engine
   loaded with the trainer's weights of that step: every reader verified bit for bit.

Each reader starts by loading the boot checkpoint (step 0, a full anchor) with ``load_latest`` at
the same time as the others: the anchor read under N readers. The writer publishes step s + 1
while readers still read step s (it waits only for every reader to have applied step s - 1), so
its publish time is measured under their load; the record says how much of each publish
overlapped reads.

``release: next_publish`` lets the readers read step s only when the writer starts publishing
s + 1, so that every publish runs while all N readers read: the writer's worst case.

``cache: cold`` (disk only) evicts each step's files from the page cache
(``posix_fadvise(DONTNEED)``, after the writer's fsyncs) before the readers are let in through a
release marker, so the first reader reads from the disk and the others share what it brought into
the page cache. ``warm`` reads what the writer just wrote, as a reader on the writer's node does.

Outputs under ``out_dir``: ``sync-readers.json`` (config, machine, load averages, git SHA, per
storage x cache x N: per-reader read / decode / prefetch / apply times min/median/max, aggregate
GB/s, writer publish times, anchor load, verification) and ``readers-rows.jsonl`` (every reader's
every step). Example::

    cfg = load_readers_config(resolve_readers_preset("ci"))
    result = run_readers_bench(cfg, Path("out/readers"))
    assert result.record["all_verified"]
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml, to_data
from rltune.errors import RltuneError
from rltune.sync.bench.models import ModelBuilder

READERS_SCHEMA_VERSION = 1
READERS_RECORD_VERSION = 1
READERS_PRESET_DIR = Path(__file__).resolve().parents[3] / "presets" / "sync" / "readers"


class ReadersBenchError(RltuneError):
    """The multi-reader benchmark cannot run as configured, a reader failed, or a reader's weights differ."""


@dataclass
class ReadersConfig:
    schema_version: int = field(doc="version of this schema (1)")
    name: str = field(doc="name of this setup, recorded with the results")
    model: Literal["tiny", "40m", "125m"] = field(doc="trainer model: tiny (~0.4 M), 40m (tied) or 125m (untied); bf16")
    readers: list[int] = field(doc="reader counts to run, each its own trial (0: the writer alone, a baseline)")
    storage: list[Literal["disk", "shm"]] = field(doc="where the store lives: disk (local file system) or shm (tmpfs)")
    steps: int = field(doc="published delta steps measured after the warm-up steps", min=1)
    warmup_steps: int = field(1, doc="first delta steps run and recorded but left out of the summary", min=0)
    cache: list[Literal["warm", "cold"]] = field(
        default_factory=lambda: ["warm"],
        doc="disk only: warm (readers read what the writer just wrote) or cold (its pages evicted first)")
    release: Literal["complete", "next_publish"] = field(
        "complete", doc="when readers may read step s: once it is complete, or when the writer starts publishing "
                        "s + 1 (every publish then runs under the readers' load: the writer's worst case)")
    lr: float = field(3e-6, doc="AdamW learning rate (sets the changed fraction per step)", min=0)
    weight_decay: float = field(0.01, doc="AdamW decoupled weight decay", min=0)
    batch_size: int = field(2, doc="sequences per step (random tokens)", min=1)
    seq_len: int = field(32, doc="tokens per sequence", min=2)
    seed: int = field(0, doc="seed of the model's initialisation and of the token batches")
    chunk_elements: int = field(1 << 22, doc="elements per optimizer-step chunk", min=1)
    writer_pause_s: float = field(0.0, doc="the writer sleeps this long before each publish (readers then poll)", min=0)
    poll_min_s: float = field(0.002, doc="first back-off between polls of a step not yet complete", min=0.0001)
    poll_max_s: float = field(0.05, doc="longest back-off between polls", min=0.0001)
    timeout_s: float = field(600.0, doc="a reader or the writer gives up waiting after this long", min=1)
    disk_dir: str | None = field(None, doc="directory on local disk for the store (default: the output directory)")
    shm_dir: str = field("/dev/shm", doc="tmpfs directory for the store")

    def validate(self) -> None:
        if not self.readers:
            raise FieldProblem("readers", "name at least one reader count")
        if any(n < 0 or n > 64 for n in self.readers):
            raise FieldProblem("readers", "reader counts must be 0..64")
        if not self.storage:
            raise FieldProblem("storage", "name at least one of disk, shm")
        if len(set(self.storage)) != len(self.storage) or len(set(self.cache)) != len(self.cache):
            raise FieldProblem("storage", "a storage or cache mode is named twice")
        if not self.cache:
            raise FieldProblem("cache", "name at least one of warm, cold")
        if self.poll_max_s < self.poll_min_s:
            raise FieldProblem("poll_max_s", f"must be >= poll_min_s ({self.poll_min_s})")


def resolve_readers_preset(preset: str) -> Path:
    """A preset name (``ci``, ``cpu``: presets/sync/readers/<name>.yaml) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ReadersBenchError(f"{path}: no such preset file")
        return path
    candidate = READERS_PRESET_DIR / f"{preset}.yaml"
    if not candidate.exists():
        known = sorted(p.stem for p in READERS_PRESET_DIR.glob("*.yaml"))
        raise ReadersBenchError(f"--preset {preset}: no presets/sync/readers/{preset}.yaml; choose from "
                                f"{', '.join(known)} or pass a YAML path")
    return candidate


def load_readers_config(path: str | Path) -> ReadersConfig:
    return load_yaml(ReadersConfig, path, READERS_SCHEMA_VERSION)


def readers_with_overrides(cfg: ReadersConfig, **overrides: Any) -> ReadersConfig:
    """A copy with command-line overrides (None values ignored), validated again."""
    changed = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    try:
        changed.validate()
    except FieldProblem as problem:
        name = f"--{problem.field.replace('_', '-')}" if overrides.get(problem.field) is not None else problem.field
        raise ReadersBenchError(f"{name}: {problem.problem}") from None
    return changed


@dataclass
class ReadersResult:
    record: dict[str, Any]
    record_path: Path
    rows_path: Path

    @property
    def all_verified(self) -> bool:
        return bool(self.record["all_verified"])


# ---------------------------------------------------------------------------------------------- shared bits


def params_digest(module) -> str:
    """SHA-256 over every parameter's name and bytes, in registration order (a bit-for-bit identity)."""
    import torch

    h = hashlib.sha256()
    for name, p in module.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _evict(step_dir: Path) -> int:
    """Drop a step's files from the page cache (they were fsynced by the writer); the bytes evicted."""
    total = 0
    for entry in os.scandir(step_dir):
        if not entry.is_file():
            continue
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def wait_for_step(store, step: int, deadline: float, poll_min_s: float, poll_max_s: float,
                  release: Path | None = None, rng: random.Random | None = None) -> int:
    """Poll until ``step`` is complete (and ``release`` exists); return the polls that found it not ready.

    Each poll goes through ``BroadcastStore.is_complete``, which re-lists the root and the step
    directory before answering no (a stale NFS lookup cache cannot hide a step); the back-off
    doubles from ``poll_min_s`` to ``poll_max_s`` with +-25 % jitter so N readers do not poll in step.
    """
    rng = rng or random.Random()
    delay, misses = poll_min_s, 0
    while True:
        if store.is_complete(step) and (release is None or release.exists()):
            return misses
        misses += 1
        if time.monotonic() > deadline:
            raise ReadersBenchError(f"{store.root}: step {step} not complete after waiting; the writer stopped or is "
                                    "too slow (raise timeout_s)")
        time.sleep(delay * rng.uniform(0.75, 1.25))
        delay = min(poll_max_s, delay * 2)


# ---------------------------------------------------------------------------------------------- reader side


class _ReadMeter:
    """Times (and counts the bytes of) the part-file reads inside ``prefetch``, in this reader process only."""

    def __init__(self):
        from rltune.sync import format as fmt

        self.fmt, self.seconds, self.bytes = fmt, 0.0, 0
        self.available = all(hasattr(fmt, n) for n in ("read_part_header", "read_entries_bytes"))
        if not self.available:
            return
        original_header, original_entries = fmt.read_part_header, fmt.read_entries_bytes

        def read_part_header(path, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = original_header(path, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
            self.bytes += out[1]  # the prefix and header read
            return out

        def read_entries_bytes(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                chunks = original_entries(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
            self.bytes += sum(len(c) for c in chunks)
            return chunks

        fmt.read_part_header, fmt.read_entries_bytes = read_part_header, read_entries_bytes

    def reset(self) -> None:
        self.seconds, self.bytes = 0.0, 0


def _reader_main(spec: dict[str, Any]) -> None:
    """One reader process: boot from the anchor, then prefetch + apply + digest every step."""
    out = Path(spec["rows_path"])
    try:
        _reader_loop(spec, out)
    except BaseException as exc:  # reported to the harness through the control directory
        _write_json_atomic(Path(spec["control"]) / f"error-{spec['reader']:03d}.json",
                           dict(reader=spec["reader"], error=type(exc).__name__, message=str(exc),
                                traceback=traceback.format_exc()))
        raise


def _reader_loop(spec: dict[str, Any], out: Path) -> None:
    import pickle

    import torch

    torch.set_num_threads(1)
    from rltune.sync.receiver import DeltaReceiver
    from rltune.sync.store import BroadcastStore
    from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig

    meter = _ReadMeter()
    control = Path(spec["control"])
    cfg = ToyEngineConfig(**spec["engine_cfg"])
    with open(spec["index_map"], "rb") as f:
        imap = pickle.load(f)
    engine = ToyEngine(cfg)
    rx = DeltaReceiver(spec["root"], engine, imap, fused=True, fused_backend="numba")
    store = BroadcastStore(spec["root"])
    rng = random.Random(spec["reader"])
    deadline = time.monotonic() + spec["timeout_s"]
    release = (lambda s: control / f"release-{s:06d}") if spec["gated"] else (lambda s: None)
    rows = []

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")

    polls = wait_for_step(store, 0, deadline, spec["poll_min_s"], spec["poll_max_s"], release(0), rng)
    meter.reset()
    t0 = time.monotonic()
    report = rx.load_latest()
    t1 = time.monotonic()
    emit(dict(reader=spec["reader"], step=0, phase="anchor", polls=polls, seen_wall=None, start=t0, end=t1,
              seconds=t1 - t0, read_s=None, read_bytes=_anchor_bytes(store, 0), action=report.action,
              digest=params_digest(engine), changes=0))
    _write_json_atomic(control / f"ack-{spec['reader']:03d}.json", dict(step=0))
    for step in spec["steps"]:
        polls = wait_for_step(store, step, deadline, spec["poll_min_s"], spec["poll_max_s"], release(step), rng)
        seen_wall = time.time()
        meter.reset()
        c0, t0 = time.process_time(), time.monotonic()
        ok = rx.prefetch(step)
        t1, c1 = time.monotonic(), time.process_time()
        read_s, read_bytes = (meter.seconds, meter.bytes) if meter.available else (None, None)
        if not ok:
            raise ReadersBenchError(f"{spec['root']}: prefetch of complete step {step} failed (not a readable delta)")
        report = rx.apply(step)
        t2 = time.monotonic()
        if report.action != "delta":
            raise ReadersBenchError(f"step {step}: the receiver planned {report.action!r}, not one delta")
        emit(dict(reader=spec["reader"], step=step, phase="delta", polls=polls, seen_wall=seen_wall, start=t0,
                  end=t1, seconds=t1 - t0, cpu_s=c1 - c0, read_s=read_s, read_bytes=read_bytes, apply_s=t2 - t1,
                  changes=report.changes_applied, action=report.action, digest=params_digest(engine)))
        _write_json_atomic(control / f"ack-{spec['reader']:03d}.json", dict(step=step))


def _anchor_bytes(store, step: int) -> int:
    m = store.manifest(step)
    return sum(f["bytes"] for f in m["anchors"])


# ---------------------------------------------------------------------------------------------- writer side


def _reader_context():
    ctx = multiprocessing.get_context("forkserver")
    # the server imports torch and the sync library once; each reader is forked from it
    ctx.set_forkserver_preload(["torch", "numpy", "rltune.sync.receiver", "rltune.sync.toy_engine",
                                "rltune.sync.kernels.cpu_kernels", "rltune.sync.bench.readers"])
    return ctx


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _run_trial(cfg: ReadersConfig, storage: str, cache: str, n: int, work: Path, imap_path: Path,
               say: Callable[[str], None], build_model: ModelBuilder) -> dict[str, Any]:
    import torch

    from rltune.sync.sender import DeltaPublisher
    from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig

    tag = f"{storage}-{cache}-n{n}"
    base = Path(cfg.shm_dir) / f"rltune-readers-{uuid.uuid4().hex[:8]}" if storage == "shm" else \
        Path(cfg.disk_dir or work) / f"store-{tag}-{uuid.uuid4().hex[:6]}"
    root, control = base / "root", work / f"control-{tag}"
    shutil.rmtree(control, ignore_errors=True)
    control.mkdir(parents=True)
    root.mkdir(parents=True)
    rows_dir = work / f"rows-{tag}"
    shutil.rmtree(rows_dir, ignore_errors=True)
    rows_dir.mkdir(parents=True)
    load = dict(start=_load())
    procs = []
    threads = torch.get_num_threads()
    # one thread for the writer, as for each reader: on a shared CPU, torch's OpenMP threads waiting for
    # each other behind other processes made a tiny model's step 10-40x slower
    torch.set_num_threads(1)
    try:
        model = build_model(cfg.model, cfg.seed, torch.bfloat16, "cpu")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
        pub = DeltaPublisher(model, opt, root, interval=1 << 30, run_id=f"readers-{tag}",
                             chunk_elements=cfg.chunk_elements, differ="torch")
        engine_cfg = ToyEngineConfig.from_hf(model.config)
        reference = ToyEngine(engine_cfg)

        def expected() -> str:
            reference.load_weights(model.state_dict().items())
            return params_digest(reference)

        digests = {0: expected()}
        total = cfg.warmup_steps + cfg.steps
        steps = list(range(1, total + 1))
        t0 = time.monotonic()
        pub.publish(0)
        writer_rows = [dict(step=0, kind="full", publish_s=time.monotonic() - t0, start=t0,
                            bytes=_step_bytes(root, 0))]
        if cache == "cold":
            _evict(root / _step_name(0))
        (control / "release-000000").touch()
        ctx = _reader_context()
        for r in range(n):
            spec = dict(reader=r, root=str(root), control=str(control), index_map=str(imap_path),
                        engine_cfg=engine_cfg.__dict__, steps=steps, timeout_s=cfg.timeout_s,
                        poll_min_s=cfg.poll_min_s, poll_max_s=cfg.poll_max_s,
                        gated=cache == "cold" or cfg.release == "next_publish",
                        rows_path=str(rows_dir / f"reader-{r:03d}.jsonl"))
            p = ctx.Process(target=_reader_main, args=(spec,), name=f"rltune-reader-{r}")
            p.start()
            procs.append(p)
        deadline = time.monotonic() + cfg.timeout_s
        _wait_acks(control, procs, 0, deadline)  # every reader booted from the anchor
        load["after_boot"] = _load()
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        vocab = model.config.vocab_size
        for step in steps:
            ids = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len), generator=gen)
            before = {k: v.detach().view(torch.int16).clone() for k, v in model.named_parameters()}
            ts = time.monotonic()
            model(input_ids=ids, labels=ids).loss.backward()
            pub.step()
            opt.zero_grad(set_to_none=True)
            train_s = time.monotonic() - ts
            changed = sum(int((v.detach().view(torch.int16) != before[k]).sum()) for k, v in model.named_parameters())
            digests[step] = expected()
            _wait_acks(control, procs, step - 2, deadline)  # at most two steps in flight
            if cfg.writer_pause_s:
                time.sleep(cfg.writer_pause_s)
            if cfg.release == "next_publish" and step > 1:
                (control / f"release-{step - 1:06d}").touch()  # the readers read step - 1 while this one is published
            t0 = time.monotonic()
            manifest = pub.publish(step)
            t1 = time.monotonic()
            evicted = _evict(root / _step_name(step)) if cache == "cold" else 0
            if cfg.release == "complete" or step == steps[-1]:
                (control / f"release-{step:06d}").touch()
            writer_rows.append(dict(step=step, kind=manifest["kind"], publish_s=t1 - t0, start=t0, end=t1,
                                    train_s=train_s, bytes=_step_bytes(root, step),
                                    part_bytes=sum(f["bytes"] for f in manifest["parts"]), changes=changed,
                                    changed_frac=changed / sum(p.numel() for p in model.parameters()),
                                    complete_mtime=os.stat(root / _step_name(step) / "COMPLETE").st_mtime,
                                    evicted_bytes=evicted, load=_load()))
            say(f"{tag}: published step {step}/{total} ({writer_rows[-1]['bytes'] / 1e6:.2f} MB) in "
                f"{writer_rows[-1]['publish_s'] * 1e3:.1f} ms")
        _wait_acks(control, procs, steps[-1], deadline)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        bad = [p.name for p in procs if p.exitcode != 0]
        if bad:
            raise ReadersBenchError(f"{tag}: reader processes {bad} exited with an error; see {control}")
        load["end"] = _load()
        reader_rows = []
        for r in range(n):
            path = rows_dir / f"reader-{r:03d}.jsonl"
            reader_rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return dict(storage=storage, cache=cache, readers=n, writer_rows=writer_rows, reader_rows=reader_rows,
                    digests=digests, load=load, root_fs=_fs_type(base))
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            if p.is_alive():
                p.terminate()  # only this trial's own readers
                p.join(5)
        shutil.rmtree(base, ignore_errors=True)


def _wait_acks(control: Path, procs, step: int, deadline: float) -> None:
    """Until every reader acknowledged ``step`` (applied and digested it); a reader's error is raised here."""
    if step < 0 or not procs:
        return
    delay = 0.002
    while True:
        errors = sorted(control.glob("error-*.json"))
        if errors:
            e = json.loads(errors[0].read_text())
            raise ReadersBenchError(f"reader {e['reader']} failed: {e['error']}: {e['message']}")
        done = 0
        for r in range(len(procs)):
            try:
                done += json.loads((control / f"ack-{r:03d}.json").read_text())["step"] >= step
            except (FileNotFoundError, json.JSONDecodeError):
                pass
        if done == len(procs):
            return
        dead = [p.name for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise ReadersBenchError(f"reader processes {dead} died before acknowledging step {step}")
        if time.monotonic() > deadline:
            raise ReadersBenchError(f"{control}: readers did not acknowledge step {step} in time (raise timeout_s)")
        time.sleep(delay)
        delay = min(0.02, delay * 2)


def _step_name(step: int) -> str:
    from rltune.sync import format as fmt

    return fmt.step_dir_name(step)


def _step_bytes(root: Path, step: int) -> int:
    d = root / _step_name(step)
    return sum(e.stat().st_size for e in os.scandir(d) if e.is_file())


def _fs_type(path: Path) -> str | None:
    """The file system type of the mount holding ``path`` (from /proc/mounts)."""
    try:
        best, kind = "", None
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mnt, fstype = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
        return kind
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- summary


def _stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(min=min(values), median=statistics.median(values), max=max(values))


def summarize_trial(trial: dict[str, Any], warmup_steps: int) -> dict[str, Any]:
    """Per-reader and aggregate figures of one (storage, cache, N) trial, over the measured steps."""
    n = trial["readers"]
    writer = {w["step"]: w for w in trial["writer_rows"]}
    measured = sorted(s for s in writer if s > warmup_steps)
    deltas = [r for r in trial["reader_rows"] if r["phase"] == "delta"]
    mine = [r for r in deltas if r["step"] in measured]
    verified = sum(r["digest"] == trial["digests"][r["step"]] for r in trial["reader_rows"])
    per_step_agg, per_step_wall, per_step_changes = [], [], []
    for s in measured:
        rs = [r for r in mine if r["step"] == s]
        if not rs:
            continue
        wall = max(r["end"] for r in rs) - min(r["start"] for r in rs)
        per_step_wall.append(wall)
        if all(r["read_bytes"] is not None for r in rs) and wall > 0:
            per_step_agg.append(sum(r["read_bytes"] for r in rs) / wall / 1e9)
        if wall > 0:
            per_step_changes.append(sum(r["changes"] for r in rs) / wall / 1e6)
    # how much of each publish of step s ran while readers were prefetching step s - 1
    overlap = []
    for s in measured:
        w = writer[s]
        windows = [(r["start"], r["end"]) for r in deltas if r["step"] == s - 1]
        if windows and w["publish_s"] > 0:
            lo, hi = min(a for a, _ in windows), max(b for _, b in windows)
            overlap.append(max(0.0, min(hi, w["end"]) - max(lo, w["start"])) / w["publish_s"])
    anchors = [r for r in trial["reader_rows"] if r["phase"] == "anchor"]
    anchor_wall = (max(r["end"] for r in anchors) - min(r["start"] for r in anchors)) if anchors else None
    decode = [r["seconds"] - r["read_s"] for r in mine if r["read_s"] is not None]
    before_complete = sum(1 for r in deltas if r["seen_wall"] is not None
                          and r["seen_wall"] < writer[r["step"]]["complete_mtime"])
    return dict(
        storage=trial["storage"], cache=trial["cache"], readers=n, fs=trial["root_fs"], steps=len(measured),
        load=trial["load"],
        delta_bytes=_stats([writer[s]["bytes"] for s in measured]),
        changes=_stats([writer[s]["changes"] for s in measured]),
        changed_frac=_stats([writer[s]["changed_frac"] for s in measured]),
        publish_s=_stats([writer[s]["publish_s"] for s in measured]),
        publish_overlap=_stats(overlap),
        train_s=_stats([writer[s]["train_s"] for s in measured]),
        prefetch_s=_stats([r["seconds"] for r in mine]),
        prefetch_cpu_s=_stats([r.get("cpu_s") for r in mine]),
        prefetch_cpu_share=_stats([r["cpu_s"] / r["seconds"] for r in mine if r.get("cpu_s") is not None
                                   and r["seconds"] > 0]),
        read_s=_stats([r["read_s"] for r in mine]),
        decode_s=_stats(decode),
        apply_s=_stats([r["apply_s"] for r in mine]),
        step_wall_s=_stats(per_step_wall),
        aggregate_GBps=_stats(per_step_agg),
        aggregate_Mchanges_per_s=_stats(per_step_changes),
        polls=_stats([r["polls"] for r in mine]),
        anchor_load_s=_stats([r["seconds"] for r in anchors]),
        anchor_bytes=anchors[0]["read_bytes"] if anchors else None,
        anchor_aggregate_GBps=(sum(r["read_bytes"] for r in anchors) / anchor_wall / 1e9) if anchors and anchor_wall else None,
        updates=len(trial["reader_rows"]), verified=verified, read_before_complete=before_complete,
    )


def build_readers_record(cfg: ReadersConfig, trials: list[dict[str, Any]], model_info: dict[str, Any]) -> dict[str, Any]:
    from rltune.sync.bench.run import device_info, git_sha

    summaries = [summarize_trial(t, cfg.warmup_steps) for t in trials]
    for s in summaries:  # per-reader prefetch against one reader on the same storage and cache
        one = next((o for o in summaries if o["storage"] == s["storage"] and o["cache"] == s["cache"]
                    and o["readers"] == 1), None)
        if one and s["readers"] and one["prefetch_s"] and s["prefetch_s"]:
            s["prefetch_over_one_reader"] = s["prefetch_s"]["median"] / one["prefetch_s"]["median"]
        alone = next((o for o in summaries if o["storage"] == s["storage"] and o["cache"] == s["cache"]
                      and o["readers"] == 0), None)
        if alone and alone["publish_s"] and s["publish_s"]:
            s["publish_over_alone"] = s["publish_s"]["median"] / alone["publish_s"]["median"]
    readers_trials = [s for s in summaries if s["readers"]]
    all_verified = bool(readers_trials) and all(s["verified"] == s["updates"] and not s["read_before_complete"]
                                                for s in readers_trials)
    return dict(kind="rltune-sync-readers", schema_version=READERS_RECORD_VERSION,
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), git_sha=git_sha(), config=to_data(cfg),
                device=device_info("cpu"), model=model_info, cpus=os.cpu_count(),
                summary_over="delta steps after warmup_steps; per-reader figures over every reader and step "
                             "(min/median/max)",
                trials=summaries, all_verified=all_verified)


def run_readers_bench(cfg: ReadersConfig, out_dir: str | Path, progress: Callable[[str], None] | None = None,
                      build_model: ModelBuilder | None = None) -> ReadersResult:
    """Run every (storage, cache, N) trial; write the JSON record and the rows; return them.

    ``build_model``: ``(cfg.model, seed, torch.bfloat16, "cpu") -> model``, the command's; by default
    :func:`rltune.sync.bench.models.build_bench_model`."""
    import pickle

    import torch

    from rltune.sync import format as fmt
    from rltune.sync.bench.models import build_bench_model
    from rltune.sync.indexmap import IndexMap
    from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig

    build_model = build_model or build_bench_model
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out_dir / "config.yaml")
    work = out_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if "shm" in cfg.storage and not Path(cfg.shm_dir).is_dir():
        raise ReadersBenchError(f"shm_dir {cfg.shm_dir}: no such directory; use storage: [disk] or point shm_dir at a tmpfs")

    # the index map is the same for every reader (one TP=1 engine each): recorded once here
    model = build_model(cfg.model, cfg.seed, torch.bfloat16, "cpu")
    engine_cfg = ToyEngineConfig.from_hf(model.config)
    spec = {n: (list(t.shape), fmt.dtype_name(t.dtype)) for n, t in model.state_dict().items()}
    imap = IndexMap.record(lambda dt: ToyEngine(engine_cfg, dtype=dt), spec)
    imap_path = work / "index-map.pickle"
    with open(imap_path, "wb") as f:
        pickle.dump(imap, f)
    model_info = dict(name=cfg.model, params=sum(p.numel() for p in model.parameters()),
                      tensors=len(spec), param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    del model

    trials = []
    for storage in cfg.storage:
        for cache in (cfg.cache if storage == "disk" else ["warm"]):
            for n in cfg.readers:
                say(f"trial {storage}/{cache} with {n} readers (load {_load()})")
                trials.append(_run_trial(cfg, storage, cache, n, work, imap_path, say, build_model))
    record = build_readers_record(cfg, trials, model_info)
    rows_path = out_dir / "readers-rows.jsonl"
    with open(rows_path, "w") as f:
        for t in trials:
            for kind in ("writer_rows", "reader_rows"):
                for row in t[kind]:
                    f.write(json.dumps(dict(storage=t["storage"], cache=t["cache"], readers=t["readers"],
                                            who="writer" if kind == "writer_rows" else "reader", **row)) + "\n")
    record["files"] = dict(rows=rows_path.name, config="config.yaml")
    record_path = out_dir / "sync-readers.json"
    record_path.write_text(json.dumps(record, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return ReadersResult(record, record_path, rows_path)


def readers_summary_lines(record: dict[str, Any]) -> list[dict[str, str]]:
    """One display row per trial (times in ms), for the CLI's table."""
    def ms(stat: dict | None, key: str = "median") -> str:
        return "-" if not stat else f"{stat[key] * 1e3:.1f}"

    out = []
    for t in record["trials"]:
        p = t["prefetch_s"]
        out.append({
            "storage": f"{t['storage']}/{t['cache']}",
            "N": str(t["readers"]),
            "read+decode ms min/med/max": "-" if not p else f"{p['min'] * 1e3:.1f} / {p['median'] * 1e3:.1f} / {p['max'] * 1e3:.1f}",
            "read ms": ms(t["read_s"]),
            "cpu ms": ms(t.get("prefetch_cpu_s")),
            "x N=1": "-" if "prefetch_over_one_reader" not in t else f"{t['prefetch_over_one_reader']:.2f}",
            "agg GB/s": "-" if not t["aggregate_GBps"] else f"{t['aggregate_GBps']['median']:.3f}",
            "publish ms": ms(t["publish_s"]),
            "anchor ms": ms(t["anchor_load_s"]),
            "load": " ".join(f"{x:.1f}" for x in t["load"]["start"]),
            "ok": f"{t['verified']}/{t['updates']}",
        })
    return out


if __name__ == "__main__":  # pragma: no cover - a reader run by hand: python -m rltune.sync.bench.readers SPEC.json
    _reader_main(json.loads(Path(sys.argv[1]).read_text()))
