"""Engine side: prefetch a step's changes while serving, patch weights in place, verify every tensor.

A :class:`DeltaReceiver` wraps one engine worker's parameters and an :class:`IndexMap` recorded
from the engine's own loader. ``prefetch(step)`` reads and decodes the parts of the tensors this
worker holds (while the engine keeps serving). ``apply(step)`` runs in the pause: TP rank 0 plans
(apply one delta, nothing, or reload the latest anchor and replay the deltas since) and broadcasts
the plan; every worker follows it; a failure on any worker fails the update on all (one flag
reduction), and every worker then marks itself invalid so the next update reloads and replays the
same way everywhere. After each load or apply the group checks, per checkpoint tensor, that the sum
of the workers' checksum shares equals multiplicity x the trainer's checksum; shares follow deltas
in O(changes) and are recomputed in full after an anchor load.

The apply function is pluggable (``apply_fn``) so a fused GPU kernel can replace the torch
reference :func:`rltune.sync.ops.apply_mapped_delta_ref` with the same signature.

Example::

    imap = IndexMap.record(lambda dt: ToyEngine(cfg, rank, tp, dtype=dt), spec)
    rx = DeltaReceiver("/shared/broadcast", engine, imap, group=tp_group)   # group=None: one worker
    rx.load_latest()                   # fresh engine: latest anchor (only the rows it holds) + replay
    rx.prefetch(43)                    # while serving
    rx.apply(43)                       # in the pause: patch in place + verify
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
from rltune.sync.indexmap import IndexMap, TensorRuns
from rltune.sync.kernels.cpu_kernels import checksum_bits
from rltune.sync.kernels.reference import MASK64, as_bits
from rltune.sync.ops import apply_mapped_delta_ref, wire_width
from rltune.sync.store import BroadcastStore

ApplyFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], int]
_BITS_NP = {8: np.dtype("u1"), 16: np.dtype("<i2"), 32: np.dtype("<i4")}
_DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32, "float8_e4m3fn": 8, "float8_e5m2": 8}


@dataclass
class UpdateReport:
    """What one ``apply``/``load_latest`` did."""

    action: str  # "none", "delta" or "reload"
    step: int
    anchor: int | None = None
    deltas: list[int] = field(default_factory=list)
    changes_applied: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds: plan, check, read, write, verify


class DeltaReceiver:
    """One engine worker's view of a broadcast root (see the module docstring)."""

    def __init__(self, root: str | Path, model: torch.nn.Module, index_map: IndexMap, *, group: Any = None,
                 apply_fn: ApplyFn = apply_mapped_delta_ref, fused: bool | None = None, fused_backend: str = "auto"):
        self.store = BroadcastStore(root)
        params = dict(model.named_parameters())
        missing = [n for n in index_map.param_names if n not in params]
        if missing:
            raise fmt.IndexMapError(f"index map names parameters {missing[:3]} the engine does not have; "
                                    "record the map from this engine")
        self.params = [params[n] for n in index_map.param_names]
        self.imap, self.group, self.apply_fn = index_map, group, apply_fn
        self.step: int | None = None
        self.run_id: str | None = None
        self.valid = False
        self.anchor_loads = 0
        self.deltas_applied = 0
        self._shares: dict[str, int] = {}
        self._multiplicity: dict[str, int] | None = None
        self._names: list[str] = []
        self._prefetched: dict[tuple[str, int], Any] = {}
        # fused: one multi-tensor kernel launch per delta (rltune.sync.kernels.ApplyPlan) with the
        # changes staged on the device at prefetch; None = when the parameters are on a GPU.
        self._fused = (self.params[0].device.type == "cuda") if fused is None else fused
        self._fused_backend = fused_backend
        self._apply_plan = None
        self._layout_of: dict[str, int] = {}
        self._plan_names: list[str] = []
        self._plan_addresses: list[int] = []

    # ------------------------------------------------------------------------- group plumbing

    @property
    def rank(self) -> int:
        if self.group is None:
            return 0
        import torch.distributed as dist
        return dist.get_rank(self.group)

    def _allreduce(self, values: list[int], op: str = "sum") -> list[int]:
        if self.group is None or not values:
            return [v & MASK64 for v in values] if op == "sum" else values
        import torch.distributed as dist
        signed = [v - (1 << 64) if v >= 1 << 63 else v for v in (x & MASK64 for x in values)]
        t = torch.tensor(signed, dtype=torch.int64)
        every = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        try:
            dist.all_gather(every, t, group=self.group)
        except RuntimeError as exc:  # gloo's time-out or a peer that went away
            self.valid = False
            raise fmt.UpdateFailedError(f"another worker of this TP group did not answer ({exc}); this worker stays "
                                        "invalid and reloads the latest anchor at its next update") from None
        columns = list(zip(*(g.tolist() for g in every), strict=True))
        # the sum is taken modulo 2^64: exactly the checksum ring
        return [sum(c) & MASK64 for c in columns] if op == "sum" else [max(c) for c in columns]

    def _broadcast_plan(self, plan: dict | None) -> dict:
        if self.group is None:
            return plan
        import torch.distributed as dist
        box = [plan]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        except RuntimeError as exc:
            self.valid = False
            raise fmt.UpdateFailedError(f"TP rank 0 did not send its plan ({exc}); this worker stays invalid and "
                                        "reloads the latest anchor at its next update") from None
        return box[0]

    # ------------------------------------------------------------------------- static checks

    def _check_static(self, manifest: dict[str, Any]) -> None:
        """Once per index map: dtypes match and the group covers each tensor evenly (multiplicity)."""
        names = sorted(manifest["tensors"])
        if self._multiplicity is not None and names == self._names:
            return
        counts, possums, dtype_error = [], [], None
        for name in names:
            t = manifest["tensors"][name]
            runs = self.imap.tensors.get(name)
            held = runs.held if runs is not None else 0
            if held:
                for pid in np.unique(runs.param):
                    p = self.params[int(pid)]
                    if str(p.dtype).removeprefix("torch.") != t["dtype"] and dtype_error is None:
                        dtype_error = fmt.IndexMapError(f"{name}: engine parameter {self.imap.param_names[pid]} is {p.dtype}, "
                                                f"checkpoint is {t['dtype']}: casting loads are not patchable in place")
                ps = runs.length * (runs.ckpt_start + 1) + runs.length * (runs.length - 1) // 2
                possums.append(int(sum(int(x) for x in ps)) & MASK64)
            else:
                possums.append(0)
            counts.append(held)
        counts_all = self._allreduce(counts)
        possums_all = self._allreduce(possums)
        if dtype_error is not None:  # raised after the reductions, which every worker must issue
            raise dtype_error
        mult = {}
        for name, c, s in zip(names, counts_all, possums_all, strict=True):
            shape = manifest["tensors"][name]["shape"]
            numel = int(np.prod(shape)) if shape else 1
            if c == 0:
                continue
            m = c // numel
            if c % numel or (m * (numel * (numel + 1) // 2)) & MASK64 != s:
                raise fmt.IndexMapError(f"{name}: the TP group holds {c} element copies of {numel}, not an even cover; "
                                        "its checksum cannot be verified")
            mult[name] = m
        self._names, self._multiplicity = names, mult
        if self._fused:
            self._fused_plan(manifest)

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
        step_dir = self.store.step_dir(step)
        out = []
        for f in manifest[key]:
            path = fmt.safe_child(step_dir, f["file"])
            kind = "delta" if key == "parts" else "anchor"
            expect = dict(kind=kind, run_id=manifest["run_id"], step=step, rank=f["rank"], world=manifest["world"],
                          base_step=manifest["base_step"] if kind == "delta" else None)
            header, start = fmt.read_part_header(path, expect=expect, expect_bytes=f["bytes"])
            for e in header["entries"]:
                t = manifest["tensors"].get(e["name"])
                if t is None or (kind == "delta" and t["tied_to"] is not None):
                    raise fmt.ManifestSchemaError(f"{path}: entry {e['name']!r} is not a manifest tensor it may carry")
                numel = int(np.prod(t["shape"])) if t["shape"] else 1
                if e["stop"] > numel:
                    raise fmt.ManifestSchemaError(f"{path}: entry {e['name']} range ends at {e['stop']} > {numel} elements")
            out.append((path, start, header))
        return out

    def _decoded_entries(self, step: int):
        """Each delta entry this worker holds any of, decoded: (checkpoint names it lands in, idx, diff).

        A tied tensor's changes land in every name tied to it; an entry whose tensors this worker
        does not hold is not even decoded.
        """
        m = self.store.manifest(step)
        if m["kind"] == "full":
            raise fmt.ChainError(f"{self.store.step_dir(step)}: step {step} is a full checkpoint, not a delta")
        tied: dict[str, list[str]] = {}
        for name, t in m["tensors"].items():
            if t["tied_to"] is not None:
                tied.setdefault(t["tied_to"], []).append(name)
        for path, start, header in self._part_paths(step, m, "parts"):
            for e in header["entries"]:
                targets = [n for n in [e["name"], *tied.get(e["name"], [])]
                           if n in self.imap.tensors and self.imap.tensors[n].held]
                if not targets:
                    continue
                bits = _DTYPE_BITS[m["tensors"][e["name"]]["dtype"]]
                idx, diff = codec.decode(fmt.read_entry_bytes(path, start, e), e["start"], e["stop"], bits)
                if len(idx) != e["changes"]:
                    raise fmt.CodecError(f"{path}: entry {e['name']} decodes to {len(idx)} changes, header says {e['changes']}")
                yield targets, idx, diff

    def _read_changes(self, step: int) -> dict[str, list]:
        """This worker's changes of a delta step: name -> [(param id, positions, diffs, checkpoint idx)]."""
        changes: dict[str, list] = {}
        for targets, idx, diff in self._decoded_entries(step):
            for name in targets:
                held, pid, pos = self.imap.tensors[name].locate(idx)
                hidx, hdiff = idx[held], diff[held]
                for p in np.unique(pid):
                    sel = pid == p
                    changes.setdefault(name, []).append((int(p), torch.from_numpy(pos[sel]),
                                                         torch.from_numpy(hdiff[sel]), torch.from_numpy(hidx[sel])))
        return changes

    def _stage_changes(self, step: int) -> dict[str, Any]:
        """A delta step's changes for the fused kernel, as one flat batch already on the device.

        Entries follow the parts; each names a layout (checkpoint tensor; a tied tensor gets its
        own entry with the same changes); the kernel skips changes this worker does not hold.
        """
        self._fused_plan(self.store.manifest(step))
        layouts, idx_parts, val_parts = [], [], []
        for targets, idx, diff in self._decoded_entries(step):
            # differences wrap modulo 2^bits; as int32 (sign-wrapped) they add exactly in the kernel
            val = ((diff + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)
            for name in targets:
                layouts.append(self._layout_of[name])
                idx_parts.append(idx)
                val_parts.append(val)
        lengths = [len(i) for i in idx_parts]
        host = dict(entry_tensor_E=torch.tensor(layouts, dtype=torch.int64),
                    entry_offsets_E1=torch.tensor(np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))),
                    idx_C=torch.from_numpy(np.concatenate(idx_parts) if idx_parts else np.zeros(0, np.int64)),
                    val_C=torch.from_numpy((np.concatenate(val_parts) if val_parts else np.zeros(0, np.int64))
                                           .astype(np.int32)))
        dev = self.params[0].device
        if dev.type == "cuda":
            host = {k: v.pin_memory().to(dev, non_blocking=True) for k, v in host.items()}
            torch.cuda.current_stream(dev).synchronize()  # staged before the pause; the pinned copies may go
        return dict(host, entry_names=[self._plan_names[li] for li in layouts])

    # ------------------------------------------------------------------------- public API

    def prefetch(self, step: int) -> bool:
        """Read and decode ``step``'s parts for this worker; False if it is not (yet) a readable delta.

        Errors are not raised here: ``apply`` re-reads and reports them in the pause.
        """
        try:
            m = self.store.manifest(step)
            if m["kind"] == "full":
                return False
            read = self._stage_changes if self._fused else self._read_changes
            self._prefetched = {(m["run_id"], step): read(step)}
            return True
        except RltuneError:
            self.store.forget(step)
            return False

    def apply(self, step: int) -> UpdateReport:
        """Bring this worker (and its TP group) to ``step``, then verify; raises on any failure."""
        return self._update(lambda: self._plan(step))

    def load_latest(self) -> UpdateReport:
        """Fresh, relaunched or failed engine: latest complete anchor (held rows only), replay, verify."""
        def plan():
            steps = self.store.complete_steps()
            if not steps:
                raise fmt.ChainError(f"{self.store.root}: no complete step to load yet")
            self.valid = False
            return self._plan(steps[-1])
        return self._update(plan)

    # ------------------------------------------------------------------------- planning and execution

    def _plan(self, target: int) -> dict:
        m = self.store.manifest(target)
        if self.valid and self.run_id == m["run_id"] and self.step == target:
            return dict(action="none", target=target, anchor=None, deltas=[])
        if self.valid and self.run_id == m["run_id"] and m["kind"] != "full" and m["base_step"] == self.step:
            return dict(action="delta", target=target, anchor=None, deltas=[target])
        anchor, deltas = self.store.chain(target)
        return dict(action="reload", target=target, anchor=anchor, deltas=deltas)

    def _update(self, make_plan: Callable[[], dict]) -> UpdateReport:
        t0 = time.perf_counter()
        phases: dict[str, float] = {}

        def timed(name: str, fn: Callable[[], Any]) -> Any:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

        plan = None
        if self.rank == 0:
            try:
                plan = timed("plan", make_plan)
            except RltuneError as e:
                plan = dict(error=e)  # every worker raises rank 0's own error (type and message)
        plan = self._broadcast_plan(plan)
        if "error" in plan:
            self.valid = False
            raise plan["error"]
        report = UpdateReport(plan["action"], plan["target"], plan["anchor"], list(plan["deltas"]), phases=phases)
        if plan["action"] == "none":
            return report
        timed("check", lambda: self._group_phase(self.before_write))
        self.valid = False
        manifest = timed("check", lambda: self._group_phase(lambda: self.store.manifest(plan["target"])))
        timed("check", lambda: self._group_phase(lambda: self._check_static(manifest)))
        if plan["action"] == "reload":
            staged = timed("read", lambda: self._group_phase(lambda: self._read_anchor(plan["anchor"])))
            timed("write", lambda: self._group_phase(lambda: self._write_anchor(plan["anchor"], staged)))
            timed("verify", lambda: self._verify(plan["anchor"]))
        for step in plan["deltas"]:
            # every worker has read and decoded the delta before any worker writes a change of it
            staged = timed("read", lambda s=step: self._group_phase(lambda: self._staged_delta(s)))
            report.changes_applied += timed("write", lambda s=step, st=staged: self._group_phase(
                lambda: self._apply_delta(s, st)))
            timed("verify", lambda s=step: self._verify(s))
        self.valid, self.step, self.run_id = True, plan["target"], manifest["run_id"]
        report.seconds = time.perf_counter() - t0
        return report

    def _group_phase(self, fn: Callable[[], Any]) -> Any:
        """Run local work; if it fails on any worker, every worker raises (and stays invalid).

        Any exception counts, not only rltune's own: a worker that left the phase without the flag
        reduction would leave the others waiting in it until the group's time-out.
        """
        err: Exception | None = None
        result = None
        try:
            result = fn()
        except Exception as e:  # re-raised below, after every worker has said whether it failed
            err = e
        (failed,) = self._allreduce([1 if err else 0], op="max")
        if err is not None:
            raise err
        if failed:
            raise fmt.UpdateFailedError("the update failed on another worker of this TP group; "
                                    "every worker will reload the latest anchor and replay at the next update")
        return result

    def _staged_delta(self, step: int) -> Any:
        """``step``'s changes for this worker: the prefetched ones, or read and decoded now."""
        key = (self.store.manifest(step)["run_id"], step)
        staged = self._prefetched.pop(key, None)
        self._prefetched.clear()
        if staged is None:
            staged = self._stage_changes(step) if self._fused else self._read_changes(step)
        return staged

    def _apply_delta(self, step: int, staged: Any) -> int:
        if self._fused:
            return self._apply_fused(step, staged)
        applied = 0
        for name, items in staged.items():
            change = 0
            for pid, pos, diff, idx in items:
                p = self.params[pid]
                dev = p.device
                change += self.apply_fn(as_bits(p.data), pos.to(dev), diff.to(dev), idx.to(dev))
                applied += int(pos.numel())
            self._shares[name] = (self._shares.get(name, 0) + change) & MASK64
        self.step = step
        self.deltas_applied += 1
        return applied

    def _apply_fused(self, step: int, staged: dict[str, Any]) -> int:
        """One kernel launch patches every tensor; one host sync reads the per-entry checksum changes."""
        plan = self._fused_plan(self.store.manifest(step))
        result = plan.apply(staged["entry_tensor_E"], staged["entry_offsets_E1"], staged["idx_C"], staged["val_C"],
                            add=True)
        changes, written = result.to_host()
        for name, change in zip(staged["entry_names"], changes, strict=True):
            self._shares[name] = (self._shares.get(name, 0) + change) & MASK64
        self.step = step
        self.deltas_applied += 1
        return int(sum(written))

    def _read_anchor(self, step: int) -> list[tuple[str, list[tuple[int, int, torch.Tensor]]]]:
        """Every row of ``step``'s anchor this worker holds, read and CRC-checked, nothing written yet:
        per checkpoint tensor, (parameter id, first parameter element, wire bits) pieces."""
        m = self.store.manifest(step)
        by_name: dict[str, list] = {}
        for path, start, header in self._part_paths(step, m, "anchors"):
            for e in header["entries"]:
                by_name.setdefault(e["name"], []).append((path, start, e))
        staged = []
        for name, runs in self.imap.tensors.items():
            if not runs.held or name not in m["tensors"]:
                continue
            bits = _DTYPE_BITS[m["tensors"][name]["dtype"]]
            pieces = self._read_tensor(name, runs, by_name.get(name, []), bits)
            written = sum(int(src.numel()) for _, _, src in pieces)
            if written != runs.held:
                raise fmt.ChainError(f"{self.store.step_dir(step)}: anchor slices cover {written} of the {runs.held} "
                                     f"elements of {name} this worker holds")
            staged.append((name, pieces))
        return staged

    def _write_anchor(self, step: int, staged: list[tuple[str, list[tuple[int, int, torch.Tensor]]]]) -> None:
        self._shares = {}
        for name, pieces in staged:
            for pid, pos, src in pieces:
                dst = as_bits(self.params[pid].data)
                dst[pos: pos + src.numel()] = src.to(dst.device)
            self._shares[name] = self._full_share(self.imap.tensors[name])
        self.step = step
        self.anchor_loads += 1

    def _read_tensor(self, name: str, runs: TensorRuns, entries: list, bits: int) -> list[tuple[int, int, torch.Tensor]]:
        itemsize = bits // 8
        lo_held, hi_held = int(runs.ckpt_start.min()), int((runs.ckpt_start + runs.length).max())
        pieces = []
        for path, start, e in entries:
            lo, hi = max(lo_held, e["start"]), min(hi_held, e["stop"])
            if lo >= hi:
                continue
            raw = fmt.read_anchor_range(path, start, e, (lo - e["start"]) * itemsize, (hi - e["start"]) * itemsize)
            src = torch.from_numpy(np.frombuffer(raw, dtype=_BITS_NP[bits]).copy())
            for cs, ln, pid, ps in zip(runs.ckpt_start.tolist(), runs.length.tolist(), runs.param.tolist(),
                                       runs.param_start.tolist(), strict=True):
                a, b = max(cs, lo), min(cs + ln, hi)
                if a >= b:
                    continue
                width = wire_width(as_bits(self.params[pid].data))
                if width != bits:
                    raise fmt.IndexMapError(f"{name}: engine parameter has {width}-bit elements, checkpoint {bits}")
                pieces.append((pid, ps + a - cs, src[a - lo: b - lo]))
        return pieces

    def _full_share(self, runs: TensorRuns) -> int:
        total = 0
        for cs, ln, pid, ps in zip(runs.ckpt_start.tolist(), runs.length.tolist(), runs.param.tolist(),
                                   runs.param_start.tolist(), strict=True):
            total += checksum_bits(as_bits(self.params[pid].data)[ps: ps + ln], offset=cs)
        return total & MASK64

    def before_write(self) -> None:
        """Runs on every worker, as one group phase, before an update writes anything.

        The base receiver checks nothing; an engine integration (``rltune.sync.vllm``) checks here
        that the parameters it writes are still the ones the engine computes with.
        """

    def recompute_shares(self) -> None:
        """Recompute every share from the parameters (O(weights)); for checks after outside writes."""
        self._shares = {n: self._full_share(r) for n, r in self.imap.tensors.items() if r.held}

    def _verify(self, step: int) -> None:
        m = self.store.manifest(step)
        names = [n for n in self._names if n in self._multiplicity]
        sums = self._allreduce([self._shares.get(n, 0) for n in names])
        bad = [n for n, s in zip(names, sums, strict=True)
               if s != (self._multiplicity[n] * int(m["tensors"][n]["checksum"])) & MASK64]
        if bad:
            self.valid = False
            raise fmt.ChecksumMismatchError(
                f"{self.store.step_dir(step)}: {len(bad)} tensor(s) differ from the trainer checksum after the update, "
                f"first {bad[0]}; the next update reloads the latest anchor and replays")
