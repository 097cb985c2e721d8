"""Cost model of the sparse delta sync, from 8 B to 1 T parameters: what one step costs, with ranges.

:func:`estimate` projects, for a model and layout (a MODEL.yaml, :class:`ModelSpec`), per step and
per weight dtype (bf16, fp8):

- the trainer's cost: the diff inside the optimizer step, and ``publish()`` (encode on the GPU,
  write, and its host work per tensor), which blocks the trainer;
- each engine worker's read + decode of the step's parts while it serves, and the dispatch-blocking
  update (the engine's pause, the fused apply + verify kernel, the host work per tensor);
- the anchor once per interval (write per trainer rank, and a fresh engine worker's load) and the
  storage traffic and bandwidth all of that needs.

Every input rate comes from ``rltune/sync/data/rates.yaml`` (versioned; each rate names the records
under ``bench/results/`` it was taken from and their git SHA, and is rebuilt from them by
``bench/build_sync_rates.py``). Each rate has a min and a max over its records; each output is
computed twice, once with every input at the end that makes it smallest and once at the other end,
so it carries the range those inputs span (with the changed fraction, the storage bandwidth and
the engine's pause from the MODEL.yaml treated the same way).

How the format and the code scale enter the model (docs/delta-format.md; rltune.sync.sender and
receiver as they are):

- bytes per change follow the entropy of the positions at the changed fraction ``p``
  (``H(p) / p`` bits) plus a value term, times the codec's measured ratio to the bound; each trainer
  rank writes one entry (codec stream + JSON header entry) per tensor it changed, and publishes a row
  slice of **every** tensor, so entries = tensors x ranks;
- a TP worker decodes every entry of each tensor it holds any slice of (all of them); an EP worker
  decodes the dense tensors and its own experts' entries; it applies only what it holds;
- the host work of ``publish``, ``prefetch`` and the update grows with the tensors (per-tensor and
  per-entry rates from a sweep over the number of tensors: ``bench/sync_estimate_rates.py``).

Each rate names the machine it was measured on. The host rates of that sweep and the anchor write
and load rates are the H200 host's (``bench/sync_estimate_rates.py --device cuda``); a rate no H200
record measures would be the 2-core CPU's, machine ``CPU`` (none is, as of rates version 3): every
output lists the rates it depends on (``inputs``) and, of those, the CPU stand-ins
(``cpu_only_inputs``), and the CLI prints them beside each row.

Example::

    spec = load_model_spec("presets/sync/estimate/qwen3-235b-a22b.yaml")
    result = estimate(spec, load_rates())
    result["by_dtype"]["bf16"]["outputs"]["trainer_publish_s"]   # {"lo": ..., "hi": ..., "unit": "s", ...}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.schema import FieldProblem, field, load_yaml
from rltune.sync.format import WIRE_DTYPES

MODEL_SCHEMA_VERSION = 1
RATES_SCHEMA_VERSION = 1
RATES_PATH = Path(__file__).resolve().parent / "data" / "rates.yaml"
GIB = float(1 << 30)
MIB = float(1 << 20)
# a model spec's dtype: bytes per element on the wire (the format's table)
DTYPE_BYTES = {short: WIRE_DTYPES[name].bits // 8 for short, name in (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn"))}

# output name: (unit, one line): the outputs every estimate carries, in display order
OUTPUTS: dict[str, tuple[str, str]] = {
    "changes_per_step_M": ("M", "elements the step changed, all tensors"),
    "delta_MiB": ("MiB", "delta part files of one step, all trainer ranks (payload + per-entry framing)"),
    "diff_in_step_s": ("s", "extra optimizer-step time of the diff taken inside the update, per trainer rank"),
    "encode_s": ("s", "GPU encode of one rank's changes"),
    "commit_s": ("s", "write of one rank's part at its share of the storage bandwidth + publish's host work"),
    "trainer_publish_s": ("s", "trainer-blocking publish() per rank: encode + commit"),
    "trainer_blocking_s": ("s", "what the step pays on the trainer: diff in step + publish"),
    "changes_decoded_per_reader_M": ("M", "changes one engine worker decodes (every entry of each tensor it holds any of)"),
    "changes_applied_per_worker_M": ("M", "changes one engine worker applies (the elements it holds)"),
    "engine_read_s": ("s", "one engine worker's read + decode of the step while it serves"),
    "dispatch_blocking_s": ("s", "engine pause + fused apply and verify + host work: train dispatch stopped"),
    "anchor_GiB": ("GiB", "one anchor, all ranks' slices"),
    "anchor_write_s": ("s", "extra trainer time of a step that carries an anchor (once per interval)"),
    "anchor_per_step_s": ("s", "anchor_write_s averaged over the interval"),
    "anchor_load_s": ("s", "a fresh engine worker's load of the rows it holds from the latest anchor"),
    "storage_read_GB_per_step": ("GB", "bytes the store serves each step (once per node with a node cache)"),
    "storage_GBps_sustained": ("GB/s", "store bandwidth the run needs on average: deltas written and read, anchors"),
    "storage_GBps_read_hidden": ("GB/s", "read bandwidth at which fetching a step takes as long as decoding it"),
    "sync_critical_s": ("s", "per step on the critical path when the read hides under serving: trainer blocking + dispatch blocking"),
    "sync_serial_s": ("s", "the same with the engine read not overlapped (publish + read + update, one after another)"),
    "full_sync_s": ("s", "the full-weight path through the store: the trainer writes an anchor, a worker loads its rows"),
}


# ---------------------------------------------------------------------------------------------- schemas


@dataclass
class Range:
    min: float = field(doc="smallest value", min=0)
    max: float = field(doc="largest value", min=0)

    def validate(self) -> None:
        if self.max < self.min:
            raise FieldProblem("max", f"must be >= min ({self.min}); give min <= max")


@dataclass
class TrainerLayout:
    ranks: int = field(doc="trainer ranks publishing (each writes a row slice of every tensor, no gather)", min=1)
    nodes: int = field(1, doc="trainer nodes", min=1)
    diff: Literal["fused", "staged"] = field(
        "fused", doc="fused: the diff runs inside torch's fused AdamW update; staged: any other optimizer")


@dataclass
class EngineLayout:
    engines: int = field(doc="inference engines (replicas), each following the delta chain", min=1)
    workers: int = field(doc="GPUs per engine (each an engine worker that reads the store)", min=1)
    tp: int = field(1, doc="tensor-parallel size of the dense layers", min=1)
    ep: int = field(1, doc="expert-parallel size: routed experts split over ep workers (1: TP-sliced)", min=1)
    readers_per_node: int = field(8, doc="engine workers per node (they share a node's page cache)", min=1)
    pause_s: Range = field(default_factory=lambda: Range(0.0, 0.0),
                           doc="the engine's own pause + resume around an update (not measured by rltune)")

    def validate(self) -> None:
        if self.tp > self.workers or self.ep > self.workers:
            raise FieldProblem("tp", f"tp {self.tp} and ep {self.ep} must be <= workers {self.workers}")


@dataclass
class StorageSpec:
    write_GBps: Range = field(doc="aggregate write bandwidth of the store, all trainer ranks at once (GB/s)")
    read_GBps: Range = field(doc="aggregate read bandwidth of the store, all engine workers at once (GB/s)")
    node_cache: bool = field(True, doc="a node's workers share one fetch of each file (NFS client or page cache)")
    source: str = field("", doc="where these bandwidths come from")

    def validate(self) -> None:
        for name in ("write_GBps", "read_GBps"):
            if getattr(self, name).min <= 0:
                raise FieldProblem(f"{name}.min", "a bandwidth must be positive (GB/s), e.g. {min: 4.4, max: 12.5}")


@dataclass
class PublishedFigure:
    output: str = field(doc="the estimate output it is checked against (one of the OUTPUTS names)")
    value: Range = field(doc="the published figure (min = max for a single number), in the output's unit")
    source: str = field(doc="where it was published (URL or document and row)")
    dtype: Literal["bf16", "fp8"] = field("bf16", doc="the weight dtype it was measured with")
    setup: str = field("", doc="what was measured, in the publisher's words")
    cause: str = field("", doc="when the prediction misses by more than 2x: the named cause")

    def validate(self) -> None:
        if self.output not in OUTPUTS:
            raise FieldProblem("output", f"{self.output!r} is not an estimate output; use one of {', '.join(OUTPUTS)}")


@dataclass
class ModelSpec:
    schema_version: int = field(doc="version of this schema (1)")
    name: str = field(doc="name of the model and setup")
    params_total: float = field(doc="parameters (checkpoint elements), all tensors", min=1, max=1e15)
    params_active: float = field(doc="parameters active per token (recorded; the sync moves all of them)", min=1, max=1e15)
    tensors: int = field(doc="checkpoint tensors", min=1)
    changed_fraction: Range = field(doc="share of the elements one optimizer step changes (e.g. 0.005-0.04)")
    step_s: Range = field(doc="training step time, for the sustained storage bandwidth (s)")
    trainer: TrainerLayout = field(doc="trainer layout")
    engine: EngineLayout = field(doc="engine layout, as readers per node")
    storage: StorageSpec = field(doc="the store's bandwidth")
    dtypes: list[Literal["bf16", "fp8"]] = field(default_factory=lambda: ["bf16"],
                                                 doc="wire dtypes to estimate: bf16 and/or fp8 (1 byte an element)")
    expert_params: float = field(0.0, doc="of params_total, those in routed experts (0: a dense model)", min=0)
    expert_tensors: int = field(0, doc="of tensors, those of routed experts", min=0)
    fp8_scale_tensors: int = field(0, doc="tensors an fp8 checkpoint adds (a _scale_inv per quantized matrix)", min=0)
    anchor_interval: int = field(50, doc="a full anchor every N steps", min=1)
    fresh_engines_per_interval: float = field(0.0, doc="engines that (re)join and load an anchor per interval", min=0)
    published: list[PublishedFigure] = field(default_factory=list,
                                             doc="published figures of this setup to check the model against")
    notes: str = field("", doc="free text: where the shape and layout come from")

    def validate(self) -> None:
        if self.params_active > self.params_total:
            raise FieldProblem("params_active", f"must be <= params_total ({self.params_total:g})")
        if self.expert_params > self.params_total:
            raise FieldProblem("expert_params", f"must be <= params_total ({self.params_total:g})")
        if self.expert_tensors > self.tensors:
            raise FieldProblem("expert_tensors", f"must be <= tensors ({self.tensors})")
        if (self.expert_params > 0) != (self.expert_tensors > 0):
            raise FieldProblem("expert_tensors", "give expert_params and expert_tensors together (both 0 for a dense model)")
        if not 0 < self.changed_fraction.min <= self.changed_fraction.max <= 0.5:
            raise FieldProblem("changed_fraction", "must lie in (0, 0.5], e.g. {min: 0.005, max: 0.04}; above half "
                                                   "the elements a step goes out as a full checkpoint")
        if self.step_s.min <= 0:
            raise FieldProblem("step_s", "must be positive (seconds)")
        if not self.dtypes or len(set(self.dtypes)) != len(self.dtypes):
            raise FieldProblem("dtypes", "name bf16 and/or fp8, each once")


@dataclass
class RateSource:
    record: str = field(doc="record file under the repository (bench/results/...)")
    git: str = field(doc="git SHA the record was measured at (the record's own field)")
    fields: str = field(doc="which fields of the record, and how the rate was derived from them")


# where a rate was measured; "CPU" alone means no H200 record measures it yet (the 2-core machine's
# figure stands in for the H200 host's, and every output that depends on it says so)
MACHINES = ("H200", "H200 host", "H200 and CPU", "exact", "CPU")


@dataclass
class Rate:
    min: float = field(doc="smallest value over the sources")
    max: float = field(doc="largest value over the sources")
    unit: str = field(doc="unit")
    machine: Literal["H200", "H200 host", "H200 and CPU", "exact", "CPU"] = field(
        doc="where it was measured: H200 (its GPU), H200 host, H200 and CPU (bytes: the same on both), exact (byte "
            "counts), or CPU (the 2-core machine only: no H200 record measures it yet, so it stands in)")
    what: str = field(doc="what the rate is")
    sources: list[RateSource] = field(doc="records it was taken from")

    def validate(self) -> None:
        if self.max < self.min:
            raise FieldProblem("max", f"must be >= min ({self.min})")
        if not self.sources:
            raise FieldProblem("sources", "every rate names at least one record")

    @property
    def cpu_only(self) -> bool:
        """Measured on the 2-core CPU only: a stand-in until an H200 record measures it."""
        return self.machine == "CPU"


@dataclass
class RatesFile:
    schema_version: int = field(doc="version of this schema (1)")
    rates_version: int = field(doc="version of the rates: raised whenever a value changes", min=1)
    built_by: str = field(doc="the script that derives this file from the records")
    rates: dict[str, Rate] = field(doc="rate name -> rate")


RATE_NAMES = ("diff_fused_ms_per_GiB", "diff_staged_ms_per_GiB", "encode_gpu_Mchanges_per_s", "codec_over_bound",
              "value_bytes_per_change", "entry_framing_bytes", "publish_per_call_ms", "publish_per_tensor_ms",
              "decode_Mchanges_per_s", "prefetch_per_entry_ms", "apply_per_call_ms", "apply_ps_per_change",
              "update_host_per_call_ms", "update_host_per_tensor_us", "anchor_write_GBps", "anchor_load_GBps")


def load_rates(path: str | Path = RATES_PATH) -> RatesFile:
    """The rates file (schema'd; every rate the model uses must be there)."""
    rates = load_yaml(RatesFile, path, RATES_SCHEMA_VERSION)
    missing = [n for n in RATE_NAMES if n not in rates.rates]
    if missing:
        from rltune.errors import MissingFieldError

        raise MissingFieldError(str(path), f"rates.{missing[0]}", "missing; rebuild the file with bench/build_sync_rates.py")
    return rates


def load_model_spec(path: str | Path) -> ModelSpec:
    """Read and validate a MODEL.yaml (schema_version 1); a bad field is one located line (exit 2)."""
    return load_yaml(ModelSpec, path, MODEL_SCHEMA_VERSION)


# ---------------------------------------------------------------------------------------------- intervals


@dataclass(frozen=True)
class Iv:
    """A non-negative interval [lo, hi]; arithmetic keeps every end at its extreme (all terms are monotone)."""

    lo: float
    hi: float

    @staticmethod
    def of(x: Any) -> Iv:
        if isinstance(x, Iv):
            return x
        if isinstance(x, (Range, Rate)):
            return Iv(float(x.min), float(x.max))
        return Iv(float(x), float(x))

    def __add__(self, o: Any) -> Iv:
        o = Iv.of(o)
        return Iv(self.lo + o.lo, self.hi + o.hi)

    __radd__ = __add__

    def __mul__(self, o: Any) -> Iv:
        o = Iv.of(o)
        return Iv(self.lo * o.lo, self.hi * o.hi)

    __rmul__ = __mul__

    def __truediv__(self, o: Any) -> Iv:
        o = Iv.of(o)
        return Iv(self.lo / o.hi, self.hi / o.lo)

    def __rtruediv__(self, o: Any) -> Iv:
        return Iv.of(o) / self

    def minimum(self, o: Any) -> Iv:
        o = Iv.of(o)
        return Iv(min(self.lo, o.lo), min(self.hi, o.hi))

    def maximum(self, o: Any) -> Iv:
        o = Iv.of(o)
        return Iv(max(self.lo, o.lo), max(self.hi, o.hi))


def entropy_bits(p: float) -> float:
    """Binary entropy H(p) in bits per element."""
    if p <= 0 or p >= 1:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def bytes_per_change(p: float, ratio: float, value_bytes: float) -> float:
    """Payload bytes per change at changed fraction ``p``: ratio x (position entropy H(p)/p + value term)."""
    return ratio * (entropy_bits(p) / (8 * p) + value_bytes)


# ---------------------------------------------------------------------------------------------- the model


def _estimate_dtype(spec: ModelSpec, rates: RatesFile, dtype: str) -> dict[str, Any]:
    r = {name: Iv.of(rate) for name, rate in rates.rates.items()}
    n = spec.params_total
    e = DTYPE_BYTES[dtype]
    p = Iv.of(spec.changed_fraction)
    tr, en, st = spec.trainer, spec.engine, spec.storage
    ranks = tr.ranks
    # entries: one per (tensor, rank) that changed; an fp8 checkpoint's scale tensors rarely change (the
    # seed: 1-6 scale changes a step), so they add host work per tensor but no entries
    tensors = spec.tensors
    scales = spec.fp8_scale_tensors if dtype == "fp8" else 0
    dense_t = tensors - spec.expert_tensors
    expert_t_share = spec.expert_tensors / tensors
    expert_share = spec.expert_params / n
    dense_share = 1.0 - expert_share
    # what one engine worker holds, decodes and applies
    held = dense_share / en.tp + expert_share / (en.ep if en.ep > 1 else en.tp)
    decoded = dense_share + expert_share / en.ep
    tensors_decoded = dense_t + spec.expert_tensors / en.ep
    tensors_held = (dense_t + spec.expert_tensors / en.ep) + scales * (1 - expert_t_share + expert_t_share / en.ep)
    readers = en.engines * en.workers
    nodes = math.ceil(readers / en.readers_per_node)

    changes = p * n
    # payload: N x ratio x (H(p)/8 + p v), increasing in p, so each end of p gives an end of the payload
    payload = Iv(n * r["codec_over_bound"].lo * (entropy_bits(p.lo) / 8 + p.lo * r["value_bytes_per_change"].lo),
                 n * r["codec_over_bound"].hi * (entropy_bits(p.hi) / 8 + p.hi * r["value_bytes_per_change"].hi))
    entries = tensors * ranks
    framing = r["entry_framing_bytes"] * entries
    delta = payload + framing

    # trainer, per rank
    weights_gib = n * 2 / ranks / GIB  # the diff reads the trainer's bf16 weights (fp8: quantized from them)
    diff = r["diff_fused_ms_per_GiB" if tr.diff == "fused" else "diff_staged_ms_per_GiB"] * weights_gib / 1e3
    encode = changes / ranks / (r["encode_gpu_Mchanges_per_s"] * 1e6)
    write = delta / (Iv.of(st.write_GBps) * 1e9)  # all ranks write their parts at once
    host = (r["publish_per_call_ms"] + r["publish_per_tensor_ms"] * (tensors + scales)) / 1e3
    commit = write + host
    publish = encode + commit
    blocking = diff + publish

    # engine worker
    reader_bytes = payload * decoded + r["entry_framing_bytes"] * (tensors_decoded * ranks)
    node_bytes = (reader_bytes * min(en.readers_per_node, readers)).minimum(delta)
    traffic = node_bytes * nodes if st.node_cache else reader_bytes * readers
    fetch = traffic / (Iv.of(st.read_GBps) * 1e9)
    decode_changes = changes * decoded / (r["decode_Mchanges_per_s"] * 1e6)
    decode_entries = r["prefetch_per_entry_ms"] * (tensors_decoded * ranks) / 1e3
    decode = decode_changes + decode_entries
    engine_read = fetch + decode
    applied = changes * held
    apply = (r["apply_per_call_ms"] / 1e3) + applied * r["apply_ps_per_change"] / 1e12
    update_host = (r["update_host_per_call_ms"] / 1e3) + r["update_host_per_tensor_us"] * tensors_held / 1e6
    dispatch = Iv.of(en.pause_s) + apply + update_host

    # anchors
    anchor_bytes = Iv.of(n * e)
    per_rank_rate = r["anchor_write_GBps"].minimum(Iv.of(st.write_GBps) / ranks) * 1e9
    anchor_write = anchor_bytes / ranks / per_rank_rate
    held_bytes = anchor_bytes * held
    load_rate = r["anchor_load_GBps"].minimum(Iv.of(st.read_GBps) / en.workers) * 1e9
    anchor_load = held_bytes / load_rate
    anchor_traffic = anchor_bytes * (1 + spec.fresh_engines_per_interval)
    sustained = (delta + traffic) / Iv.of(spec.step_s) / 1e9 + \
        anchor_traffic / (Iv.of(spec.step_s) * spec.anchor_interval) / 1e9
    hidden = traffic / decode / 1e9

    values = {
        "changes_per_step_M": changes / 1e6,
        "delta_MiB": delta / MIB,
        "diff_in_step_s": diff,
        "encode_s": encode,
        "commit_s": commit,
        "trainer_publish_s": publish,
        "trainer_blocking_s": blocking,
        "changes_decoded_per_reader_M": changes * decoded / 1e6,
        "changes_applied_per_worker_M": applied / 1e6,
        "engine_read_s": engine_read,
        "dispatch_blocking_s": dispatch,
        "anchor_GiB": anchor_bytes / GIB,
        "anchor_write_s": anchor_write,
        "anchor_per_step_s": anchor_write / spec.anchor_interval,
        "anchor_load_s": anchor_load,
        "storage_read_GB_per_step": traffic / 1e9,
        "storage_GBps_sustained": sustained,
        "storage_GBps_read_hidden": hidden,
        "sync_critical_s": blocking + dispatch,
        "sync_serial_s": blocking + engine_read + dispatch,
        "full_sync_s": anchor_write + anchor_load,
    }
    terms = {  # the parts of the composite outputs, so a reader sees what dominates
        "trainer_publish_s": dict(encode_s=encode, write_s=write, host_s=host),
        "commit_s": dict(write_s=write, host_s=host),
        "sync_serial_s": dict(trainer_blocking_s=blocking, engine_read_s=engine_read, dispatch_blocking_s=dispatch),
        "sync_critical_s": dict(trainer_blocking_s=blocking, dispatch_blocking_s=dispatch),
        "full_sync_s": dict(anchor_write_s=anchor_write, anchor_load_s=anchor_load),
        "engine_read_s": dict(fetch_s=fetch, decode_changes_s=decode_changes, per_entry_s=decode_entries),
        "dispatch_blocking_s": dict(pause_s=Iv.of(en.pause_s), apply_kernel_s=apply, host_s=update_host),
        "delta_MiB": dict(payload_MiB=payload / MIB, framing_MiB=framing / MIB),
        "anchor_write_s": dict(per_rank_GB=anchor_bytes / ranks / 1e9, per_rank_GBps=per_rank_rate / 1e9),
        "anchor_load_s": dict(held_GB=held_bytes / 1e9, per_worker_GBps=load_rate / 1e9),
    }
    outputs = {}
    for name, (unit, doc) in OUTPUTS.items():
        v = values[name]
        out = dict(lo=v.lo, hi=v.hi, unit=unit, doc=doc)
        if name in terms:
            out["terms"] = {k: dict(lo=t.lo, hi=t.hi) for k, t in terms[name].items()}
        outputs[name] = out
    bpc = (bytes_per_change(p.hi, r["codec_over_bound"].lo, r["value_bytes_per_change"].lo),
           bytes_per_change(p.lo, r["codec_over_bound"].hi, r["value_bytes_per_change"].hi))
    layout = dict(readers=readers, nodes=nodes, entries_per_step=entries, entries_decoded_per_reader=tensors_decoded * ranks,
                  tensors=tensors + scales, tensors_held_per_worker=tensors_held, held_fraction=held, decoded_fraction=decoded, payload_bytes_per_change=bpc)
    return dict(outputs=outputs, layout=layout)


def _with_dependencies(spec: ModelSpec, rates: RatesFile, dtype: str) -> dict[str, Any]:
    """:func:`_estimate_dtype`, each output also naming the rates it depends on (found by moving each rate
    alone and seeing which outputs move) and, of those, the ones measured on the CPU only."""
    base = _estimate_dtype(spec, rates, dtype)
    deps: dict[str, list[str]] = {name: [] for name in OUTPUTS}
    for rate_name in RATE_NAMES:
        rate = rates.rates[rate_name]
        moved = replace(rate, min=rate.min * 1.5 + 1e-9, max=rate.max * 1.5 + 1e-9)
        other = _estimate_dtype(spec, replace(rates, rates={**rates.rates, rate_name: moved}), dtype)["outputs"]
        for name, out in base["outputs"].items():
            if any(not math.isclose(out[end], other[name][end], rel_tol=1e-9, abs_tol=0.0) for end in ("lo", "hi")):
                deps[name].append(rate_name)
    for name, out in base["outputs"].items():
        out["inputs"] = deps[name]
        out["cpu_only_inputs"] = [n for n in deps[name] if rates.rates[n].cpu_only]
    return base


def estimate(spec: ModelSpec, rates: RatesFile) -> dict[str, Any]:
    """Project the per-step costs of ``spec`` for each of its dtypes; check its published figures.

    Every output carries ``inputs`` (the rates it depends on) and ``cpu_only_inputs`` (those of them that
    no H200 record measures yet: the 2-core CPU's figure stands in), besides its range.
    """
    by_dtype = {d: _with_dependencies(spec, rates, d) for d in spec.dtypes}
    checks = []
    for pub in spec.published:
        if pub.dtype not in by_dtype:
            by_dtype[pub.dtype] = _with_dependencies(replace(spec, dtypes=[pub.dtype]), rates, pub.dtype)
        pred = by_dtype[pub.dtype]["outputs"][pub.output]
        lo, hi = pred["lo"], pred["hi"]
        within = hi >= pub.value.min / 2 and lo <= pub.value.max * 2
        mid_pred = math.sqrt(max(lo, 1e-12) * max(hi, 1e-12))
        mid_pub = math.sqrt(max(pub.value.min, 1e-12) * max(pub.value.max, 1e-12))
        checks.append(dict(output=pub.output, dtype=pub.dtype, unit=pred["unit"], published=dict(min=pub.value.min,
                           max=pub.value.max), predicted=dict(lo=lo, hi=hi), ratio=mid_pred / mid_pub,
                           within_2x=within, source=pub.source, setup=pub.setup, cause=pub.cause,
                           terms=pred.get("terms", {}), cpu_only_inputs=pred["cpu_only_inputs"]))
    used = sorted(RATE_NAMES)
    inputs = {n: dict(min=rates.rates[n].min, max=rates.rates[n].max, unit=rates.rates[n].unit,
                      machine=rates.rates[n].machine, cpu_only=rates.rates[n].cpu_only,
                      sources=[dict(record=s.record, git=s.git) for s in rates.rates[n].sources]) for n in used}
    cpu_only = [n for n in used if rates.rates[n].cpu_only]
    notes = [
        "ranges: each output with every input at its min/max end (rates: rltune/sync/data/rates.yaml, "
        f"version {rates.rates_version}; changed fraction, storage and engine pause from the MODEL.yaml)",
        "the GPU rates (diff, encode, apply + verify) are the H200's; measured on the H200's host: "
        + ", ".join(n for n in used if rates.rates[n].machine == "H200 host"),
    ]
    if cpu_only:
        notes.append(f"measured on the 2-core CPU only, standing in for the H200 host until a bench/sync_estimate_rates.py "
                     f"--device cuda record measures it: {', '.join(cpu_only)}; every output that depends on one names "
                     "it (cpu_only_inputs)")
    if "fp8" in by_dtype:
        notes.append("fp8: 1 byte an element on the wire and in anchors; the trainer's quantize-then-diff of fp8 "
                     "weights and fp8 value statistics were not measured (the bf16 diff rate and value term are used)")
    if spec.engine.pause_s.max == 0:
        notes.append("engine pause: 0 (the engine's own pause/resume is not measured by rltune; set engine.pause_s)")
    return dict(kind="rltune-sync-estimate", model=spec.name, params_total=spec.params_total,
                params_active=spec.params_active, rates_version=rates.rates_version, by_dtype=by_dtype,
                checks=checks, inputs=inputs, cpu_only_inputs=cpu_only, notes=notes)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 0.1:
        return f"{x:.2f}"
    if abs(x) >= 0.001:
        return f"{x:.3f}"
    return f"{x:.1e}"


def fmt_range(lo: float, hi: float) -> str:
    return _fmt(lo) if _fmt(lo) == _fmt(hi) else f"{_fmt(lo)} - {_fmt(hi)}"


def estimate_lines(result: dict[str, Any]) -> list[dict[str, str]]:
    """Display rows: one per output, a column per dtype; then the published checks."""
    dtypes = list(result["by_dtype"])
    rows = []
    for name, (unit, _) in OUTPUTS.items():
        row = {"output": f"{name} ({unit})"}
        for d in dtypes:
            o = result["by_dtype"][d]["outputs"][name]
            row[d] = fmt_range(o["lo"], o["hi"])
        cpu = sorted({n for d in dtypes for n in result["by_dtype"][d]["outputs"][name]["cpu_only_inputs"]})
        row["CPU-only inputs"] = ", ".join(cpu)
        rows.append(row)
    for c in result["checks"]:
        row = {"output": f"published {c['output']} ({c['dtype']})"}
        for d in dtypes:
            row[d] = ""
        row["CPU-only inputs"] = ", ".join(c["cpu_only_inputs"])
        row[dtypes[0]] = (f"{fmt_range(c['published']['min'], c['published']['max'])} vs predicted "
                          f"{fmt_range(c['predicted']['lo'], c['predicted']['hi'])}: {c['ratio']:.2f}x"
                          f"{'' if c['within_2x'] else ' (miss)'}")
        rows.append(row)
    return rows


__all__ = ["MACHINES", "OUTPUTS", "RATES_PATH", "EngineLayout", "Iv", "ModelSpec", "PublishedFigure", "Range",
           "Rate", "RatesFile", "StorageSpec", "TrainerLayout", "bytes_per_change", "entropy_bits", "estimate",
           "estimate_lines", "fmt_range", "load_model_spec", "load_rates"]
