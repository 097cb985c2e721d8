"""Engine side: prefetch a step's changes while serving, patch weights in place, verify every tensor.

A :class:`DeltaReceiver` wraps one engine worker's parameters and an :class:`IndexMap` recorded
from the engine's own loader. ``prefetch(step)`` reads and decodes the parts of the tensors this
worker holds (while the engine keeps serving); it never raises. ``apply(step)`` runs in the pause:
TP rank 0 plans (apply one delta, nothing, or reload an anchor and replay the deltas since, with
older anchors to fall back to) and broadcasts the plan with the attempt id of every step in it;
every worker follows it; a failure on any worker fails the update on all (one flag reduction per
phase, so no worker waits in a collective the others left): the TP-group protocol of
:mod:`rltune.sync.group`. After each load or apply the group checks, per checkpoint tensor, that the
sum of the workers' shares of **both** checksums equals multiplicity x the trainer's; shares follow
deltas in O(changes) and are recomputed in full after an anchor load.

What the receiver holds is named by (run id, step, attempt): a step the trainer republished is
new content, never "the step already held". Every step in a plan is read from a snapshot of its
manifest taken once per update. Every read happens before the first write: a failure while
reading (a step still being written, a damaged part, a step pruned under the reader) leaves the
weights and the receiver's validity as they were, so a healthy engine keeps serving its step; only
a failure after writing began marks it invalid, and its next update reloads and replays the same
way on every worker. A damaged newest anchor (bytes, cover, or values that fail a checksum) falls
back to the anchor before it plus every delta since.

The apply function is pluggable (``apply_fn``) so a fused GPU kernel can replace the torch
reference :func:`rltune.sync.ops.apply_mapped_delta_ref` with the same signature; the receiver
computes the second checksum's change itself from the values it reads back, so a kernel that
writes wrong values is caught whatever it reports.

Example::

    imap = IndexMap.record(lambda dt: ToyEngine(cfg, rank, tp, dtype=dt), spec)
    rx = DeltaReceiver("/shared/broadcast", engine, imap, group=tp_group)   # group=None: one worker
    rx.load_latest()                   # fresh engine: latest anchor (only the rows it holds) + replay
    rx.prefetch(43)                    # while serving
    rx.apply(43)                       # in the pause: patch in place + verify
    rx.apply(44, wait_s=5)             # the trainer is still writing 44: wait politely for its marker
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltune.errors import RltuneError
from rltune.sync import codec
from rltune.sync import format as fmt
from rltune.sync.casting import CastLoads
from rltune.sync.group import TorchCollectives, TpGroup, as_typed
from rltune.sync.indexmap import IndexMap, TensorRuns
from rltune.sync.kernels import checksum_pairs
from rltune.sync.kernels.reference import (
    MASK64,
    P31,
    as_bits,
    checksum2_add,
    checksum2_lanes,
    checksum2_scale,
    checksum2_update_ref,
)
from rltune.sync.ops import apply_mapped_delta_ref, wire_width
from rltune.sync.store import BroadcastStore

ApplyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], int]
# an anchor's little-endian wire bits, by width, as numpy reads them
_BITS_NP = {bits: np.dtype(name).newbyteorder("<") for bits, name in fmt.BITS_INTEGERS.items()}


# a moved block shorter than this could sit in many places by chance: it is never relocated, only refused
MIN_RELOCATED_RUN = 16
_SLICE_COMPARE_RUN = 4096  # runs at least this long are compared as slices; shorter ones in vectorized batches
_BATCH_ELEMENTS = 1 << 22


@dataclass
class LayoutReport:
    """What :meth:`DeltaReceiver.check_layout` found: runs compared with the boot checkpoint and moved."""

    runs_checked: int = 0
    runs_moved: int = 0
    elements_moved: int = 0
    # checkpoint tensor -> the relocated parameter start of each of its runs (:meth:`DeltaReceiver.relocate`)
    moves: dict[str, np.ndarray] = field(default_factory=dict)

    def summary(self) -> dict[str, int]:
        return dict(runs_checked=self.runs_checked, runs_moved=self.runs_moved, elements_moved=self.elements_moved,
                    tensors_moved=len(self.moves))


@dataclass
class UpdateReport:
    """What one ``apply``/``load_latest`` did."""

    action: str  # "none", "delta" or "reload"
    step: int
    anchor: int | None = None
    deltas: list[int] = field(default_factory=list)
    changes_applied: int = 0
    seconds: float = 0.0
    prestaged: list[int] = field(default_factory=list)  # deltas whose reads were done while serving (CPU)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: plan, check, read, write, verify
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # anchors that failed before the one loaded


class DeltaReceiver:
    """One engine worker's view of a broadcast root (see the module docstring)."""

    def __init__(self, root: str | Path, model: torch.nn.Module, index_map: IndexMap, *, group: Any = None,
                 apply_fn: ApplyFn = apply_mapped_delta_ref, fused: bool | None = None, fused_backend: str = "auto",
                 max_fallbacks: int = 2, manifest: dict[str, Any] | None = None):
        """``manifest``: any manifest of the run (its tensors' dtypes), to set the cast tensors apart now
        (before :meth:`check_layout`); without it they are set apart at the first update."""
        self.store = BroadcastStore(root)
        params = dict(model.named_parameters())
        missing = [n for n in index_map.param_names if n not in params]
        if missing:
            raise fmt.IndexMapError(f"index map names parameters {missing[:3]} the engine does not have; "
                                    "record the map from this engine")
        self.params = [params[n] for n in index_map.param_names]
        self.imap, self.group, self.apply_fn = index_map, group, apply_fn
        # tensors the engine holds in another dtype than the checkpoint's: loaded by value, never patched
        self.full_map = index_map
        self.cast: CastLoads | None = None
        if manifest is not None:
            self._split_cast(manifest)
        # the TP group's protocol (rltune.sync.group): a process group, or Collectives of the engine's own
        collectives = group if group is None or hasattr(group, "all_gather_ints") else TorchCollectives(group)
        self.tp = TpGroup(collectives, on_lost=self._lost)
        self.max_fallbacks = max_fallbacks
        self.step: int | None = None
        self.run_id: str | None = None
        self.attempt: str | None = None
        self.valid = False
        self.anchor_loads = 0
        self.deltas_applied = 0
        self.last_prefetch_error: RltuneError | None = None
        self._shares: dict[str, int] = {}
        self._shares2: dict[str, int] = {}
        self._multiplicity: dict[str, int] | None = None
        self._static_key: tuple | None = None
        self._names: list[str] = []
        self._prefetched: dict[tuple[str, int, str], Any] = {}
        self._writes = 0  # writes begun (anchor loads and deltas): a patch staged before one is stale
        self._prestaged: list[int] = []  # this update's deltas stored from a patch staged while serving
        self._planned: dict[int, dict[str, Any]] = {}  # TP rank 0: the manifests this update was planned with
        # id(manifest) -> (manifest, values derived from it) for the last few manifests (_derived)
        self._derived_of: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        # fused: one multi-tensor kernel launch per delta (rltune.sync.kernels.ApplyPlan) with the
        # changes staged on the device at prefetch; None = when the parameters are on a GPU.
        self._fused = (self.params[0].device.type == "cuda") if fused is None else fused
        self._fused_backend = fused_backend
        self._apply_plan = None
        self._layout_of: dict[str, int] = {}
        self._plan_names: list[str] = []
        self._plan_addresses: list[int] = []

    @property
    def held(self) -> tuple[str, int, str] | None:
        """(run id, step, attempt) of the weights this worker holds, or None when it holds no verified step."""
        return (self.run_id, self.step, self.attempt) if self.valid else None

    # ------------------------------------------------------------------------- group plumbing

    @property
    def rank(self) -> int:
        return self.tp.rank

    def _lost(self) -> None:
        self.valid = False  # a worker of the group is gone: what it holds can no longer be verified

    def _allreduce(self, values: list[int], op: str = "sum") -> list[int]:
        return self.tp.all_reduce(values, op)

    def _group_phase(self, fn: Callable[[], Any], what: str) -> Any:
        """Run local work; if it fails on any worker, every worker raises (:meth:`TpGroup.phase`)."""
        return self.tp.phase(fn, what)

    # ------------------------------------------------------------------------- static checks

    def _spec_key(self, manifest: dict[str, Any]) -> tuple:
        """The names, dtypes, shapes and ties of a manifest's tensors; kept for the last few manifests (the
        store hands out one dict per step and marker), so the prefetch computes a step's key, not the pause."""
        return self._derived(manifest, "spec_key", lambda: tuple(sorted(
            (n, t["dtype"], tuple(t["shape"]), t["tied_to"]) for n, t in manifest["tensors"].items())))

    def _derived(self, manifest: dict[str, Any], what: str, make: Callable[[], Any]) -> Any:
        """``make()``, kept per manifest for the last few manifests (the store hands out one dict per step
        and marker): the prefetch derives a step's values, the pause reuses them."""
        slot = self._derived_of.get(id(manifest))
        if slot is None or slot[0] is not manifest:
            if len(self._derived_of) >= 4:
                self._derived_of.pop(next(iter(self._derived_of)))
            slot = self._derived_of[id(manifest)] = (manifest, {})
        if what not in slot[1]:
            slot[1][what] = make()
        return slot[1][what]

    def _split_cast(self, manifest: dict[str, Any]) -> None:
        named = dict(zip(self.full_map.param_names, self.params, strict=True))
        self.imap, self.cast = CastLoads.split(self.store, self.full_map, named, manifest)

    def _check_static(self, manifest: dict[str, Any], where: str) -> None:
        """Whenever a manifest's names, dtypes or shapes differ from the last checked: they match the index
        map, the parameters' dtypes, and the group covers each tensor evenly (multiplicity).

        Every worker issues the same two reductions whatever it finds; a problem is raised after them.
        """
        key = self._spec_key(manifest)
        if self._multiplicity is not None and key == self._static_key:
            return
        if self.cast is None:
            self._split_cast(manifest)
        names = sorted(manifest["tensors"])
        counts, possums, problem = [], [], None
        try:
            problem = self._spec_problem(manifest, where)
            for name in names:
                t = manifest["tensors"][name]
                runs = self.imap.tensors.get(name)
                held = runs.held if runs is not None else 0
                if held:
                    for pid in np.unique(runs.param):
                        p = self.params[int(pid)]
                        if fmt.dtype_name(p.dtype) != t["dtype"] and problem is None:
                            problem = fmt.IndexMapError(
                                f"{where}: tensors.{name}.dtype: the engine parameter {self.imap.param_names[pid]} is "
                                f"{p.dtype}, the checkpoint {t['dtype']}: casting loads are not patchable in place")
                    ps = runs.length * (runs.ckpt_start + 1) + runs.length * (runs.length - 1) // 2
                    possums.append(int(sum(int(x) for x in ps)) & MASK64)
                else:
                    possums.append(0)
                counts.append(held)
        except Exception as e:  # raised after the reductions, which every worker must issue
            problem = problem or as_typed(e, f"{where}: static check")
            counts, possums = [0] * len(names), [0] * len(names)
        counts_all = self._allreduce(counts)
        possums_all = self._allreduce(possums)
        if problem is not None:
            raise problem
        mult = {}
        for name, c, s in zip(names, counts_all, possums_all, strict=True):
            numel = fmt.numel_of(manifest["tensors"][name]["shape"])
            if c == 0:
                continue
            m = c // numel
            if c % numel or (m * (numel * (numel + 1) // 2)) & MASK64 != s:
                raise fmt.IndexMapError(f"{where}: {name}: the TP group holds {c} element copies of {numel}, not an even "
                                        "cover; its checksums cannot be verified")
            mult[name] = m
        self._names, self._multiplicity, self._static_key = names, mult, key
        for _, values in self._derived_of.values():
            values.pop("expected", None)  # made with the multiplicities replaced here
        if self._fused:
            self._fused_plan(manifest)

    def _spec_problem(self, manifest: dict[str, Any], where: str) -> RltuneError | None:
        """Why this manifest does not describe the tensors the index map was recorded for, or None."""
        tensors = manifest["tensors"]
        if self.imap.spec:
            missing = sorted(set(self.imap.spec) - set(tensors))
            extra = sorted(set(tensors) - set(self.imap.spec))
            if missing or extra:
                return fmt.IndexMapError(
                    f"{where}: tensors: the manifest lacks {missing[:3]} / adds {extra[:3]} against the "
                    f"{len(self.imap.spec)} tensors the engine's index map was recorded for; every tensor the engine "
                    "holds must be covered: record the index map again (attach again) for this model")
            for name, (shape, dtype) in self.imap.spec.items():
                t = tensors[name]
                if list(t["shape"]) != list(shape) or t["dtype"] != dtype:
                    return fmt.IndexMapError(
                        f"{where}: tensors.{name}: shape {t['shape']} {t['dtype']}, but the index map was recorded "
                        f"for {list(shape)} {dtype}; record the index map again (attach again)")
        for name, runs in self.imap.tensors.items():
            if not runs.held:
                continue
            t = tensors.get(name)
            if t is None:
                return fmt.IndexMapError(f"{where}: tensors: {name}, which this engine holds, is not in the manifest; "
                                         "no checksum would cover it: record the index map again (attach again)")
            if fmt.numel_of(t["shape"]) != runs.numel:
                return fmt.IndexMapError(f"{where}: tensors.{name}.shape: {t['shape']} holds {fmt.numel_of(t['shape'])} "
                                         f"elements, the index map {runs.numel}; record the index map again")
        return None

    def _fused_plan(self, manifest: dict[str, Any]):
        """The fused kernel's plan for this index map: built, and compiled, at the first load; its
        tables are rebuilt (no recompile) if the engine moved a parameter's storage."""
        from rltune.sync.kernels import ApplyPlan, layouts_from_index_map

        addresses = [p.data_ptr() for p in self.params]
        if self._apply_plan is not None and addresses == self._plan_addresses:
            return self._apply_plan
        shapes = {n: (manifest["tensors"][n]["shape"] if n in manifest["tensors"] else [r.numel])
                  for n, r in self.imap.tensors.items()}
        names, layouts = layouts_from_index_map(self.imap, shapes)
        self._apply_plan = ApplyPlan([p.data for p in self.params], layouts, backend=self._fused_backend)
        self._layout_of = {n: i for i, n in enumerate(names)}
        self._plan_names, self._plan_addresses = names, addresses
        return self._apply_plan

    # ------------------------------------------------------------------------- reading

    def _part_paths(self, step: int, manifest: dict, key: str) -> list[tuple[Path, int, dict]]:
        step_dir = self.store.checked_step_dir(step)
        kind = "delta" if key == "parts" else "anchor"
        out = []
        for f in manifest[key]:
            path = fmt.safe_child(step_dir, f["file"])
            expect = dict(kind=kind, run_id=manifest["run_id"], attempt=manifest["attempt"], step=step, rank=f["rank"],
                          world=manifest["world"], base_step=manifest["base_step"] if kind == "delta" else None)
            header, start = fmt.read_part_header(path, expect=expect, expect_bytes=f["bytes"])
            fmt.check_part_entries(path, header, manifest)
            out.append((path, start, header))
        fmt.check_cover(step_dir, manifest, [(p, h) for p, _, h in out])
        return out

    def _held_entries(self, step: int, m: dict) -> list[tuple[list[str], Path, dict, memoryview, int]]:
        """Each delta entry this worker holds any of: (checkpoint names it lands in, its part file, the
        entry, its bytes (CRC-checked), its element bits).

        A tied tensor's changes land in every name tied to it; an entry whose tensors this worker
        does not hold is not even read.
        """
        if m["kind"] == "full":
            raise fmt.ChainError(f"{self.store.step_dir(step)}: step {step} is a full checkpoint, not a delta")
        tied: dict[str, list[str]] = {}
        for name, t in m["tensors"].items():
            if t["tied_to"] is not None:
                tied.setdefault(t["tied_to"], []).append(name)
        held = []
        for path, start, header in self._part_paths(step, m, "parts"):
            mine = []
            for e in header["entries"]:
                targets = [n for n in [e["name"], *tied.get(e["name"], [])]
                           if n in self.imap.tensors and self.imap.tensors[n].held]
                if targets:
                    mine.append((targets, e))
            for (targets, e), data in zip(mine, fmt.read_entries_bytes(path, start, [e for _, e in mine]), strict=True):
                held.append((targets, path, e, data, fmt.WIRE_DTYPES[m["tensors"][e["name"]]["dtype"]].bits))
        return held

    def _decoded_entries(self, step: int, m: dict):
        """Each delta entry this worker holds any of, decoded on the codec's threads
        (``codec.decode_many``): (checkpoint names it lands in, idx, diff)."""
        held = self._held_entries(step, m)
        streams = [(data, e["start"], e["stop"], bits) for _, _, e, data, bits in held]
        for (targets, path, e, _, _), got in zip(held, codec.decode_many(streams), strict=True):
            if isinstance(got, fmt.CodecError):  # the codec knows bytes only: name the file and the entry
                raise fmt.CodecError(f"{path}: entry {e['name']}: {got}") from None
            idx, diff = got
            if len(idx) != e["changes"]:
                raise fmt.CodecError(f"{path}: entry {e['name']} decodes to {len(idx)} changes, header says {e['changes']}")
            yield targets, idx, diff

    def _read_changes(self, step: int, m: dict) -> dict[str, list]:
        """This worker's changes of a delta step: name -> [(param id, positions, diffs, checkpoint idx)]."""
        changes: dict[str, list] = {}
        for targets, idx, diff in self._decoded_entries(step, m):
            for name in targets:
                held, pid, pos = self.imap.tensors[name].locate(idx)
                hidx, hdiff = idx[held], diff[held]
                for p in np.unique(pid):
                    sel = pid == p
                    changes.setdefault(name, []).append((int(p), torch.from_numpy(pos[sel]),
                                                         torch.from_numpy(hdiff[sel]), torch.from_numpy(hidx[sel])))
        return changes

    def _stage_changes(self, step: int, m: dict, prestage: bool = False) -> dict[str, Any]:
        """A delta step's changes for the fused kernel, as one flat batch already on the device.

        Entries follow the parts; each names a layout (checkpoint tensor; a tied tensor gets its
        own entry with the same changes); the kernel skips changes this worker does not hold.
        ``prestage`` (the prefetch): also stage the patch itself where the backend can (:meth:`_prestage`).
        """
        self._fused_plan(m)
        held = self._held_entries(step, m)
        # one flat batch: each entry decodes straight into its slot (differences as sign-wrapped int32,
        # which add exactly in the kernel); a tied tensor's names each get a copy of its changes
        layouts, slots, copies, offsets = [], [], [], [0]
        for targets, _, e, _, _ in held:
            first = (offsets[-1], offsets[-1] + e["changes"])
            slots.append(first)
            for k, name in enumerate(targets):
                layouts.append(self._layout_of[name])
                if k:
                    copies.append((first, (offsets[-1], offsets[-1] + e["changes"])))
                offsets.append(offsets[-1] + e["changes"])
        at = offsets[-1]
        idx_C, val_C = np.empty(at, dtype=np.int64), np.empty(at, dtype=np.int32)
        streams = [(data, e["start"], e["stop"], bits) for _, _, e, data, bits in held]
        for (_, path, e, _, _), error in zip(held, codec.decode_many_into(streams, idx_C, val_C, slots), strict=True):
            if error is not None:  # the codec knows bytes only: name the file and the entry
                raise fmt.CodecError(f"{path}: entry {e['name']}: {error}") from None
        for (a, b), (c, d) in copies:
            idx_C[c:d], val_C[c:d] = idx_C[a:b], val_C[a:b]
        host = dict(entry_tensor_E=torch.tensor(layouts, dtype=torch.int64),
                    entry_offsets_E1=torch.tensor(offsets, dtype=torch.int64), idx_C=torch.from_numpy(idx_C),
                    val_C=torch.from_numpy(val_C))
        dev = self.params[0].device
        if dev.type == "cuda":
            host = {k: v.pin_memory().to(dev, non_blocking=True) for k, v in host.items()}
            torch.cuda.current_stream(dev).synchronize()  # staged before the pause; the pinned copies may go
        staged = dict(host, entry_names=[self._plan_names[li] for li in layouts])
        if prestage:
            staged.update(self._prestage(m, host))
        return staged

    def _prestage(self, m: dict, host: dict[str, torch.Tensor]) -> dict[str, Any]:
        """CPU (compiled pass): read the delta against the weights held now, while the engine serves, so
        that the pause only stores (:meth:`ApplyPlan.stage`). Only for a delta on the very weights held:
        the patch is keyed by them and by the writes begun so far, and any write after makes it stale."""
        plan = self._apply_plan
        key = (self._writes, self.held)  # taken before the reads: a write that overlaps them bumps _writes
        if not plan.numba or key[1] is None or key[1] != (m["run_id"], m["base_step"], m["base_attempt"]):
            return {}
        patch = plan.stage(host["entry_tensor_E"], host["entry_offsets_E1"], host["idx_C"], host["val_C"], add=True,
                           mix=True, threads=1)  # one thread: the engine serves on the other cores meanwhile
        return dict(patch=patch, patch_key=key, patch_plan=plan)

    # ------------------------------------------------------------------------- public API

    def prefetch(self, step: int) -> bool:
        """Read and decode ``step``'s parts for this worker; False if it is not (yet) a readable delta.

        Never raises: the contract is True (staged for ``apply``) or False (``apply`` reads, and
        reports any error, in the pause); the reason is kept in :attr:`last_prefetch_error`.
        """
        self.last_prefetch_error = None
        try:
            m = self.store.manifest(step)
            if m["kind"] == "full":
                return False
            staged = self._stage_changes(step, m, prestage=True) if self._fused else self._read_changes(step, m)
            # the pause's static check then compares a key already made, its verification sums already made
            if self._spec_key(m) == self._static_key and self._multiplicity is not None:
                self._expected(m)
            self._prefetched = {(m["run_id"], step, m["attempt"]): staged}
            return True
        except Exception as e:  # the contract: a bool, whatever the step holds
            self.last_prefetch_error = as_typed(e, f"prefetch of step {step}")
            self._prefetched = {}
            return False

    def apply(self, step: int, wait_s: float = 0.0) -> UpdateReport:
        """Bring this worker (and its TP group) to ``step``, then verify; raises a typed error on any failure.

        ``wait_s``: how long TP rank 0 waits (polite back-off) for the step's COMPLETE marker before
        :class:`~rltune.sync.format.StepNotReadyError`; keep it below the group's time-out. A step that
        is not there leaves the engine as it was (still valid at its step).
        """
        def plan():
            if wait_s > 0:
                self.store.wait_complete(step, wait_s)
            return self._plan(step)
        return self._update(plan)

    def load_latest(self) -> UpdateReport:
        """Fresh, relaunched or failed engine: latest complete anchor (held rows only), replay, verify;
        an older anchor when the newest one is damaged."""
        def plan():
            steps = self.store.complete_steps()
            if not steps:
                raise fmt.StepNotReadyError(f"{self.store.root}: no complete step to load yet")
            return self._plan(steps[-1], force_reload=True)
        return self._update(plan)

    # ------------------------------------------------------------------------- planning and execution

    def _plan(self, target: int, force_reload: bool = False) -> dict:
        m = self.store.manifest(target)
        self._planned[target] = m
        ident = (m["run_id"], target, m["attempt"])
        held = self.held
        if not force_reload and held == ident:
            return dict(action="none", target=target, candidates=[], attempts={target: m["attempt"]})
        if not force_reload and held is not None and m["kind"] != "full" and held[0] == m["run_id"] \
                and (m["base_step"], m["base_attempt"]) == (held[1], held[2]):
            return dict(action="delta", target=target, candidates=[(None, [target])], attempts={target: m["attempt"]})
        candidates = self.store.chains(target, limit=1 + self.max_fallbacks)
        steps = {s for anchor, deltas in candidates for s in [anchor, *deltas]}
        self._planned.update({s: self.store.manifest(s) for s in steps})
        return dict(action="reload", target=target, candidates=candidates,
                    attempts={s: self._planned[s]["attempt"] for s in steps})

    def _snapshot(self, attempts: dict[int, str]) -> dict[int, dict[str, Any]]:
        """This worker's manifests of the plan's steps, each the attempt rank 0 planned with."""
        mans = {}
        for s, attempt in attempts.items():
            m = self._planned.get(s) or self.store.manifest(s)  # TP rank 0 planned with its own snapshot
            if m["attempt"] != attempt:
                raise fmt.WrongStepError(f"{self.store.step_dir(s)}: step {s} is attempt {m['attempt']} here, but TP "
                                         f"rank 0 planned with attempt {attempt}: the trainer republished it meanwhile; "
                                         "nothing was changed, update again")
            mans[s] = m
        return mans

    def _update(self, make_plan: Callable[[], dict]) -> UpdateReport:
        t0 = time.perf_counter()
        phases: dict[str, float] = {}

        def timed(name: str, fn: Callable[[], Any]) -> Any:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

        self._planned = {}
        # every worker raises rank 0's own error (type and message): nothing was written, the engine stays as it was
        plan = self.tp.decide(lambda: timed("plan", make_plan), "planning the update", sends="its plan")
        report = UpdateReport(plan["action"], plan["target"], phases=phases)
        self._prestaged = report.prestaged
        if plan["action"] == "none":
            return report
        mans = timed("check", lambda: self._group_phase(lambda: self._snapshot(plan["attempts"]), "reading manifests"))
        timed("check", lambda: self._group_phase(self.before_write, "the engine's pre-write check"))
        for s, m in sorted(mans.items()):
            where = str(self.store.step_dir(s) / fmt.MANIFEST_NAME)
            timed("check", lambda m=m, where=where: self._group_phase(lambda: self._check_static(m, where),
                                                                     "checking the manifest against the index map"))
        cast = self.cast if self.cast is not None and self.cast.names else None
        if cast is not None:  # read (every worker) before anything is written; a delta that changed one raises here
            timed("check", lambda: self._group_phase(lambda: cast.stage(plan["target"]),
                                                     f"reading the cast tensors of step {plan['target']}"))
        candidates = plan["candidates"]
        first_error: RltuneError | None = None
        for i, (anchor, deltas) in enumerate(candidates):
            try:
                report.changes_applied = self._run_chain(anchor, deltas, mans, timed)
            except fmt.GroupUnreachableError:
                raise  # a worker is gone: another chain would wait on it again
            except RltuneError as e:
                first_error = first_error or e
                if plan["action"] != "reload" or i == len(candidates) - 1:
                    raise first_error from None  # the newest anchor's error: what the trainer can fix
                report.fallbacks.append(dict(anchor=anchor, error=type(e).__name__, message=str(e)))
                continue
            report.anchor, report.deltas = anchor, list(deltas)
            break
        if cast is not None:
            try:
                timed("write", lambda: self._group_phase(cast.write, "writing the cast tensors"))
            except Exception:
                self.valid = False  # the next update reloads everything, cast tensors included
                cast.forget()
                raise
        m = mans[plan["target"]]
        self.valid, self.step, self.run_id, self.attempt = True, plan["target"], m["run_id"], m["attempt"]
        report.seconds = time.perf_counter() - t0
        return report

    def _run_chain(self, anchor: int | None, deltas: list[int], mans: dict[int, dict], timed) -> int:
        """Load ``anchor`` (unless None) and apply ``deltas``, verifying each; returns the changes written.

        Each step is read (every worker) before anything of it is written; the receiver turns invalid
        only when its first write starts.
        """
        applied = 0
        if anchor is not None:
            m = mans[anchor]
            staged = timed("read", lambda: self._group_phase(lambda: self._read_anchor(anchor, m),
                                                             f"reading step {anchor}'s anchor"))
            self.valid = False
            self._writes += 1
            timed("write", lambda: self._group_phase(lambda: self._write_anchor(anchor, staged),
                                                     f"writing step {anchor}'s anchor"))
            timed("verify", lambda: self._verify(anchor, m))
        for step in deltas:
            m = mans[step]
            staged = timed("read", lambda s=step, m=m: self._group_phase(lambda: self._staged_delta(s, m),
                                                                         f"reading step {s}'s delta"))
            if self._fused and staged.pop("patch_key", None) != (self._writes, self.held):
                staged.pop("patch", None)  # staged against weights written since: apply it in full
            self.valid = False
            self._writes += 1
            applied += timed("write", lambda s=step, st=staged, m=m: self._group_phase(
                lambda: self._apply_delta(s, st, m), f"applying step {s}'s delta"))
            timed("verify", lambda s=step, m=m: self._verify(s, m))
        return applied

    def _staged_delta(self, step: int, m: dict) -> Any:
        """``step``'s changes for this worker: the prefetched ones (of this very attempt), or read and decoded now."""
        staged = self._prefetched.pop((m["run_id"], step, m["attempt"]), None)
        self._prefetched.clear()
        if staged is None:
            staged = self._stage_changes(step, m) if self._fused else self._read_changes(step, m)
        return staged

    def _apply_delta(self, step: int, staged: Any, m: dict) -> int:
        if self._fused:
            return self._apply_fused(step, staged, m)
        applied = 0
        for name, items in staged.items():
            change, change2 = 0, 0
            for pid, pos, diff, idx in items:
                p = self.params[pid]
                dev = p.device
                bits = as_bits(p.data)
                pos_d, idx_d = pos.to(dev), idx.to(dev)
                before = bits[pos_d].clone()
                change += self.apply_fn(bits, pos_d, diff.to(dev), idx_d)
                # checksum2 from what memory holds now, not from what the apply function reports
                change2 = checksum2_add(change2, checksum2_update_ref(idx_d, before, bits[pos_d]))
                applied += int(pos.numel())
            self._shares[name] = (self._shares.get(name, 0) + change) & MASK64
            self._shares2[name] = checksum2_add(self._shares2.get(name, 0), change2)
        self.step = step
        self.deltas_applied += 1
        return applied

    def _apply_fused(self, step: int, staged: dict[str, Any], m: dict) -> int:
        """One kernel launch patches every tensor; one host sync reads the per-entry changes of both checksums."""
        plan = self._fused_plan(m)
        patch = staged.get("patch") if staged.get("patch_plan") is plan else None  # a rebuilt plan: stale positions
        if patch is not None:
            result = plan.store(patch)
            self._prestaged.append(step)
        else:
            result = plan.apply(staged["entry_tensor_E"], staged["entry_offsets_E1"], staged["idx_C"],
                                staged["val_C"], add=True, mix=True)
        changes, written = result.to_host()
        changes2 = result.checksums2()
        for name, change, change2 in zip(staged["entry_names"], changes, changes2, strict=True):
            self._shares[name] = (self._shares.get(name, 0) + change) & MASK64
            self._shares2[name] = checksum2_add(self._shares2.get(name, 0), change2)
        self.step = step
        self.deltas_applied += 1
        return int(sum(written))

    def _read_anchor(self, step: int, m: dict) -> list[tuple[str, list[Piece]]]:
        """Every row of ``step``'s anchor this worker holds, read and CRC-checked, nothing written yet:
        per checkpoint tensor, (parameter id, first parameter element, wire bits) pieces."""
        by_name: dict[str, list] = {}
        for path, start, header in self._part_paths(step, m, "anchors"):
            for e in header["entries"]:
                by_name.setdefault(e["name"], []).append((path, start, e))
        staged = []
        for name, runs in self.imap.tensors.items():
            if not runs.held:
                continue
            bits = fmt.WIRE_DTYPES[m["tensors"][name]["dtype"]].bits
            pieces = self._read_tensor(name, runs, by_name.get(name, []), bits)
            written = sum(int(src.numel()) for _, _, src in pieces)
            if written != runs.held:
                raise fmt.AnchorCoverError(f"{self.store.step_dir(step)}: step {step}: anchor slices cover {written} of "
                                           f"the {runs.held} elements of {name} this worker holds")
            staged.append((name, pieces))
        return staged

    def _write_anchor(self, step: int, staged: list[tuple[str, list[Piece]]]) -> None:
        for _, pieces in staged:
            for pid, pos, src in pieces:
                dst = as_bits(self.params[pid].data)
                if isinstance(pos, int):
                    dst[pos: pos + src.numel()] = src.to(dst.device)
                else:  # the scattered elements of many short runs, in one indexed copy
                    dst.index_copy_(0, pos.to(dst.device), src.to(dst.device))
        self._shares, self._shares2 = self._full_shares([name for name, _ in staged])
        self.step = step
        self.anchor_loads += 1

    def _read_tensor(self, name: str, runs: TensorRuns, entries: list, bits: int) -> list[Piece]:
        itemsize = bits // 8
        cs, ln, pids, ps = runs.ckpt_start, runs.length, runs.param, runs.param_start
        lo_held, hi_held = int(cs.min()), int((cs + ln).max())
        for pid in np.unique(pids).tolist():
            width = wire_width(as_bits(self.params[pid].data))
            if width != bits:
                raise fmt.IndexMapError(f"{name}: engine parameter has {width}-bit elements, checkpoint {bits}")
        pieces: list[Piece] = []
        for path, start, e in entries:
            lo, hi = max(lo_held, e["start"]), min(hi_held, e["stop"])
            if lo >= hi:
                continue
            raw = fmt.read_anchor_range(path, start, e, (lo - e["start"]) * itemsize, (hi - e["start"]) * itemsize)
            src = torch.from_numpy(np.frombuffer(raw, dtype=_BITS_NP[bits]).copy())
            a, b = np.maximum(cs, lo), np.minimum(cs + ln, hi)
            sel = np.flatnonzero(a < b)
            pieces.extend(_pieces(pids[sel], ps[sel] + a[sel] - cs[sel], a[sel] - lo, b[sel] - a[sel], src))
        return pieces

    def _full_shares(self, names: list[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Both checksums of what this worker holds of each named tensor, from its parameters: every run
        of every tensor in one ``checksum_pairs`` call (CPU parameters: over two threads)."""
        owners, views, offsets = [], [], []
        for name in names:
            for pid, ckpt, where in _spans(self.imap.tensors[name]):
                bits = as_bits(self.params[pid].data)
                owners.append(name)
                # many short runs (a repacked MoE expert) are gathered in one pass, not viewed run by run
                views.append(bits[where[0]: where[1]] if isinstance(where, tuple)
                             else bits.index_select(0, where.to(bits.device)))
                offsets.append(ckpt)
        shares, shares2 = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
        for name, (c1, c2) in zip(owners, checksum_pairs(views, offsets), strict=True):
            shares[name], shares2[name] = shares[name] + c1, checksum2_add(shares2[name], c2)
        return {n: v & MASK64 for n, v in shares.items()}, shares2

    # ------------------------------------------------------------------------- the first-update layout check

    def check_layout(self, boot: Callable[[str], torch.Tensor], source: str = "the boot checkpoint") -> LayoutReport:
        """Before anything is written, while the engine still holds the weights it booted with: compare every
        write the index map records with the boot checkpoint, byte for byte, and follow any block the
        engine holds elsewhere in the same parameter.

        ``boot(name)``: checkpoint tensor ``name`` as the engine booted from it (its elements in the
        checkpoint's order; only the ones this worker holds are read). Verification alone cannot see a
        layout the engine moved after loading (a kernel backend that swaps the gate and up halves of
        fused weights): the receiver writes, and checksums, the positions its map names, so a patched
        engine would pass every check while its kernels read other elements. Here a run whose
        positions hold other values than the checkpoint is searched for in its parameter: found in
        exactly one place, the run moves there (:attr:`LayoutReport.moves`); found nowhere, in several
        places, or shorter than :data:`MIN_RELOCATED_RUN`, :class:`~rltune.sync.format.LayoutMovedError`
        names it, and nothing is written. Every worker of the TP group fails together. ``source`` names
        where ``boot`` reads from (a checkpoint directory) in error messages.
        """
        report = self._group_phase(lambda: self._find_layout(boot, source),
                                   "checking the engine's layout against its boot checkpoint")
        self.relocate(report.moves)
        return report

    def relocate(self, moves: dict[str, np.ndarray]) -> None:
        """Move runs of the index map to the parameter starts ``moves`` gives (a :meth:`check_layout` result,
        kept by an integration that attaches again to the same engine); the plans built on the map are rebuilt."""
        if not moves:
            return
        for name, starts in moves.items():
            runs = self.imap.tensors[name]
            if len(starts) != len(runs.param_start):
                raise fmt.IndexMapError(f"{name}: {len(starts)} relocated runs for a map of {len(runs.param_start)}; "
                                        "the moves were found for another index map: check the layout again")
            runs.param_start = np.asarray(starts, dtype=np.int64).copy()
        self._multiplicity, self._static_key, self._apply_plan = None, None, None
        self._derived_of.clear()
        self._prefetched = {}

    def _find_layout(self, boot: Callable[[str], torch.Tensor], source: str) -> LayoutReport:
        report = LayoutReport()
        unplaced: list[tuple[str, int, int, int, int]] = []  # (tensor, param id, param start, length, places found)
        for name, runs in self.imap.tensors.items():
            if not runs.held:
                continue
            src = as_bits(boot(name).detach().contiguous()).reshape(-1)
            if src.numel() != runs.numel:
                raise fmt.IndexMapError(f"{source}: {name}: the boot checkpoint holds {src.numel()} elements, the index "
                                        f"map {runs.numel}; the engine booted from another model than it serves")
            report.runs_checked += len(runs.length)
            bad = self._mismatched_runs(runs, src)
            if not len(bad):
                continue
            starts = runs.param_start.copy()
            for r in bad.tolist():
                cs, ln, pid, ps = (int(runs.ckpt_start[r]), int(runs.length[r]), int(runs.param[r]),
                                   int(runs.param_start[r]))
                hay = as_bits(self.params[pid].data).reshape(-1)
                found = _find_block(hay, src[cs:cs + ln].to(hay.device)) if ln >= MIN_RELOCATED_RUN else []
                if len(found) == 1:
                    starts[r] = found[0]
                    report.runs_moved += 1
                    report.elements_moved += ln
                else:
                    unplaced.append((name, pid, ps, ln, len(found)))
            report.moves[name] = starts
        if unplaced:
            name, pid, ps, ln, places = unplaced[0]
            where = ("in several places" if places > 1 else
                     "nowhere else in it" if ln >= MIN_RELOCATED_RUN else
                     f"nowhere it can be placed (runs under {MIN_RELOCATED_RUN} elements are not searched)")
            raise fmt.LayoutMovedError(
                f"{source}: {name}: {len(unplaced)} recorded write(s) hold other values than the engine's boot checkpoint, "
                "first "
                f"{ln} element(s) at {self.imap.param_names[pid]}[{ps}], found {where}: the engine moved weights after "
                "loading in a way the index map does not follow (or holds other weights than it booted with). Nothing "
                "was written; record the map through the engine's post-load processing, or attach before loading "
                "other weights")
        self._check_no_overlap(report.moves, source)
        return report

    def _mismatched_runs(self, runs: TensorRuns, src: torch.Tensor) -> np.ndarray:
        """Indices of the runs whose parameter elements differ from ``src`` (the checkpoint's bits)."""
        bad: list[np.ndarray] = []
        long = np.flatnonzero(runs.length >= _SLICE_COMPARE_RUN)
        for r in long.tolist():
            cs, ln, pid, ps = (int(runs.ckpt_start[r]), int(runs.length[r]), int(runs.param[r]),
                               int(runs.param_start[r]))
            held = as_bits(self.params[pid].data).reshape(-1)[ps:ps + ln]
            if not torch.equal(held, src[cs:cs + ln].to(held.device)):
                bad.append(np.array([r]))
        short = np.flatnonzero(runs.length < _SLICE_COMPARE_RUN)
        for pid in np.unique(runs.param[short]).tolist():
            mine = short[runs.param[short] == pid]
            held = as_bits(self.params[pid].data).reshape(-1)
            total = np.cumsum(runs.length[mine])
            cuts = np.searchsorted(total, np.arange(_BATCH_ELEMENTS, int(total[-1]), _BATCH_ELEMENTS), side="right")
            for batch in np.split(mine, cuts):
                if not len(batch):
                    continue
                lengths = runs.length[batch]
                first = np.repeat(np.cumsum(lengths) - lengths, lengths)
                within = np.arange(int(lengths.sum()), dtype=np.int64) - first
                ppos = torch.from_numpy(np.repeat(runs.param_start[batch], lengths) + within).to(held.device)
                cpos = torch.from_numpy(np.repeat(runs.ckpt_start[batch], lengths) + within)
                differs = (held[ppos].cpu() != src[cpos].cpu()).numpy()
                if differs.any():
                    bad.append(batch[np.unique(np.repeat(np.arange(len(batch)), lengths)[differs])])
        return np.sort(np.concatenate(bad)) if bad else np.zeros(0, dtype=np.int64)

    def _check_no_overlap(self, moves: dict[str, np.ndarray], source: str) -> None:
        """After relocation every parameter element is still written by at most one run."""
        if not moves:
            return
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for name, runs in self.imap.tensors.items():
            starts = moves.get(name, runs.param_start)
            for pid, ps, ln in zip(runs.param.tolist(), starts.tolist(), runs.length.tolist(), strict=True):
                spans.setdefault(pid, []).append((ps, ln, name))
        for pid, items in spans.items():
            items.sort()
            for (a, la, na), (b, _, nb) in zip(items, items[1:], strict=False):
                if b < a + la:
                    raise fmt.LayoutMovedError(
                        f"{source}: {self.imap.param_names[pid]}: after following the blocks the engine moved, writes of {na} "
                        f"and {nb} land on the same elements (at {b}); the engine's layout is not a move of whole "
                        "blocks: record the map through the engine's post-load processing")

    def before_write(self) -> None:
        """Runs on every worker, as one group phase, before an update writes anything.

        The base receiver checks nothing; an engine integration (``rltune.sync.vllm``) checks here
        that the parameters it writes are still the ones the engine computes with.
        """

    def recompute_shares(self) -> None:
        """Recompute every share from the parameters (O(weights)); for checks after outside writes."""
        self._shares, self._shares2 = self._full_shares([n for n, r in self.imap.tensors.items() if r.held])

    def verify(self, step: int) -> None:
        """Check the shares held now against ``step``'s manifest (both checksums, group-wide)."""
        self._verify(step, self.store.manifest(step))

    def _expected(self, m: dict) -> tuple[list[str], list[int], list[tuple[int, int]]]:
        """(names checked, the group's expected checksum and checksum2 lanes of each) for manifest ``m``;
        kept for the last few manifests, so the prefetch computes a step's, not the pause."""
        def make():
            names = [n for n in self._names if n in self._multiplicity]
            tensors, mult = m["tensors"], self._multiplicity
            return (names, [(mult[n] * int(tensors[n]["checksum"])) & MASK64 for n in names],
                    [checksum2_lanes(checksum2_scale(int(tensors[n]["checksum2"]), mult[n])) for n in names])
        return self._derived(m, "expected", make)

    def _verify(self, step: int, m: dict) -> None:
        names, want, want2 = self._expected(m)
        lanes = [checksum2_lanes(self._shares2.get(n, 0)) for n in names]
        sums = self._allreduce([self._shares.get(n, 0) for n in names] + [a for a, _ in lanes] + [b for _, b in lanes])
        k = len(names)
        bad = []
        for j, n in enumerate(names):
            if sums[j] != want[j]:
                bad.append((n, "checksum"))
            elif (sums[k + j] % P31, sums[2 * k + j] % P31) != want2[j]:
                bad.append((n, "checksum2"))
        if bad:
            self.valid = False
            only2 = all(which == "checksum2" for _, which in bad)
            raise fmt.ChecksumMismatchError(
                f"{self.store.step_dir(step) / fmt.MANIFEST_NAME}: step {step}: {len(bad)} tensor(s) differ from the "
                f"trainer's tensors.<name>.{bad[0][1]} after the update, first {bad[0][0]}"
                + (" (the position-weighted checksum matched: an edit whose weighted changes cancel)" if only2 else "")
                + "; the next update reloads an anchor and replays")


# An anchor piece: (parameter id, where, wire bits): ``where`` is the first parameter element of a
# contiguous run, or an int64 tensor of the parameter elements ``bits`` fill, one each.
Piece = tuple[int, "int | torch.Tensor", torch.Tensor]


def _run_elements(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every element of the runs ``[starts[i], starts[i] + lengths[i])``, run after run (int64)."""
    total = int(lengths.sum())
    first = np.cumsum(lengths) - lengths
    return np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)


def _pieces(pids: np.ndarray, param_starts: np.ndarray, src_starts: np.ndarray, lengths: np.ndarray,
            src: torch.Tensor) -> list[Piece]:
    """The anchor pieces of runs of ``src``: a run of :data:`_SLICE_COMPARE_RUN` elements or more as one
    slice, the shorter runs of each parameter together as one indexed piece (a repacked MoE expert's
    anchor is millions of runs of a few elements; copying them one by one took minutes)."""
    out: list[Piece] = []
    long = lengths >= _SLICE_COMPARE_RUN
    for r in np.flatnonzero(long).tolist():
        out.append((int(pids[r]), int(param_starts[r]), src[src_starts[r]: src_starts[r] + lengths[r]]))
    short = np.flatnonzero(~long)
    for pid in np.unique(pids[short]).tolist():
        mine = short[pids[short] == pid]
        where = torch.from_numpy(_run_elements(param_starts[mine], lengths[mine]))
        out.append((pid, where, src[torch.from_numpy(_run_elements(src_starts[mine], lengths[mine]))]))
    return out


def _spans(runs: TensorRuns) -> list[tuple[int, int, tuple[int, int] | torch.Tensor]]:
    """What one tensor's checksum shares are taken over: (parameter id, first checkpoint element, where).
    ``where`` is a (start, stop) slice of the parameter for a run of :data:`_SLICE_COMPARE_RUN` elements or
    more; runs shorter than that which follow one another in the checkpoint on one parameter are joined
    into one span whose parameter elements ``where`` lists (gathered before checksumming)."""
    order = np.argsort(runs.ckpt_start, kind="stable")
    cs, ln, pids, ps = runs.ckpt_start[order], runs.length[order], runs.param[order], runs.param_start[order]
    short = ln < _SLICE_COMPARE_RUN
    out: list = []
    for r in np.flatnonzero(~short).tolist():
        out.append((int(pids[r]), int(cs[r]), (int(ps[r]), int(ps[r] + ln[r]))))
    idx = np.flatnonzero(short)
    if len(idx):
        # a new span where the checkpoint does not go on from the previous short run, or the parameter changes
        cut = np.ones(len(idx), dtype=bool)
        cut[1:] = (cs[idx[1:]] != cs[idx[:-1]] + ln[idx[:-1]]) | (pids[idx[1:]] != pids[idx[:-1]])
        bounds = np.append(np.flatnonzero(cut), len(idx))
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            group = idx[a:b]
            if len(group) == 1:
                r = int(group[0])
                out.append((int(pids[r]), int(cs[r]), (int(ps[r]), int(ps[r] + ln[r]))))
            else:
                out.append((int(pids[group[0]]), int(cs[group[0]]),
                            torch.from_numpy(_run_elements(ps[group], ln[group]))))
    return out


def _find_block(hay: torch.Tensor, needle: torch.Tensor, most: int = 8) -> list[int]:
    """Every start at which ``needle`` (1-D bits) occurs in ``hay`` (1-D bits of the same width), or, when more
    than ``most`` candidates survive a few probes, ``most + 1`` of them (ambiguous: the caller only needs to
    know that there is not exactly one)."""
    n, k = int(hay.numel()), int(needle.numel())
    if not k or k > n:
        return []
    cand = torch.nonzero(hay[: n - k + 1] == needle[0]).reshape(-1)
    for probe in sorted({k - 1, k // 2, k // 3, (2 * k) // 3, 1} - {0}):
        if len(cand) <= most:
            break
        cand = cand[hay[cand + probe] == needle[probe]]
    found = [int(c) for c in cand[: 4 * most].tolist() if torch.equal(hay[c: c + k], needle)]
    return found[: most + 1]
