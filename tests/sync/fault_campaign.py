"""A seeded fault campaign against sparse delta sync: every fault injected through files and the public API.

A real tiny Qwen3 trains with real AdamW steps and publishes through ``DeltaPublisher``. The engines
are one of two receivers (a *backend*): :data:`TOY`, ``ToyEngine`` workers (vLLM's packing and
slicing) behind a ``DeltaReceiver``, or :class:`VllmBackend`, one real vLLM engine driven through
``VllmReceiver`` (attached to each case's store, every call through ``collective_rpc``); every
fault runs unchanged against either. :func:`build_world`
publishes the timelines once: **A** (steps 0..7, anchors 0, 3, 6; steps 3..7 left after pruning),
**A+** (A continued to steps 8..10 over leftovers a crashed attempt left in each step directory),
and two resumed trainers that republish steps 4..6 from A's checkpoint of step 4: **B** (same run
id, new incarnation) and **C** (a new run id). Each entry of :data:`FAULTS` is one distinct fault:
it copies a store, brings an engine to a step, damages something, and names the public call to
make, what must happen (a typed error, a fallback, or the correct new weights), and the repair.

:func:`run_fault` runs one under a time limit and checks the outcome: **detected** (a typed error of
the expected kind, or a fallback the report names, or the correct result despite the fault),
never **silently wrong** (a call that returns with weights other than the trainer's), never a
**raw** exception (anything not an ``RltuneError``, or ``InternalSyncError``), never a **hang**;
``prefetch`` of the damaged step first, which must answer a bool. Then it repairs the damage (or
not, where the fault is permanent and a fallback is the answer) and calls again: **healed** when the
engine then holds the trainer's weights bit for bit (``torch.equal`` on every parameter; in a vLLM
engine on every checkpoint element it holds, through the index map vLLM's own loader recorded).

Each case is bounded: a timer interrupts it past :data:`CASE_TIMEOUT_S` (a hang), and the process's
data segment may grow by at most :data:`CASE_DATA_LIMIT_MIB` while it runs (``RLIMIT_DATA``: an
allocation past it fails inside the case, as a raw exception, instead of exhausting the machine).

Used by tests/sync/test_fault_campaign.py and tests/sync/test_vllm_campaign.py (one test per fault
and receiver) and bench/sync_faults.py (the table in docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from sync_helpers import Trainer, engine_cfg, make_receiver, reference_engine

from rltune.errors import RltuneError
from rltune.sync import codec
from rltune.sync import format as fmt
from rltune.sync import store as store_module
from rltune.sync.casting import CastTensorChangedError
from rltune.sync.kernels.reference import P31, as_bits, checksum2_ref, checksum_ref, unsigned
from rltune.sync.receiver import DeltaReceiver
from rltune.sync.store import BroadcastStore

CASE_TIMEOUT_S = 30.0  # per fault: the call under test, the repair and the healing call
CASE_RSS_GROWTH_MIB = 512  # per fault: growth of the process's peak resident memory (measured)
CASE_DATA_LIMIT_MIB = 1024  # per fault: growth of the data segment the kernel allows it (enforced)
# The trainer's model (about as many weights as sync_helpers' default): head_dim 32 and 128 positions are
# what vLLM's CPU attention and max_model_len need, so that one world serves both receivers; two query
# heads share one KV head, so qkv packing still differs in q and kv rows.
MODEL = dict(hidden=32, heads=2, head_dim=32, intermediate=64, max_positions=128)
TENSORS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight",
           "model.layers.1.self_attn.k_proj.weight"]


# What every error a fault raises must name: a file or directory of the store (a path), or the step.
NAMES_WHERE = re.compile(r"/|\bstep \d+|step-\d{12}")


class CaseTimeout(BaseException):
    """A fault's calls ran past CASE_TIMEOUT_S: counted as a hang. Not an ``Exception``, so that no
    ``except Exception`` on the way (a vLLM worker returns every exception as a result) can turn a hang
    into an error."""


# ------------------------------------------------------------------------------------------ the world


@dataclass
class World:
    """Stores published once, and the trainer's wire state at every (timeline, step)."""

    dir: Path
    stores: dict[str, Path]
    states: dict[tuple[str, int], dict[str, torch.Tensor]]
    cfg: Any
    m0: dict
    run_ids: dict[str, str]
    hf_dir: Path | None = None  # the trainer's model at step 0 as a Hugging Face checkpoint (what vLLM boots from)


def _snapshot(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tr.wire_state().items()}


def _leftovers(step_dir: Path, donor: Path, attempt: str) -> None:
    """What an attempt that died while publishing left: a part, a summary, temp files, a stale manifest."""
    step_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(donor / "rank-00000.delta", step_dir / "rank-00000.delta")
    shutil.copy(donor / "rank-00000.anchor" if (donor / "rank-00000.anchor").exists() else donor / "rank-00000.delta",
                step_dir / "rank-00000.anchor")
    summary = json.loads((donor / "rank-00000.json").read_text())
    (step_dir / "rank-00000.json").write_text(json.dumps(dict(summary, attempt=attempt)))
    (step_dir / ".rank-00000.delta.tmp-424242").write_bytes(b"half a part")
    (step_dir / ".manifest.json.tmp-424242").write_bytes(b'{"half": ')
    shutil.copy(donor / fmt.MANIFEST_NAME, step_dir / fmt.MANIFEST_NAME)


def build_world(base: Path) -> World:
    base.mkdir(parents=True, exist_ok=True)
    states: dict[tuple[str, int], dict] = {}
    root_a = base / "A"
    tr = Trainer(root_a, interval=3, run_id="run-a", incarnation="a0", kv_heads=1, model_kw=MODEL)
    m0 = tr.pub.publish(0)
    states["A", 0] = _snapshot(tr)
    hf_dir = base / "hf-0"
    tr.model.save_pretrained(hf_dir)
    at4 = None
    for s in range(1, 8):
        tr.train_step()
        tr.pub.publish(s)
        states["A", s] = _snapshot(tr)
        if s == 4:
            at4 = ({k: v.clone() for k, v in tr.model.state_dict().items()}, tr.opt.state_dict())
    stores = {"A": base / "A7"}
    shutil.copytree(root_a, stores["A"])
    # A+: A goes on over what a crashed attempt of each next step left (another incarnation's files)
    for s in (8, 9, 10):
        _leftovers(root_a / fmt.step_dir_name(s), root_a / fmt.step_dir_name(7), "dead" * 8)
        tr.train_step()
        tr.pub.publish(s)
        states["A", s] = _snapshot(tr)
    stores["A+"] = root_a
    # B and C: trainers resumed from A's checkpoint of step 4 republish 4..6 over a copy of A7
    for name, run_id in (("B", "run-a"), ("C", "run-c")):
        root = base / name
        shutil.copytree(stores["A"], root)
        rt = Trainer(root, interval=3, run_id=run_id, incarnation=name.lower() * 2, kv_heads=1, model_kw=MODEL)
        rt.model.load_state_dict(at4[0])
        rt.opt.load_state_dict(at4[1])
        rt.gen.manual_seed(100 + ord(name))  # other data than A's: other weights at 5 and 6
        rt.pub.publish(4)  # the first broadcast of a resumed trainer: a full checkpoint
        states[name, 4] = _snapshot(rt)
        for s in (5, 6):
            rt.train_step()
            rt.pub.publish(s)
            states[name, s] = _snapshot(rt)
        stores[name] = root
    return World(base, stores, states, engine_cfg(tr), m0, dict(A="run-a", B="run-a", C="run-c"), hf_dir)


# ------------------------------------------------------------------------------------------ file edits


def step_dir(root: Path, step: int) -> Path:
    return root / fmt.step_dir_name(step)


def load_raw_manifest(root: Path, step: int) -> dict:
    return json.loads((step_dir(root, step) / fmt.MANIFEST_NAME).read_text())


def write_manifest_raw(root: Path, step: int, manifest: Any) -> None:
    """Write any JSON as a step's manifest with a marker that vouches for it (size, CRC, attempt):
    what a reader must then refuse is the content, not the bytes."""
    d = step_dir(root, step)
    raw = json.dumps(manifest).encode()
    attempt = manifest.get("attempt") if isinstance(manifest, dict) else None
    marker = dict(format_version=fmt.FORMAT_VERSION, step=step,
                  attempt=attempt if isinstance(attempt, str) and fmt.ATTEMPT_RE.match(attempt) else "0" * 16,
                  manifest_bytes=len(raw), manifest_crc32=fmt.crc32(raw))
    (d / fmt.MANIFEST_NAME).write_bytes(raw)
    (d / fmt.COMPLETE_NAME).write_text(json.dumps(marker))


def rewrite_part(root: Path, step: int, kind: str, edit: Callable[[dict, bytes], bytes | None]) -> None:
    """Re-encode a step's rank-0 part with ``edit(entry, blob)`` applied to each entry (None drops it),
    every CRC recomputed and the manifest's size fixed: the bytes all check, the content is wrong."""
    path = step_dir(root, step) / fmt.part_file_name(0, kind)
    header, start = fmt.read_part_header(path)
    raw = path.read_bytes()[start:]
    entries, blobs, off = [], [], 0
    for e in header["entries"]:
        blob = edit(dict(e), raw[e["offset"]:e["offset"] + e["length"]])
        if blob is None:
            continue
        e = dict(e, offset=off, length=len(blob))
        if kind == "delta":
            e["crc32"] = fmt.crc32(blob)
            try:  # an edit that adds or removes changes: the header counts them
                e["changes"] = len(codec.decode(blob, e["start"], e["stop"])[0])
            except fmt.CodecError:
                pass  # a damaged stream keeps its count: the decoder is what must refuse it
        else:
            e["crc32s"] = [fmt.crc32(blob[j:j + e["crc_block"]]) for j in range(0, max(1, len(blob)), e["crc_block"])]
        entries.append(e)
        blobs.append(blob)
        off += len(blob)
    header = {k: v for k, v in header.items() if k != "payload_len"}
    path.write_bytes(fmt.encode_part(dict(header, entries=entries), b"".join(blobs)))
    m = load_raw_manifest(root, step)
    for f in m["parts" if kind == "delta" else "anchors"]:
        if f["rank"] == 0:
            f["bytes"] = path.stat().st_size
    write_manifest_raw(root, step, m)


def _bits_of(state: dict, name: str) -> np.ndarray:
    return unsigned(as_bits(state[name].contiguous())).numpy()


def cancelling_positions(rng: np.random.Generator, u: np.ndarray, pattern: str) -> dict[int, int]:
    """Element -> unsigned change whose position-weighted sum is 0: "pair" is +2 at i and -1 at 2i+1,
    "cubic" is (+1, -3, +3, -1) on four neighbours; chosen where no value wraps."""
    n = len(u)
    for _ in range(10_000):
        if pattern == "pair":
            i = int(rng.integers(0, (n - 1) // 2))
            edit = {i: 2, 2 * i + 1: -1}
        else:
            j = int(rng.integers(0, n - 4))
            edit = {j: 1, j + 1: -3, j + 2: 3, j + 3: -1}
        if all(0 <= int(u[k]) + d < 1 << 16 for k, d in edit.items()):
            assert sum((k + 1) * d for k, d in edit.items()) == 0
            return edit
    raise AssertionError("no position without wrap-around found")


def cancel_in_delta(root: Path, step: int, name: str, want: dict, rng: np.random.Generator, pattern: str) -> None:
    """Make step's delta land ``name`` on the trainer's values plus a cancelling edit."""
    u = _bits_of(want, name)
    edit = cancelling_positions(rng, u, pattern)
    before_c1 = checksum_ref(torch.from_numpy(u.astype(np.int32)))

    def change(e, blob):
        if e["name"] != name:
            return blob
        idx, diff = codec.decode(blob, e["start"], e["stop"], 16)
        merged = dict(zip(idx.tolist(), diff.tolist(), strict=True))
        for k, d in edit.items():
            merged[k] = merged.get(k, 0) + d
            if merged[k] == 0:
                del merged[k]
        keys = sorted(merged)
        vals = np.array([((merged[k] + (1 << 15)) % (1 << 16)) - (1 << 15) for k in keys], dtype=np.int64)
        return codec.encode(np.array(keys, dtype=np.int64), vals, 16, e["start"], e["stop"])

    rewrite_part(root, step, "delta", change)
    edited = u.astype(np.int32).copy()
    for k, d in edit.items():
        edited[k] += d
    assert checksum_ref(torch.from_numpy(edited)) == before_c1, "the edit must pass the position-weighted checksum"
    assert checksum2_ref(torch.from_numpy(edited)) != checksum2_ref(torch.from_numpy(u.astype(np.int32)))


def cancel_in_anchor(root: Path, step: int, name: str, rng: np.random.Generator, pattern: str) -> None:
    def change(e, blob):
        if e["name"] != name:
            return blob
        u = np.frombuffer(blob, dtype="<u2").astype(np.int32)
        edit = cancelling_positions(rng, u, pattern)
        out = u.copy()
        for k, d in edit.items():
            out[k] += d
        assert checksum_ref(torch.from_numpy(out)) == checksum_ref(torch.from_numpy(u))
        return out.astype("<u2").tobytes()

    rewrite_part(root, step, "anchor", change)


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= mask
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------ one fault


@dataclass
class Trial:
    """What a fault asks of the receiver, and what must come of it."""

    rx: Any
    engine: Any
    op: Callable[[], Any]  # the public call under test
    expect: str  # "error" (a typed error of ``errors``), "fallback" or "correct"
    want: tuple[str, int]  # the trainer's weights the engine must end with (timeline, step)
    errors: tuple[type, ...] = ()
    prefetch_step: int | None = None  # prefetch this first: it must answer a bool, whatever the step holds
    keeps: tuple[str, int] | None = None  # an error before any write leaves these weights and a valid engine
    correct_ok: bool = False  # "error" faults that may also leave every value intact (a flip the codec maps back)
    match: str | None = None  # a regular expression the error's message must contain
    repair: Callable[[], None] | None = None
    heal: Callable[[], Any] | None = None  # the call after the repair (default: ``op`` again)


@dataclass
class Fault:
    name: str
    klass: str  # republish, uncovered, leftovers, cancelling, typed, fallback, store, layout, cast
    make: Callable[[Case], Trial]
    seed: int = 0


@dataclass
class Outcome:
    name: str
    klass: str
    result: str  # detected, silently_wrong, raw, hang, unexpected
    detail: str
    healed: bool
    seconds: float
    rss_growth_mib: float
    prefetch_ok: bool = True
    receiver: str = "toy"


# ------------------------------------------------------------------------------------------ the receivers


class ToyBackend:
    """``ToyEngine`` workers behind a ``DeltaReceiver``: a fresh engine per case."""

    name = "toy"

    def receiver(self, case: Case, root: Path, manifest: dict):
        return make_receiver(root, case.world.cfg, manifest)

    @staticmethod
    def verify_held(rx) -> str:
        """Both checksums recomputed from every parameter, against the step held."""
        rx.recompute_shares()
        rx.verify(rx.step)
        return "verified"


    def moved_engine(self, case: Case, root: Path, transform: str):
        """A fresh engine that booted from A's step 0 and then moved its weights (:func:`transform_gate_up`),
        its receiver, and the call that attaches it: the layout check, then the latest step."""
        engine, rx = make_receiver(root, case.world.cfg, case.world.m0)
        engine.load_weights(case.state("A", 0).items())
        transform_gate_up(engine, transform)
        boot = case.state("A", 0)
        view = MovedToyView(engine, case.world.cfg, transform)
        source = f"{root} (step 0, what the engine booted from)"
        checked = []

        def attach():  # as a vLLM worker does: the layout is checked at the first attach, while it holds boot weights
            if not checked:
                rx.check_layout(boot.__getitem__, source)
                checked.append(True)
            return rx.load_latest()
        return view, rx, attach

    def restart_plain(self, case: Case, root: Path, view: MovedToyView) -> Callable[[], Any]:
        """The engine started again without its transform: undo it, and attach (check + latest step)."""
        transform_gate_up(view.engine, view.transform, undo=True)
        view.transform = None
        _, rx = make_receiver(root, case.world.cfg, case.world.m0)
        rx2 = DeltaReceiver(root, view.engine, rx.imap)
        return lambda: (rx2.check_layout(case.state("A", 0).__getitem__), rx2.load_latest())[1]


TOY = ToyBackend()


@torch.no_grad()
def transform_gate_up(engine, transform: str | None, undo: bool = False) -> None:
    """What a kernel backend does to every ``gate_up_proj`` after loading: ``swap`` its gate and up halves
    (a block move), or ``scale`` it by 2 (a change of values)."""
    for layer in engine.model.layers:
        w = layer.mlp.gate_up_proj.weight
        half = w.shape[0] // 2
        if transform == "swap":
            w.copy_(torch.cat((w[half:], w[:half])))
        elif transform == "scale":
            w.mul_(0.5 if undo else 2.0)


class MovedToyView:
    """A toy engine whose kernels read a transformed layout: it holds a step when it holds that step's
    weights as a fresh engine would after the same transform."""

    def __init__(self, engine, cfg, transform: str | None):
        self.engine, self.cfg, self.transform = engine, cfg, transform

    def holds(self, state: dict) -> bool:
        ref = reference_engine(self.cfg, state)
        transform_gate_up(ref, self.transform)
        got, exp = dict(self.engine.named_parameters()), dict(ref.named_parameters())
        return all(torch.equal(got[n], exp[n]) for n in got)


class VllmEngineView:
    """The weights of the vLLM engine a case drives: checked and edited through each worker's index map."""

    def __init__(self, llm):
        self.llm = llm

    def holds(self, state: dict) -> bool:
        from vllm_helpers import held_differences

        return not any(self.llm.collective_rpc(held_differences, args=(state,)))


class VllmCaseReceiver:
    """What a fault calls, mapped onto ``VllmReceiver``'s public calls: ``apply`` is ``update``,
    ``load_latest`` is ``attach`` (a relaunched engine), ``prefetch`` is ``prepare``. A case starts with
    ``attach(load=False)`` to its store: a fresh engine that holds no step yet. Setup that reaches
    into the worker (its store's caches, a hook before the first write) goes to the in-process worker's
    own receiver (:attr:`inner`)."""

    def __init__(self, llm, root: Path, timeout_s: float, load: bool = False):
        from rltune.sync.vllm import VllmReceiver

        self.llm = llm
        self.vrx = VllmReceiver(llm, str(root), timeout_s=timeout_s)
        (r,) = self.vrx.attach(load=load)
        self.report = _AttachReport(r["action"], r["step"], r["anchor"], list(r["deltas"]), list(r["fallbacks"]))

    def _state(self):
        (state,) = self.llm.collective_rpc(lambda worker: worker._rltune_state)
        return state

    @property
    def inner(self):
        return self._state().receiver

    @property
    def valid(self) -> bool:
        return self.inner.valid

    @property
    def step(self) -> int | None:
        return self.inner.step if self.inner.valid else None

    @property
    def store(self):
        return self.inner.store

    @property
    def before_write(self):
        return self.inner.before_write

    @before_write.setter
    def before_write(self, hook: Callable[[], None]) -> None:
        guard = self._state().guard

        def both():
            guard()
            hook()
        self.inner.before_write = both

    def apply(self, step: int, wait_s: float = 0.0):
        return self.vrx.update(step, wait_s=wait_s)

    def load_latest(self):
        (r,) = self.vrx.attach()
        return _AttachReport(r["action"], r["step"], r["anchor"], list(r["deltas"]), list(r["fallbacks"]))

    def prefetch(self, step: int) -> bool:
        """``prepare`` (which must not raise), then the worker's thread joined: whether it staged the step."""
        self.vrx.prepare(step)
        state = self._state()
        if state._prefetch is None:
            return False
        _, thread, result = state._prefetch
        thread.join(CASE_TIMEOUT_S)
        return bool(result.get("prefetched"))

    @staticmethod
    def verify_held(rx) -> str:
        rx.vrx.check_weights()
        return "verified"


class _Attaching:
    """The receiver of a vLLM case whose call under test is the attach itself (valid once it attached)."""

    def __init__(self, holder: dict):
        self.holder = holder

    @property
    def valid(self) -> bool:
        rx = self.holder.get("rx")
        return rx is not None and rx.valid


@dataclass
class _AttachReport:
    action: str
    step: int
    anchor: int | None
    deltas: list[int]
    fallbacks: list[dict[str, Any]]


class VllmBackend:
    """One real vLLM engine (in this process) that every case attaches to its own store."""

    name = "vllm"
    timeout_s = CASE_TIMEOUT_S - 5  # a worker's bounded waits end before the case's own limit

    def __init__(self, llm):
        self.llm = llm

    @classmethod
    def start(cls, world: World) -> VllmBackend:
        from vllm_helpers import start_engine

        return cls(start_engine(world.hf_dir))

    def receiver(self, case: Case, root: Path, manifest: dict):
        return VllmEngineView(self.llm), VllmCaseReceiver(self.llm, root, self.timeout_s)

    def moved_engine(self, case: Case, root: Path, transform: str):
        """A fresh engine booted from A's step 0 whose gate/up kernel moves its weights after loading (a
        registered Qwen3 variant, ``vllm_helpers.register_transformed_qwen3``), and the call that attaches
        it (the layout check runs at a worker's first attach), then loads the latest step."""
        from vllm_helpers import as_architecture, register_transformed_qwen3, start_engine

        arch = f"{transform.capitalize()}GateUpQwen3ForCausalLM"
        register_transformed_qwen3(arch, transform)
        llm = start_engine(as_architecture(case.world.hf_dir, arch, case.scratch(arch)))
        holder: dict[str, VllmCaseReceiver] = {}

        def attach():
            holder["rx"] = VllmCaseReceiver(llm, root, self.timeout_s, load=True)
            return holder["rx"].report
        return VllmEngineView(llm), _Attaching(holder), attach

    def restart_plain(self, case: Case, root: Path, view: VllmEngineView) -> Callable[[], Any]:
        """The engine started again as a plain Qwen3, and attached."""
        from vllm_helpers import start_engine

        view.llm = start_engine(case.world.hf_dir)
        return lambda: VllmCaseReceiver(view.llm, root, self.timeout_s, load=True).report

    @staticmethod
    def verify_held(rx) -> str:
        return VllmCaseReceiver.verify_held(rx)


def edit_held(rx, name: str, want: dict, edit: dict[int, int]) -> None:
    """Add ``edit`` (checkpoint element -> change of its unsigned bits) to the engine's own memory, where
    the engine holds checkpoint tensor ``name`` (whose values are ``want[name]``): a stray write."""
    inner = getattr(rx, "inner", rx)
    u = _bits_of(want, name)
    idx = np.array(sorted(edit), dtype=np.int64)
    held, pid, pos = inner.imap.tensors[name].locate(idx)
    assert held.all(), f"the engine does not hold all of {name}"
    with torch.no_grad():
        for k, p, q in zip(idx.tolist(), pid.tolist(), pos.tolist(), strict=True):
            bits = as_bits(inner.params[p].data)
            bits.view(-1)[q] = int(((int(u[k]) + edit[k] + (1 << 15)) % (1 << 16)) - (1 << 15))


@dataclass
class Case:
    """What a fault builds with: fresh copies of the world's stores, receivers, the trainer's states."""

    world: World
    tmp: Path
    rng: np.random.Generator
    copies: list[Path] = field(default_factory=list)
    backend: Any = TOY

    def scratch(self, label: str) -> Path:
        """A path of this case's own (nothing there yet), removed when the case ends."""
        path = self.tmp / f"{label}-{len(self.copies)}"
        self.copies.append(path)
        return path

    def store(self, name: str = "A") -> Path:
        root = self.scratch(name)
        shutil.copytree(self.world.stores[name], root, symlinks=True)
        return root

    def receiver(self, root: Path, at: int | None = None, manifest: dict | None = None):
        """A fresh engine on ``root`` (whose tensors ``manifest`` describes; default the world's), brought to
        ``at`` if given."""
        engine, rx = self.backend.receiver(self, root, manifest or self.world.m0)
        if at is not None:
            rx.apply(at)
            assert rx.valid and rx.step == at
        return engine, rx

    def state(self, timeline: str, step: int) -> dict:
        return self.world.states[timeline, step]

    def replace_with(self, root: Path, name: str) -> None:
        """The trainer republished: the store's step directories become those of another timeline."""
        for d in root.iterdir():
            if fmt.parse_step_dir_name(d.name) is not None:
                shutil.rmtree(d)
        for d in self.world.stores[name].iterdir():
            if fmt.parse_step_dir_name(d.name) is not None:
                shutil.copytree(d, root / d.name)


def same_weights(world: World, engine, want: tuple[str, int]) -> bool:
    if hasattr(engine, "holds"):
        return engine.holds(world.states[want])
    ref = reference_engine(world.cfg, world.states[want])
    got, exp = dict(engine.named_parameters()), dict(ref.named_parameters())
    return got.keys() == exp.keys() and all(torch.equal(got[n], exp[n]) for n in got)


def _alarm(seconds: float):
    """Raise CaseTimeout in the main thread after ``seconds``; the returned function cancels it and gives
    back an outer alarm (pytest-timeout's) what was left of its time."""
    def fire(signum, frame):
        raise CaseTimeout(f"ran past {seconds:.0f} s")
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, outer_left - (time.monotonic() - start)))
    return cancel


def _classify(trial: Trial, world: World, call: Callable[[], Any]) -> tuple[str, str, Any]:
    try:
        report = call()
    except CaseTimeout:
        raise
    except fmt.InternalSyncError as e:
        return "raw", f"InternalSyncError: {e}", None
    except RltuneError as e:
        if trial.expect != "error":
            return "unexpected", f"{type(e).__name__}: {e}", None
        if trial.errors and not isinstance(e, trial.errors):
            return "unexpected", f"{type(e).__name__} (expected {[c.__name__ for c in trial.errors]}): {e}", None
        if trial.match is not None and not re.search(trial.match, str(e)):
            return "unexpected", f"{type(e).__name__} without {trial.match!r}: {e}", None
        if not NAMES_WHERE.search(str(e)):
            return "unexpected", f"{type(e).__name__} names no step, file or field: {e}", None
        # a checksum mismatch is found after writing, so it leaves the engine invalid by design; any other
        # error of a fault with ``keeps`` is found before the first write and leaves the engine as it was
        if trial.keeps is not None and not isinstance(e, fmt.ChecksumMismatchError) \
                and not (trial.rx.valid and same_weights(world, trial.engine, trial.keeps)):
            return "unexpected", f"{type(e).__name__} left the engine changed or invalid: {e}", None
        return "detected", type(e).__name__, None
    except Exception as e:  # noqa: BLE001 - what the campaign exists to find
        return "raw", f"{type(e).__name__}: {e}", None
    if not same_weights(world, trial.engine, trial.want):
        return "silently_wrong", f"returned {getattr(report, 'action', report)!r} with weights other than {trial.want}", \
            report
    if trial.expect == "fallback":
        if not getattr(report, "fallbacks", None):
            return "unexpected", "correct, but the report names no fallback", report
        if trial.match is not None and not any(re.search(trial.match, f["message"]) for f in report.fallbacks):
            return "unexpected", f"fell back, but not for {trial.match!r}: {report.fallbacks}", report
        return "detected", "fallback from " + ", ".join(f"{f['anchor']}:{f['error']}" for f in report.fallbacks), report
    if trial.expect == "error" and not trial.correct_ok:
        return "unexpected", f"no error: {getattr(report, 'action', report)!r}", report
    return "detected", f"correct ({getattr(report, 'action', report)})", report


def _data_limit(mib: int):
    """Let the data segment grow by at most ``mib`` MiB from now (soft ``RLIMIT_DATA``); the returned
    function restores the limit. Nothing where the platform has no such limit."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        vm_data_kib = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                           if line.startswith("VmData:"))
    except (AttributeError, OSError, StopIteration, ValueError):
        return lambda: None
    limit = vm_data_kib * 1024 + (mib << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def run_fault(fault: Fault, world: World, tmp: Path, backend: Any = TOY) -> Outcome:
    """One fault against one receiver, bounded in time (CASE_TIMEOUT_S) and memory (CASE_DATA_LIMIT_MIB),
    its peak memory growth measured."""
    t0 = time.perf_counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    case = Case(world, tmp, np.random.default_rng(fault.seed), backend=backend)
    cancel = _alarm(CASE_TIMEOUT_S)
    unlimit = _data_limit(CASE_DATA_LIMIT_MIB)
    prefetch_ok, healed = True, False
    try:
        trial = fault.make(case)
        if trial.prefetch_step is not None:
            try:
                prefetch_ok = isinstance(trial.rx.prefetch(trial.prefetch_step), bool)
            except CaseTimeout:
                raise
            except Exception:  # noqa: BLE001 - prefetch must never raise
                prefetch_ok = False
        result, detail, _ = _classify(trial, world, trial.op)
        if result not in ("raw", "silently_wrong"):
            if trial.repair is not None:
                trial.repair()
            heal = trial.heal or trial.op
            try:
                heal()
                healed = same_weights(world, trial.engine, trial.want)
            except CaseTimeout:
                raise
            except Exception as e:  # noqa: BLE001
                detail += f"; healing call failed: {type(e).__name__}: {e}"
    except CaseTimeout as e:
        result, detail = "hang", str(e)
    finally:
        unlimit()
        cancel()
        for root in case.copies:
            shutil.rmtree(root, ignore_errors=True)
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return Outcome(fault.name, fault.klass, result, detail, healed, time.perf_counter() - t0, growth, prefetch_ok,
                   backend.name)


def assert_passed(outcome: Outcome) -> None:
    """What every fault must come to: detected, prefetch within its contract, healed, bounded memory."""
    assert outcome.result == "detected", outcome
    assert outcome.prefetch_ok, f"prefetch raised past its contract: {outcome}"
    assert outcome.healed, outcome
    assert outcome.rss_growth_mib < CASE_RSS_GROWTH_MIB, outcome


# ------------------------------------------------------------------------------------------ the faults

FAULTS: list[Fault] = []


def fault(klass: str, *names_and_seeds):
    """Register ``make`` under each (name, seed), or once under its own name."""
    def register(make):
        pairs = names_and_seeds or [(make.__name__.removeprefix("f_"), 0)]
        for name, seed in pairs:
            FAULTS.append(Fault(name, klass, make, seed))
        return make
    return register


# ---- 1. republished steps ---------------------------------------------------------------------

def _republished(held: int | None, target: int, timeline: str, prefetch: bool = False, manifest_first: bool = False):
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=held)
        if prefetch:
            assert rx.prefetch(target)  # staged from the timeline about to be replaced
        if manifest_first:
            rx.store.manifest(target)  # cached
        case.replace_with(root, timeline)
        return Trial(rx, engine, lambda: rx.apply(target), "correct", (timeline, target))
    return make


for _tl in ("B", "C"):
    for _held, _target in ((5, 5), (4, 5), (4, 4), (6, 6), (6, 5), (3, 6), (None, 6)):
        FAULTS.append(Fault(f"republished-{_tl}-held{_held}-asks{_target}", "republish",
                            _republished(_held, _target, _tl)))
    FAULTS.append(Fault(f"republished-{_tl}-prefetched-before", "republish", _republished(4, 5, _tl, prefetch=True)))
    FAULTS.append(Fault(f"republished-{_tl}-manifest-cached", "republish", _republished(5, 6, _tl, manifest_first=True)))


@fault("republish")
def f_republished_step_above_the_resume_point_is_not_ready_until_written_again(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=7)
    case.replace_with(root, "B")  # B resumed at 4 and has written up to 6: A's 7 is gone

    def heal():
        # B publishes its own 7 later; here: the engine moves to B's latest instead
        return rx.load_latest()
    return Trial(rx, engine, lambda: rx.apply(7), "error", ("B", 6), errors=(fmt.StepNotReadyError,), keeps=("A", 7),
                 heal=heal)


@fault("republish")
def f_a_fresh_engine_after_a_republish_loads_the_new_timeline(case: Case) -> Trial:
    root = case.store("A")
    case.replace_with(root, "C")
    engine, rx = case.receiver(root)
    return Trial(rx, engine, rx.load_latest, "correct", ("C", 6))


# ---- 2. tensors no manifest covers -------------------------------------------------------------

def _manifest_edit(step: int, mutate, errors, held: int = 5):
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=held)
        d = step_dir(root, step)
        saved = {n: (d / n).read_bytes() for n in (fmt.MANIFEST_NAME, fmt.COMPLETE_NAME)}
        m = load_raw_manifest(root, step)
        mutate(m, case.rng)
        write_manifest_raw(root, step, m)

        def repair():
            for n, data in saved.items():
                (d / n).write_bytes(data)
        return Trial(rx, engine, lambda: rx.apply(step), "error", ("A", step), errors=errors, prefetch_step=step,
                     keeps=("A", held), repair=repair)
    return make


def _drop_tensor(name):
    return lambda m, rng: m["tensors"].pop(name)


def _add_tensor(m, rng):
    m["tensors"]["model.extra.weight"] = dict(dtype="bfloat16", shape=[4, 4], checksum="0", checksum2="0", tied_to=None)


def _rename_tensor(m, rng):
    m["tensors"]["model.renamed.weight"] = m["tensors"].pop("model.norm.weight")


def _reshape(name):
    def mutate(m, rng):
        a, b = m["tensors"][name]["shape"]
        m["tensors"][name]["shape"] = [b, a]
    return mutate


def _retype(name, dtype):
    def mutate(m, rng):
        m["tensors"][name]["dtype"] = dtype
    return mutate


for _name in TENSORS[:3]:
    FAULTS.append(Fault(f"manifest-lacks-{_name}", "uncovered", _manifest_edit(6, _drop_tensor(_name),
                                                                               (fmt.IndexMapError,))))
FAULTS.append(Fault("manifest-adds-a-tensor", "uncovered", _manifest_edit(6, _add_tensor, (fmt.IndexMapError,))))
FAULTS.append(Fault("manifest-renames-a-tensor", "uncovered", _manifest_edit(6, _rename_tensor, (fmt.IndexMapError,))))
FAULTS.append(Fault("manifest-transposes-a-shape", "uncovered",
                    _manifest_edit(6, _reshape(TENSORS[1]), (fmt.IndexMapError,))))
FAULTS.append(Fault("manifest-changes-a-dtype-to-fp16", "uncovered",
                    _manifest_edit(6, _retype(TENSORS[0], "float16"), (fmt.IndexMapError,))))
FAULTS.append(Fault("manifest-changes-a-dtype-to-fp32", "uncovered",
                    _manifest_edit(7, _retype("model.norm.weight", "float32"), (fmt.IndexMapError,))))


def _anchor_edit(edit_for, name, expect="fallback"):
    """Damage the latest anchor (step 6) of one tensor; a fresh engine falls back to anchor 3 + 4, 5, 6, 7."""
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root)
        saved = {p.name: p.read_bytes() for p in step_dir(root, 6).iterdir()}
        edit_for(case, root, name)

        def repair():
            for n, data in saved.items():
                (step_dir(root, 6) / n).write_bytes(data)
        return Trial(rx, engine, rx.load_latest, expect, ("A", 7), repair=repair)
    return make


def _drop_entry(case, root, name):
    rewrite_part(root, 6, "anchor", lambda e, blob: None if e["name"] == name else blob)


def _short_range(case, root, name):
    def edit(e, blob):
        if e["name"] != name:
            return blob
        return blob  # same bytes; the entry's stop is changed below
    rewrite_part(root, 6, "anchor", edit)
    path = step_dir(root, 6) / "rank-00000.anchor"
    header, start = fmt.read_part_header(path)
    payload = path.read_bytes()[start:]
    entries = []
    for e in header["entries"]:
        if e["name"] == name:
            e = dict(e, stop=e["stop"] - 8, length=e["length"] - 16)
            e["crc32s"] = [fmt.crc32(payload[e["offset"]:e["offset"] + e["length"]])]
        entries.append(e)
    header = {k: v for k, v in header.items() if k != "payload_len"}
    path.write_bytes(fmt.encode_part(dict(header, entries=entries), payload))
    m = load_raw_manifest(root, 6)
    m["anchors"][0]["bytes"] = path.stat().st_size
    write_manifest_raw(root, 6, m)


def _length_field(delta_bytes):
    def edit_for(case, root, name):
        path = step_dir(root, 6) / "rank-00000.anchor"
        header, start = fmt.read_part_header(path)
        payload = path.read_bytes()[start:]
        entries = []
        for e in header["entries"]:
            if e["name"] == name:
                e = dict(e, length=e["length"] + delta_bytes)
                block = payload[e["offset"]:e["offset"] + e["length"]]
                e["crc32s"] = [fmt.crc32(block[j:j + e["crc_block"]]) for j in range(0, len(block), e["crc_block"])]
            entries.append(e)
        header = {k: v for k, v in header.items() if k != "payload_len"}
        # a long entry reads into the next entry's bytes; a short one leaves a gap before it
        path.write_bytes(fmt.encode_part(dict(header, entries=entries), payload))
        m = load_raw_manifest(root, 6)
        m["anchors"][0]["bytes"] = path.stat().st_size
        write_manifest_raw(root, 6, m)
    return edit_for


for _name in (TENSORS[0], TENSORS[2], "model.norm.weight"):
    FAULTS.append(Fault(f"anchor-lacks-{_name}", "uncovered", _anchor_edit(_drop_entry, _name)))
FAULTS.append(Fault("anchor-covers-a-tensor-short", "uncovered", _anchor_edit(_short_range, TENSORS[1])))
FAULTS.append(Fault("anchor-entry-length-short", "typed", _anchor_edit(_length_field(-2), TENSORS[0])))
FAULTS.append(Fault("anchor-entry-length-long", "typed", _anchor_edit(_length_field(+2), TENSORS[4])))


# ---- 3. leftovers of a crashed attempt ---------------------------------------------------------

def _over_leftovers(target: int):
    def make(case: Case) -> Trial:
        root = case.store("A+")
        engine, rx = case.receiver(root, at=7)

        def op():
            report = rx.apply(target)
            left = sorted(os.listdir(step_dir(root, target)))
            kind = load_raw_manifest(root, target)["kind"]
            want = {"COMPLETE", "manifest.json", "rank-00000.json"} | (
                {"rank-00000.delta"} if kind != "full" else set()) | ({"rank-00000.anchor"} if kind != "delta" else set())
            assert set(left) == want, f"leftovers of the dead attempt remain: {sorted(set(left) - want)}"
            return report
        return Trial(rx, engine, op, "correct", ("A", target))
    return make


for _t in (8, 9, 10):
    FAULTS.append(Fault(f"crashed-attempt-leftovers-under-step-{_t}", "leftovers", _over_leftovers(_t)))


def _foreign_part(kind: str, donor_timeline: str, donor_step: int):
    """A part of another attempt of the same step (a dead attempt's, or a republish racing the
    reader), of another run, or of another step, under this manifest, its size made to match."""
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=4 if kind == "delta" else None)
        step = 5 if kind == "delta" else 6
        donor = step_dir(case.world.stores[donor_timeline], donor_step)
        name = fmt.part_file_name(0, kind)
        path = step_dir(root, step) / name
        saved = {p.name: p.read_bytes() for p in step_dir(root, step).iterdir()}
        shutil.copy(donor / name, path)
        m = load_raw_manifest(root, step)
        m["parts" if kind == "delta" else "anchors"][0]["bytes"] = path.stat().st_size
        write_manifest_raw(root, step, m)

        def repair():
            for n, data in saved.items():
                (step_dir(root, step) / n).write_bytes(data)
        if kind == "delta":
            return Trial(rx, engine, lambda: rx.apply(5), "error", ("A", 5), errors=(fmt.WrongStepError,),
                         prefetch_step=5, keeps=("A", 4), repair=repair)
        return Trial(rx, engine, rx.load_latest, "fallback", ("A", 7), repair=repair)
    return make


FAULTS.append(Fault("part-of-another-attempt-same-run", "leftovers", _foreign_part("delta", "B", 5)))
FAULTS.append(Fault("part-of-another-run", "leftovers", _foreign_part("delta", "C", 5)))
FAULTS.append(Fault("part-of-another-step", "leftovers", _foreign_part("delta", "A", 6)))
FAULTS.append(Fault("anchor-of-another-attempt", "leftovers", _foreign_part("anchor", "B", 6)))
FAULTS.append(Fault("anchor-of-another-run", "leftovers", _foreign_part("anchor", "C", 6)))


@fault("leftovers")
def f_a_dead_rank_summary_is_never_taken_for_the_new_attempts(case: Case) -> Trial:
    # two trainer ranks; rank 1 of an incarnation that died wrote its part and summary of step 1 (other
    # weights), its rank 0 never finalized. The new incarnation's rank 0 starts finalizing step 1 before
    # its rank 1 has written: it must wait past the dead summary for rank 1's own
    root = case.scratch("two-ranks")
    dead = Trainer(root, interval=10, rank=1, world=2, run_id="two", incarnation="dead", kv_heads=1, model_kw=MODEL)
    with torch.no_grad():
        for p in dead.model.parameters():
            p.mul_(1.5)
    dead.pub.publish(1)  # rank 1 only: rank 0 of that incarnation died before finalizing
    new = [Trainer(root, interval=10, rank=r, world=2, run_id="two", incarnation="new", kv_heads=1, model_kw=MODEL)
           for r in (0, 1)]
    done: dict[str, Any] = {}

    written = threading.Event()  # rank 0 wrote its summary and now waits for rank 1's
    real_write = store_module.write_rank_files

    def write_rank_files(step_dir_, rank, files, summary):
        real_write(step_dir_, rank, files, summary)
        if rank == 0:
            written.set()

    def rank0():
        try:
            done["m"] = new[0].pub.publish(1)
        except Exception as e:  # noqa: BLE001 - reported by the op below
            done["error"] = e
            written.set()
    thread = threading.Thread(target=rank0, daemon=True)
    with mock.patch.object(store_module, "write_rank_files", write_rank_files):
        thread.start()
        written.wait(20)  # a bound for a rank 0 that hangs; it is set as soon as rank 0 waits
    new[1].pub.publish(1)
    thread.join(20)
    case.world.states["two", 1] = _snapshot(new[1])
    if "error" in done:
        raise done["error"]
    engine, rx = case.receiver(root, manifest=done["m"])

    def op():
        m = rx.store.manifest(1)
        assert m["attempt"] == new[0].pub.attempt_id(1) and m["anchors"][1]["bytes"] > 0
        return rx.load_latest()
    return Trial(rx, engine, op, "correct", ("two", 1))


@fault("leftovers")
def f_temp_files_and_a_half_written_manifest_are_ignored_and_cleaned(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=7)
    d = step_dir(root, 8)
    d.mkdir()
    (d / ".manifest.json.tmp-77").write_bytes(b'{"format_version": 2, "half')
    (d / fmt.MANIFEST_NAME).write_bytes(b'{"format_version": 2, "half')

    def heal():
        shutil.rmtree(d)
        shutil.copytree(step_dir(case.world.stores["A+"], 8), d)
        return rx.apply(8)
    return Trial(rx, engine, lambda: rx.apply(8), "error", ("A", 8), errors=(fmt.StepNotReadyError,),
                 prefetch_step=8, keeps=("A", 7), heal=heal)


# ---- 4. edits the position-weighted checksum cannot see ----------------------------------------

def _cancel_delta(pattern: str, name: str, step: int):
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=step - 1)
        d = step_dir(root, step)
        saved = {p.name: p.read_bytes() for p in d.iterdir()}
        cancel_in_delta(root, step, name, case.state("A", step), case.rng, pattern)

        def repair():
            for n, data in saved.items():
                (d / n).write_bytes(data)
        return Trial(rx, engine, lambda: rx.apply(step), "error", ("A", step), errors=(fmt.ChecksumMismatchError,),
                     prefetch_step=step, repair=repair, match=r"checksum2 .*position-weighted checksum matched")
    return make


_seed = 1000
for _pattern in ("pair", "cubic"):
    for _name in TENSORS[:5] if _pattern == "pair" else TENSORS[:3]:
        if _name == "lm_head.weight" and _pattern == "cubic":
            continue
        for _step in (5, 7) if _pattern == "pair" else (6,):
            _seed += 1
            FAULTS.append(Fault(f"cancelling-{_pattern}-edit-in-delta-{_step}-{_name}", "cancelling",
                                _cancel_delta(_pattern, _name, _step), _seed))


def _cancel_anchor(pattern: str, name: str):
    def edit_for(case, root, n):
        cancel_in_anchor(root, 6, n, case.rng, pattern)
    make = _anchor_edit(edit_for, name)

    def wrapped(case):
        trial = make(case)
        trial.match = r"checksum2 .*position-weighted checksum matched"
        return trial
    return wrapped


for _pattern, _name in (("pair", TENSORS[0]), ("pair", TENSORS[2]), ("cubic", TENSORS[1]), ("cubic", TENSORS[3])):
    _seed += 1
    FAULTS.append(Fault(f"cancelling-{_pattern}-edit-in-anchor-{_name}", "cancelling", _cancel_anchor(_pattern, _name),
                        _seed))


def _memory_edit(pattern: str, name: str):
    """The engine's own memory is edited after a verified load (a stray write), at checkpoint positions
    whose position-weighted changes cancel: a full re-check of both checksums (``DeltaReceiver.verify``
    after ``recompute_shares``; ``VllmReceiver.check_weights``) catches what the position-weighted one cannot see."""
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=7)
        want = case.state("A", 7)
        edit_held(rx, name, want, cancelling_positions(case.rng, _bits_of(want, name), pattern))
        # the check failed, so the engine is invalid: the same call as any other update reloads and replays
        return Trial(rx, engine, lambda: case.backend.verify_held(rx), "error", ("A", 7),
                     errors=(fmt.ChecksumMismatchError,), heal=lambda: rx.apply(7),
                     match=r"checksum2 .*position-weighted checksum matched")
    return make


for _pattern, _name in (("pair", TENSORS[1]), ("cubic", "model.layers.0.self_attn.o_proj.weight")):
    _seed += 1
    FAULTS.append(Fault(f"cancelling-{_pattern}-edit-in-engine-memory-{_name}", "cancelling",
                        _memory_edit(_pattern, _name), _seed))


def _trainer_edit(pattern: str, name: str):
    """An edit outside the optimizer step on the trainer that the position-weighted live check cannot
    see: the publish refuses it (checksum2); a full checkpoint then carries it to the engines."""
    def make(case: Case) -> Trial:
        root = case.scratch("trainer")
        tr = Trainer(root, interval=10, run_id="edit", kv_heads=1, model_kw=MODEL)
        m0 = tr.pub.publish(0)
        engine, rx = case.receiver(root, at=0, manifest=m0)
        tr.train_step()
        with torch.no_grad():
            bits = as_bits(dict(tr.model.named_parameters())[name].data)
            u = unsigned(bits).numpy()
            for k, dv in cancelling_positions(case.rng, u, pattern).items():
                bits[k] = int(((u[k] + dv + (1 << 15)) % (1 << 16)) - (1 << 15))

        def heal():
            tr.pub.force_full()
            tr.pub.publish(2)
            case.world.states["edit", 2] = _snapshot(tr)
            return rx.apply(2)
        return Trial(rx, engine, lambda: tr.pub.publish(1), "error", ("edit", 2),
                     errors=(fmt.WeightChangedOutsideStepError,), heal=heal, match=r"live checksum2 ")
    return make


for _pattern, _name in (("pair", "model.layers.0.mlp.up_proj.weight"), ("cubic", "model.norm.weight")):
    _seed += 1
    FAULTS.append(Fault(f"cancelling-{_pattern}-edit-outside-the-trainer-step-{_name}", "cancelling",
                        _trainer_edit(_pattern, _name), _seed))


# ---- 5. every failure typed --------------------------------------------------------------------

def _damage(step: int, held: int | None, damage, errors, expect: str = "error", want_step: int | None = None,
            op_name: str = "apply"):
    """A generic fault on one step's files: ``damage(case, root, step_dir)``; the repair restores them."""
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=held)
        d = step_dir(root, step)
        saved = {}
        for p in d.iterdir():
            if p.is_file():
                saved[p.name] = p.read_bytes()
        damage(case, root, d)

        def repair():
            for p in list(d.iterdir()):
                if p.name not in saved:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            for n, data in saved.items():
                target = d / n
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.is_symlink() or target.exists():  # a link, a pipe, a file
                    target.unlink()
                target.write_bytes(data)
        op = (lambda: rx.apply(step)) if op_name == "apply" else rx.load_latest
        want = ("A", want_step if want_step is not None else step)
        return Trial(rx, engine, op, expect, want, errors=errors, prefetch_step=step,
                     keeps=("A", held) if (held is not None and expect == "error") else None, repair=repair)
    return make


def _unlink(name):
    return lambda case, root, d: (d / name).unlink()


def _to_dir(name):
    def damage(case, root, d):
        (d / name).unlink()
        (d / name).mkdir()
    return damage


FAULTS += [
    Fault("manifest-missing-under-complete", "typed", _damage(6, 5, _unlink(fmt.MANIFEST_NAME),
                                                              (fmt.MissingManifestError,))),
    Fault("manifest-is-a-directory", "typed", _damage(6, 5, _to_dir(fmt.MANIFEST_NAME), (fmt.MissingManifestError,))),
    Fault("delta-part-is-a-directory", "typed", _damage(6, 5, _to_dir("rank-00000.delta"), (fmt.MissingPartError,))),
    Fault("delta-part-missing", "typed", _damage(5, 4, _unlink("rank-00000.delta"), (fmt.MissingPartError,))),
    Fault("anchor-part-is-a-directory", "typed", _damage(6, None, _to_dir("rank-00000.anchor"), (),
                                                         expect="fallback", want_step=7, op_name="load_latest")),
    Fault("anchor-part-missing", "typed", _damage(6, None, _unlink("rank-00000.anchor"), (), expect="fallback",
                                                  want_step=7, op_name="load_latest")),
    Fault("marker-is-a-directory", "typed", _damage(6, 5, _to_dir(fmt.COMPLETE_NAME), (fmt.StepNotReadyError,))),
]


def _to_fifo(name):
    # a named pipe where a file belongs: a reader that opened it would wait for a writer forever
    def damage(case, root, d):
        (d / name).unlink()
        os.mkfifo(d / name)
    return damage


def _link_outside(name):
    # the very bytes the step needs, through a link that leaves the step directory
    def damage(case, root, d):
        outside = case.scratch(f"outside-{name}")
        shutil.copy(d / name, outside)
        (d / name).unlink()
        os.symlink(outside, d / name)
    return damage


def _link_inside(name, other):
    def damage(case, root, d):
        (d / name).unlink()
        os.symlink(other, d / name)
    return damage


FAULTS += [
    Fault("manifest-is-a-named-pipe", "typed", _damage(6, 5, _to_fifo(fmt.MANIFEST_NAME), (fmt.MissingManifestError,))),
    Fault("marker-is-a-named-pipe", "typed", _damage(6, 5, _to_fifo(fmt.COMPLETE_NAME), (fmt.StepNotReadyError,))),
    Fault("delta-part-is-a-named-pipe", "typed", _damage(5, 4, _to_fifo("rank-00000.delta"), (fmt.MissingPartError,))),
    Fault("anchor-part-is-a-named-pipe", "typed", _damage(6, None, _to_fifo("rank-00000.anchor"), (),
                                                          expect="fallback", want_step=7, op_name="load_latest")),
    Fault("manifest-links-outside-the-step", "typed", _damage(6, 5, _link_outside(fmt.MANIFEST_NAME),
                                                              (fmt.ManifestPathError,))),
    Fault("marker-links-outside-the-step", "typed", _damage(6, 5, _link_outside(fmt.COMPLETE_NAME),
                                                            (fmt.ManifestPathError,))),
    Fault("delta-part-links-to-the-steps-anchor", "typed",
          _damage(6, 5, _link_inside("rank-00000.delta", "rank-00000.anchor"),
                  (fmt.TruncatedFileError, fmt.WrongStepError))),
]


def _marker_bytes(data: bytes):
    return lambda case, root, d: (d / fmt.COMPLETE_NAME).write_bytes(data)


for _label, _data, _err in (
        ("not-json", b"COMPLETE", fmt.ManifestSchemaError),
        ("nested-too-deep", b"[" * 2000 + b"]" * 2000, fmt.ManifestSchemaError),
        ("over-its-cap", b" " * (fmt.MAX_MARKER_BYTES + 1), fmt.HeaderTooLargeError),
        ("nan", b'{"format_version": 2, "step": NaN}', fmt.ManifestSchemaError),
        ("wrong-keys", b'{"format_version": 2, "step": 6}', fmt.ManifestSchemaError),
        ("version-1", b'{"format_version": 1, "step": 6, "manifest_bytes": 10, "manifest_crc32": 0}',
         fmt.FormatVersionError),
        ("huge-manifest-bytes", json.dumps(dict(format_version=2, step=6, attempt="0" * 16, manifest_bytes=1 << 40,
                                                manifest_crc32=0)).encode(), fmt.HeaderTooLargeError),
        ("crc-list", json.dumps(dict(format_version=2, step=6, attempt="0" * 16, manifest_bytes=10,
                                     manifest_crc32=[1])).encode(), fmt.ManifestSchemaError),
        ("attempt-dict", json.dumps(dict(format_version=2, step=6, attempt={"a": 1}, manifest_bytes=10,
                                         manifest_crc32=0)).encode(), fmt.ManifestSchemaError),
):
    FAULTS.append(Fault(f"marker-{_label}", "typed", _damage(6, 5, _marker_bytes(_data), (_err,))))


def _field(path, value):
    def mutate(m, rng):
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = value
    return mutate


for _path, _value in ((("run_id",), ["run-a"]), (("attempt",), {"a": 1}), (("kind",), ["delta"]),
                      (("base_step",), "5"), (("base_attempt",), 5), (("world",), "1"), (("parts",), {"0": 1}),
                      (("parts", 0, "file"), ["rank-00000.delta"]), (("parts", 0, "bytes"), "123"),
                      (("parts", 0, "rank"), None), (("tensors", TENSORS[0], "dtype"), ["bfloat16"]),
                      (("tensors", TENSORS[0], "shape"), [96, 0]), (("tensors", TENSORS[0], "shape"), "96x32"),
                      (("tensors", TENSORS[0], "checksum"), 12345), (("tensors", TENSORS[0], "checksum2"), [1, 2]),
                      (("tensors", TENSORS[3], "tied_to"), {"name": "x"}), (("tensors",), []),
                      (("format_version",), "2"), (("step",), 6.0)):
    _label = ".".join(str(p) for p in _path).replace(TENSORS[0], "t").replace(TENSORS[3], "lm") + "=" + type(_value).__name__
    FAULTS.append(Fault(f"manifest-field-{_label}", "typed",
                        _manifest_edit(6, _field(_path, _value), (fmt.ManifestSchemaError, fmt.ManifestPathError,
                                                                  fmt.FormatVersionError, fmt.WrongStepError))))


def _flip_at(where: str):
    def damage(case, root, d):
        path = d / "rank-00000.delta"
        header, start = fmt.read_part_header(path)
        size = path.stat().st_size
        lo, hi = {"prefix": (0, 16), "header": (16, start - 4), "payload": (start, size)}[where]
        flip(path, int(case.rng.integers(lo, hi)), 1 << int(case.rng.integers(0, 8)))
    return damage


for _where, _n in (("prefix", 3), ("header", 4), ("payload", 5)):
    for _k in range(_n):
        FAULTS.append(Fault(f"bit-flip-in-delta-{_where}-{_k}", "typed",
                            _damage(6, 5, _flip_at(_where), (fmt.SyncFormatError,)), seed=200 + 10 * _n + _k))


def _truncate(fraction):
    def damage(case, root, d):
        path = d / "rank-00000.delta"
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * fraction)])
    return damage


for _fr in (0.0, 0.01, 0.3, 0.999):
    FAULTS.append(Fault(f"delta-truncated-to-{_fr}", "typed", _damage(6, 5, _truncate(_fr), (fmt.SyncFormatError,))))
FAULTS.append(Fault("delta-with-trailing-bytes", "typed",
                    _damage(6, 5, lambda c, r, d: (d / "rank-00000.delta").write_bytes(
                        (d / "rank-00000.delta").read_bytes() + b"\0\0"), (fmt.TruncatedFileError,))))


def _header_len_bomb(case, root, d):
    path = d / "rank-00000.delta"
    data = bytearray(path.read_bytes())
    data[12:16] = (0xFFFFFFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def _count_bomb(case, root, d):
    # a stream header claiming 2^60 changes, every CRC made to match: refused before any buffer is allocated
    def edit(e, blob):
        b = bytearray(blob)
        b[8:16] = (1 << 60).to_bytes(8, "little")
        return bytes(b)
    rewrite_part(root, 6, "delta", edit)


def _block_bomb(case, root, d):
    def edit(e, blob):
        b = bytearray(blob)
        b[4:8] = (0xFFFFFFF0).to_bytes(4, "little")  # n_blocks
        return bytes(b)
    rewrite_part(root, 6, "delta", edit)


FAULTS += [
    Fault("allocation-bomb-header-length", "typed", _damage(6, 5, _header_len_bomb, (fmt.HeaderTooLargeError,))),
    Fault("allocation-bomb-change-count", "typed", _damage(6, 5, _count_bomb, (fmt.CodecError,))),
    Fault("allocation-bomb-block-count", "typed", _damage(6, 5, _block_bomb, (fmt.CodecError,))),
]


def _stream_flip(case, root, d):
    # a flip inside a codec stream with its CRC recomputed: the decoder or a checksum must catch it
    header, _ = fmt.read_part_header(d / "rank-00000.delta")
    long_ones = [e["name"] for e in header["entries"] if e["length"] > 64]
    victim = long_ones[int(case.rng.integers(0, len(long_ones)))]

    def edit(e, blob):
        if e["name"] != victim:
            return blob
        b = bytearray(blob)
        b[int(case.rng.integers(32, len(b)))] ^= 1 << int(case.rng.integers(0, 8))
        return bytes(b)
    rewrite_part(root, 6, "delta", edit)


def _stream_fault(seed):
    make = _damage(6, 5, _stream_flip, (fmt.CodecError, fmt.ChecksumMismatchError))

    def wrapped(case):
        trial = make(case)
        trial.correct_ok = True  # a flip the codec decodes to the same values changes nothing: also fine
        return trial
    return wrapped


for _k in range(8):
    FAULTS.append(Fault(f"stream-flip-with-valid-crc-{_k}", "typed", _stream_fault(_k), seed=300 + _k))


def _changes_count(case, root, d):
    path = d / "rank-00000.delta"
    header, start = fmt.read_part_header(path)
    payload = path.read_bytes()[start:]
    header["entries"][0]["changes"] = max(1, header["entries"][0]["changes"] - 1)
    header = {k: v for k, v in header.items() if k != "payload_len"}
    path.write_bytes(fmt.encode_part(header, payload))
    m = load_raw_manifest(root, 6)
    m["parts"][0]["bytes"] = path.stat().st_size
    write_manifest_raw(root, 6, m)


def _duplicate_entry(case, root, d):
    path = d / "rank-00000.delta"
    header, start = fmt.read_part_header(path)
    payload = path.read_bytes()[start:]
    e = header["entries"][0]
    blob = payload[e["offset"]:e["offset"] + e["length"]]
    header["entries"].append(dict(e, offset=len(payload)))
    header = {k: v for k, v in header.items() if k != "payload_len"}
    path.write_bytes(fmt.encode_part(header, payload + blob))
    m = load_raw_manifest(root, 6)
    m["parts"][0]["bytes"] = path.stat().st_size
    write_manifest_raw(root, 6, m)


def _escape_manifest(case, root, d):
    m = load_raw_manifest(root, 6)
    m["parts"][0]["file"] = "../../../etc/passwd"
    write_manifest_raw(root, 6, m)


def _escape_link(case, root, d):
    outside = case.tmp / f"outside-{len(case.copies)}.delta"
    shutil.copy(d / "rank-00000.delta", outside)
    (d / "rank-00000.delta").unlink()
    os.symlink(outside, d / "rank-00000.delta")


def _wrong_step(case, root, d):
    m = load_raw_manifest(root, 6)
    m["step"] = 5
    m["base_step"] = 4
    write_manifest_raw(root, 6, m)


def _marker_attempt(case, root, d):
    marker = json.loads((d / fmt.COMPLETE_NAME).read_text())
    marker["attempt"] = "f" * 32
    (d / fmt.COMPLETE_NAME).write_text(json.dumps(marker))


def _manifest_flip(case, root, d):
    flip(d / fmt.MANIFEST_NAME, int(case.rng.integers(0, (d / fmt.MANIFEST_NAME).stat().st_size)))


FAULTS += [
    Fault("entry-change-count-differs", "typed", _damage(6, 5, _changes_count, (fmt.CodecError,))),
    Fault("delta-entry-duplicated", "typed", _damage(6, 5, _duplicate_entry, (fmt.ManifestSchemaError,))),
    Fault("manifest-names-a-path-outside", "typed", _damage(6, 5, _escape_manifest, (fmt.ManifestPathError,))),
    Fault("part-is-a-link-outside", "typed", _damage(6, 5, _escape_link, (fmt.ManifestPathError,))),
    Fault("manifest-of-another-step", "typed", _damage(6, 5, _wrong_step, (fmt.WrongStepError,))),
    Fault("marker-of-another-attempt", "typed", _damage(6, 5, _marker_attempt, (fmt.WrongStepError,))),
    Fault("manifest-bit-flip", "typed", _damage(6, 5, _manifest_flip, (fmt.CorruptBytesError,)), seed=77),
]


def _prune_race(when: str):
    """The trainer prunes under the reader: after it planned (the engine's pre-write check runs
    between the plan and the reads), or before it asks."""
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root) if when != "delta" else case.receiver(root, at=4)
        saved = case.scratch("pruned")
        shutil.copytree(root, saved)
        victims = {"anchor": [3, 4, 5, 6], "delta": [5], "base": [3, 4, 5]}[when]

        def prune():
            for s in victims:
                shutil.rmtree(step_dir(root, s), ignore_errors=True)
        fired = []

        def before_write():
            if not fired:
                fired.append(1)
                prune()
        rx.before_write = before_write

        def repair():
            rx.before_write = lambda: None
            for s in victims:
                if not step_dir(root, s).exists():
                    shutil.copytree(step_dir(saved, s), step_dir(root, s))
        if when == "delta":
            return Trial(rx, engine, lambda: rx.apply(5), "error", ("A", 5), errors=(fmt.MissingPartError,),
                         keeps=("A", 4), repair=repair)
        target = 7 if when == "anchor" else 5
        return Trial(rx, engine, lambda: rx.apply(target), "error", ("A", target),
                     errors=(fmt.MissingPartError, fmt.StepNotReadyError, fmt.ChainError), repair=repair)
    return make


for _when in ("anchor", "delta", "base"):
    FAULTS.append(Fault(f"pruned-after-the-plan-{_when}", "typed", _prune_race(_when)))


@fault("typed")
def f_base_pruned_before_the_plan_is_a_chain_error(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root)
    saved = {s: case.scratch(f"base-{s}") for s in (3,)}
    for s, p in saved.items():
        shutil.copytree(step_dir(root, s), p)
        shutil.rmtree(step_dir(root, s))

    def repair():
        for s, p in saved.items():
            shutil.copytree(p, step_dir(root, s))
    return Trial(rx, engine, lambda: rx.apply(5), "error", ("A", 5), errors=(fmt.ChainError,), repair=repair)


# ---- 6. graceful fallback ----------------------------------------------------------------------

def _anchor_flip(region: str):
    def edit_for(case, root, name):
        path = step_dir(root, 6) / "rank-00000.anchor"
        header, start = fmt.read_part_header(path)
        e = next(x for x in header["entries"] if x["name"] == name)
        flip(path, start + e["offset"] + int(case.rng.integers(0, e["length"])), 0x10)
    return edit_for


for _k, _name in enumerate((TENSORS[0], TENSORS[2], TENSORS[5], "model.norm.weight")):
    FAULTS.append(Fault(f"latest-anchor-bit-flip-{_name}", "fallback", _anchor_edit(_anchor_flip("entry"), _name),
                        seed=400 + _k))


@fault("fallback")
def f_a_wrong_trainer_checksum2_in_the_latest_manifest_fails_every_chain(case: Case) -> Trial:
    def edit_for(case_, root, name):
        m = load_raw_manifest(root, 6)
        value = int(m["tensors"][TENSORS[0]]["checksum2"])
        m["tensors"][TENSORS[0]]["checksum2"] = str((value & ~0xFFFFFFFF) | (((value & 0xFFFFFFFF) + 1) % P31))
        write_manifest_raw(root, 6, m)
    # the trainer's own checksum2 in the manifest is wrong: anchor 6 fails its check, 6 as a delta too
    make = _anchor_edit(edit_for, TENSORS[0], expect="error")
    trial = make(case)
    trial.errors = (fmt.ChecksumMismatchError,)
    return trial


def _not_ready(how: str):
    def make(case: Case) -> Trial:
        root = case.store("A+")
        for s in (9, 10):
            shutil.rmtree(step_dir(root, s))  # the trainer is at step 8
        engine, rx = case.receiver(root, at=8)
        full = step_dir(case.world.stores["A+"], 9)
        d = step_dir(root, 9)
        d.mkdir()
        names = {"no-files": [], "parts-only": ["rank-00000.delta", "rank-00000.anchor", "rank-00000.json"],
                 "manifest-no-marker": ["rank-00000.delta", "rank-00000.anchor", "rank-00000.json",
                                        fmt.MANIFEST_NAME]}[how]
        for n in names:
            shutil.copy(full / n, d / n)

        def repair():
            for n in os.listdir(full):
                shutil.copy(full / n, d / n)
        return Trial(rx, engine, lambda: rx.apply(9), "error", ("A", 9), errors=(fmt.StepNotReadyError,),
                     prefetch_step=9, keeps=("A", 8), repair=repair)
    return make


for _how in ("no-files", "parts-only", "manifest-no-marker"):
    FAULTS.append(Fault(f"step-still-being-written-{_how}", "fallback", _not_ready(_how)))


@fault("fallback")
def f_a_step_that_completes_while_the_engine_waits_is_applied(case: Case) -> Trial:
    root = case.store("A+")
    for s in (9, 10):
        shutil.rmtree(step_dir(root, s))
    engine, rx = case.receiver(root, at=8)
    staging = case.scratch("staging")
    shutil.copytree(step_dir(case.world.stores["A+"], 9), staging)
    landed: list[bool] = []
    real_wait = BroadcastStore.wait_complete

    def land() -> None:
        d = step_dir(root, 9)
        d.mkdir()
        for n in sorted(os.listdir(staging), key=lambda n: n == fmt.COMPLETE_NAME):  # the marker last
            shutil.copy(staging / n, d / n)

    def wait_complete(store, step, timeout_s):
        # the step lands right after the engine's wait first finds it incomplete, whatever the timing
        def is_complete(s):
            complete = BroadcastStore.is_complete(store, s)
            if not complete and s == 9 and not landed:
                land()
                landed.append(True)
            return complete
        store.is_complete = is_complete
        try:
            return real_wait(store, step, timeout_s)
        finally:
            del store.is_complete

    def op():
        with mock.patch.object(BroadcastStore, "wait_complete", wait_complete):
            report = rx.apply(9, wait_s=20)
        assert landed, "the engine did not wait for the step"
        return report
    return Trial(rx, engine, op, "correct", ("A", 9))


@fault("fallback")
def f_waiting_for_a_step_that_never_comes_is_bounded(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=7)
    t0 = []

    def op():
        t0.append(time.monotonic())
        return rx.apply(8, wait_s=0.5)

    def heal():
        assert time.monotonic() - t0[0] < 10, "the wait was not bounded"
        return rx.apply(7)
    return Trial(rx, engine, op, "error", ("A", 7), errors=(fmt.StepNotReadyError,), keeps=("A", 7), heal=heal)


def _symlinked_step(where: str):
    def make(case: Case) -> Trial:
        root = case.store("A")
        engine, rx = case.receiver(root, at=5)
        d = step_dir(root, 6)
        moved = case.scratch("moved")
        if where == "outside":
            shutil.move(d, moved)
            os.symlink(moved, d)
        else:  # inside the root, but another step's directory
            shutil.move(d, moved)
            os.symlink(step_dir(root, 7), d)

        def repair():
            d.unlink()
            shutil.move(moved, d)
        errors = (fmt.ManifestPathError,) if where == "outside" else (fmt.WrongStepError,)
        return Trial(rx, engine, lambda: rx.apply(6), "error", ("A", 6), errors=errors, prefetch_step=6,
                     keeps=("A", 5), repair=repair)
    return make


FAULTS.append(Fault("step-directory-links-outside-the-root", "fallback", _symlinked_step("outside")))
FAULTS.append(Fault("step-directory-links-to-another-step", "fallback", _symlinked_step("inside")))


@fault("fallback")
def f_a_symlinked_step_inside_the_root_is_followed(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=5)
    d = step_dir(root, 6)
    store = root / ".steps"
    store.mkdir()
    shutil.move(d, store / d.name)
    os.symlink(store / d.name, d)
    return Trial(rx, engine, lambda: rx.apply(6), "correct", ("A", 6))


# ---- the store's read side (many readers) ------------------------------------------------------

@fault("store")
def f_a_stale_cached_listing_is_revalidated(case: Case) -> Trial:
    root = case.store("A+")
    saved = case.scratch("later")
    shutil.move(step_dir(root, 9), saved)
    shutil.rmtree(step_dir(root, 10))
    engine, rx = case.receiver(root, at=8)
    assert 9 not in rx.store.steps(revalidate=False)  # the reader's listing is cached without step 9
    shutil.move(saved, step_dir(root, 9))
    return Trial(rx, engine, lambda: rx.apply(9), "correct", ("A", 9))


@fault("store")
def f_a_step_removed_under_a_cached_manifest_is_not_trusted(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=5)
    rx.store.manifest(6)
    saved = case.scratch("gone")
    shutil.move(step_dir(root, 6), saved)

    def repair():
        shutil.move(saved, step_dir(root, 6))
    return Trial(rx, engine, lambda: rx.apply(6), "error", ("A", 6), errors=(fmt.StepNotReadyError,),
                 keeps=("A", 5), repair=repair)


@fault("store")
def f_the_broadcast_root_itself_is_missing(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=5)
    moved = case.scratch("root")
    shutil.move(root, moved)

    def repair():
        shutil.move(moved, root)
    return Trial(rx, engine, lambda: rx.apply(6), "error", ("A", 6), errors=(fmt.StepNotReadyError,),
                 keeps=("A", 5), repair=repair)


@fault("store")
def f_prefetch_of_a_step_then_republished_is_not_used(case: Case) -> Trial:
    root = case.store("A")
    engine, rx = case.receiver(root, at=4)
    assert rx.prefetch(5)
    case.replace_with(root, "C")
    return Trial(rx, engine, lambda: rx.apply(5), "correct", ("C", 5))


# ---- 7. weights the engine moved after loading -------------------------------------------------

@fault("layout")
def f_layout_moved_after_load_is_followed(case: Case) -> Trial:
    """The engine swapped the gate and up halves of every gate_up_proj after it booted: a map recorded
    through its loader writes the wrong halves and still verifies; the first-update check must follow
    the blocks, and the engine then holds the latest step where its kernels read."""
    root = case.store("A")
    view, rx, attach = case.backend.moved_engine(case, root, "swap")
    return Trial(rx, view, attach, "correct", ("A", 7))


@fault("layout")
def f_layout_changed_values_after_load_is_refused(case: Case) -> Trial:
    """The engine's kernel doubles gate_up_proj after loading (values, not a move): no delta of the
    checkpoint's bits can patch it, and the attach must refuse before writing anything."""
    root = case.store("A")
    view, rx, attach = case.backend.moved_engine(case, root, "scale")
    state = {}

    def repair():
        state["heal"] = case.backend.restart_plain(case, root, view)
    return Trial(rx, view, attach, "error", ("A", 7), errors=(fmt.LayoutMovedError,), repair=repair,
                 heal=lambda: state["heal"](), match=r"recorded write\(s\) hold other values .*gate_up_proj")


# ---- 8. cast tensors -----------------------------------------------------------------------------

@fault("cast")
def f_cast_tensor_changed_by_a_delta_is_refused_and_the_engine_keeps_its_weights(case: Case) -> Trial:
    """The trainer keeps its final norm and head in float32 (the engines serve them in bf16: cast tensors,
    loaded by value at anchors); a step that changes them cannot go out as a delta of the checkpoint's bits."""
    name = "model.norm.weight"
    root = case.scratch("cast")
    tr = Trainer(root, interval=10, run_id="cast", kv_heads=1, model_kw=MODEL, lr=0.05, fp32=(name, "lm_head.weight"))
    m0 = tr.pub.publish(0)
    case.world.states["cast", 0] = _snapshot(tr)
    engine, rx = case.receiver(root, at=0, manifest=m0)
    before = tr.wire_state()[name].clone()
    tr.train_step()
    tr.pub.publish(1)
    assert not torch.equal(tr.wire_state()[name], before), "the step left the norm as it was: the case is vacuous"

    def heal():
        tr.pub.force_full()
        tr.pub.publish(2)
        case.world.states["cast", 2] = _snapshot(tr)
        return rx.apply(2)
    return Trial(rx, engine, lambda: rx.apply(1), "error", ("cast", 2), errors=(CastTensorChangedError,),
                 keeps=("cast", 0), heal=heal, match=r"step 1 changes (model\.norm|lm_head)\.weight")


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    """Per fault class and in all: faults, detected, silently wrong, raw, hangs, unexpected, healed."""
    classes: dict[str, dict[str, int]] = {}
    for o in outcomes:
        for key in (o.klass, "all"):
            row = classes.setdefault(key, dict(faults=0, detected=0, silently_wrong=0, raw=0, hang=0, unexpected=0,
                                               healed=0, prefetch_raised=0))
            row["faults"] += 1
            row[o.result] += 1
            row["healed"] += int(o.healed)
            row["prefetch_raised"] += int(not o.prefetch_ok)
    return classes


__all__ = ["CASE_TIMEOUT_S", "FAULTS", "Fault", "Outcome", "World", "build_world", "run_fault", "summary"]
