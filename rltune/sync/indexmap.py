"""Checkpoint element -> engine parameter element map, recorded from the engine's own loader.

The map is recorded once by running the engine's ``load_weights(iterable of (name, tensor))`` on a
copy of the engine whose parameters are filled with a marker (NaN, or -1 for integer parameters),
fed placeholder tensors whose elements hold *codes*: ``BASE + g``, with ``g`` the element's index
in the concatenation of every checkpoint tensor (flat, in ``spec`` order). Whatever packing (fused
qkv, gate_up), name mapping and tensor-parallel slicing the loader does, it does to the codes, so
afterwards every parameter element says which checkpoint element it holds: no per-model tables.

An element still holding the marker was written by nothing. An element the loader set to a value
outside the code range (vLLM zero-fills the padding rows of its padded vocabulary) holds no
checkpoint element either: it is *engine-only*, and no delta, anchor or checksum touches it. Codes
start at ``BASE = 2**40``, far above any constant a loader writes, so a padding row can never
pass for element 0 of tensor 0. A code that is not an integer means the loader computed with the
values (a conversion that transforms them), which the delta path cannot follow: it raises.

The copy of the engine may hold its parameters as int64 or as float64 (an engine whose modules can
only be built with a floating default dtype, like vLLM's); float64 holds every code exactly as long
as the checkpoint has fewer than 2^53 - 2^40 elements.

The map is stored as *runs*: ``(checkpoint start, length, parameter, parameter start)`` over which
both sides advance by one, so a row slice is one run and a column slice one run per row.

Example::

    spec = {name: (t["shape"], t["dtype"]) for name, t in manifest["tensors"].items()}
    imap = IndexMap.record(lambda dtype: ToyEngine(cfg, tp_rank, tp_size, dtype=dtype), spec)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rltune.sync.format import MAX_TENSOR_ELEMENTS, IndexMapError

BASE = 1 << 40  # the first code; every checkpoint element's code is BASE + its global index
_FLOAT_EXACT = 1 << 53


@dataclass
class TensorRuns:
    """Where one checkpoint tensor's elements live in this worker's parameters."""

    name: str
    numel: int
    ckpt_start: np.ndarray  # int64 [R], ascending
    length: np.ndarray  # int64 [R]
    param: np.ndarray  # int64 [R], index into IndexMap.param_names
    param_start: np.ndarray  # int64 [R]

    @property
    def held(self) -> int:
        return int(self.length.sum())

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For checkpoint indices: (mask of held ones, their parameter ids, their parameter positions)."""
        r = np.searchsorted(self.ckpt_start, idx, side="right") - 1
        rc = np.clip(r, 0, None)
        held = (r >= 0) & (idx < self.ckpt_start[rc] + self.length[rc]) if len(self.ckpt_start) else np.zeros(len(idx), bool)
        rh = rc[held]
        return held, self.param[rh], self.param_start[rh] + idx[held] - self.ckpt_start[rh]


@dataclass
class IndexMap:
    """Per checkpoint tensor, the runs of elements this engine worker holds."""

    param_names: list[str]
    tensors: dict[str, TensorRuns]
    engine_only: dict[str, int] = field(default_factory=dict)  # parameter -> elements no checkpoint element fills
    # checkpoint name -> (shape, dtype) the map was recorded for: a manifest that differs in any name,
    # shape or dtype needs a new map (empty for a map built by hand: then only element counts are checked)
    spec: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    # recorded with ``post_load``: the map as the engine's loader left it, before post_load moved the
    # elements (where a loaded, unprocessed copy of the engine holds each checkpoint element); None otherwise
    loaded: IndexMap | None = None

    def fingerprint(self) -> str:
        """A digest of every run: two maps with the same fingerprint send every element to the same place."""
        import hashlib

        h = hashlib.sha256(repr(self.param_names).encode())
        for name in sorted(self.tensors):
            runs = self.tensors[name]
            h.update(name.encode())
            for a in (runs.ckpt_start, runs.length, runs.param, runs.param_start):
                h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()

    @classmethod
    def record(cls, build_engine: Callable[[torch.dtype], torch.nn.Module],
               spec: dict[str, tuple[list[int], str]], placeholder_dtype: torch.dtype = torch.int64,
               source: str = "the checkpoint",
               post_load: Callable[[torch.nn.Module], None] | None = None) -> IndexMap:
        """Record by running ``build_engine(placeholder_dtype).load_weights`` on placeholders.

        ``spec``: checkpoint name -> (shape, dtype name), e.g. from a manifest's ``tensors``.
        ``placeholder_dtype``: int64 or float64, the dtype the copy's parameters are built in.
        ``source`` names where ``spec`` came from (a manifest path) in error messages.
        ``post_load(engine)``: runs on the copy after ``load_weights``, for an engine that moves loaded
        elements again before it serves (vLLM's CPU fused-MoE repack); it must only move the codes
        within each parameter (set ``p.data`` of the same parameter objects), never compute with them.
        A parameter of the engine that no checkpoint element reaches raises :class:`IndexMapError`
        (the checkpoint is of another model), as does a tensor the loader refuses.
        """
        if placeholder_dtype not in (torch.int64, torch.float64):
            raise IndexMapError(f"placeholder_dtype must be torch.int64 or torch.float64, not {placeholder_dtype}")
        names = list(spec)
        numels = [_numel(name, spec[name][0]) for name in names]
        starts = np.concatenate(([0], np.cumsum(numels, dtype=np.int64))).astype(np.int64)
        total = int(starts[-1])
        if placeholder_dtype == torch.float64 and BASE + total > _FLOAT_EXACT:
            raise IndexMapError(f"{source}: {total} checkpoint elements exceed what float64 placeholders hold "
                                "exactly; build the recording engine with int64 parameters")
        engine = build_engine(placeholder_dtype)
        params = dict(engine.named_parameters())
        marker = -1 if placeholder_dtype == torch.int64 else float("nan")
        for p in params.values():
            if p.dtype != placeholder_dtype:
                raise IndexMapError(f"engine parameter is {p.dtype}, not the placeholder dtype {placeholder_dtype}: "
                                    "build_engine must make every parameter in the dtype it is given")
            p.data.fill_(marker)

        def placeholders():
            for name, shape, start, numel in zip(names, (spec[n][0] for n in names), starts[:-1].tolist(), numels,
                                                 strict=True):
                codes = torch.arange(BASE + start, BASE + start + numel, dtype=torch.int64)
                yield name, codes.to(placeholder_dtype).reshape(shape)

        try:
            engine.load_weights(placeholders())
        except (KeyError, AssertionError, ValueError, RuntimeError, IndexError) as exc:
            raise IndexMapError(f"{source}: the engine's load_weights refused the checkpoint's tensors "
                                f"({type(exc).__name__}: {exc}); the broadcast is of another model than the engine "
                                "serves: point the engine at the trainer's broadcast root") from None
        loaded = None
        if post_load is not None:
            loaded = cls._read(params, names, numels, starts, spec, placeholder_dtype, source)
            post_load(engine)
        imap = cls._read(params, names, numels, starts, spec, placeholder_dtype, source)
        imap.loaded = loaded
        return imap

    @classmethod
    def _read(cls, params: dict[str, torch.Tensor], names: list[str], numels: list[int], starts: np.ndarray,
              spec: dict[str, tuple[list[int], str]], placeholder_dtype: torch.dtype, source: str) -> IndexMap:
        """The map the codes in ``params`` spell."""
        total = int(starts[-1])
        param_names = list(params)
        runs: list[np.ndarray] = []  # rows of (tensor id, checkpoint start, length, parameter id, parameter start)
        engine_only: dict[str, int] = {}
        for pid, pname in enumerate(param_names):
            pos, g = _codes_held(params[pname].data.reshape(-1), placeholder_dtype, total, source, pname)
            if pos is None:
                continue
            if len(pos) < params[pname].numel():
                written_other = _written_elements(params[pname].data.reshape(-1), placeholder_dtype) - len(pos)
                if written_other:
                    engine_only[pname] = written_other
            if not len(pos):
                continue
            # maximal spans over which the parameter position and the code both advance by one (O(n))
            brk = np.flatnonzero((np.diff(pos) != 1) | (np.diff(g) != 1)) + 1
            first = np.concatenate(([0], brk))
            length = np.diff(np.concatenate((first, [len(pos)])))
            runs.append(_split_at_tensors(g[first], length, pos[first], pid, starts))
        tensors = {}
        table = np.concatenate(runs, axis=1) if runs else np.zeros((5, 0), dtype=np.int64)
        order = np.lexsort((table[1], table[0]))
        table = table[:, order]
        bounds = np.searchsorted(table[0], np.arange(len(names) + 1))
        for tid, name in enumerate(names):
            tid_runs = table[:, bounds[tid]:bounds[tid + 1]]
            _, ckpt, length, pid, pos = tid_runs
            if len(ckpt) > 1 and np.any(ckpt[1:] < ckpt[:-1] + length[:-1]):
                raise IndexMapError(f"{name}: the engine writes some checkpoint elements to two places in one worker; "
                                    "the delta path needs one place per element")
            tensors[name] = TensorRuns(name, numels[tid], ckpt.copy(), length.copy(), pid.copy(), pos.copy())
        return cls(param_names, tensors, engine_only, {n: (list(spec[n][0]), str(spec[n][1])) for n in names})


def _codes_held(flat: torch.Tensor, placeholder_dtype: torch.dtype, total: int, source: str, pname: str):
    """(positions, global indices) of the elements of one parameter that hold a checkpoint code."""
    if placeholder_dtype == torch.float64:
        written = ~torch.isnan(flat)
        if flat.numel() and not bool(written.any()):
            raise _foreign(source, pname)
        vals_f = flat[written]
        if not bool(torch.all(vals_f == torch.round(vals_f))):
            raise IndexMapError(f"{pname}: the engine's loader computes with checkpoint values (a code is no longer "
                                "an integer); the delta path needs plain copies")
        vals = vals_f.to(torch.int64).numpy()
        pos = np.flatnonzero(written.numpy())
    else:
        flat_np = flat.numpy()
        pos = np.flatnonzero(flat_np != -1)
        if flat_np.size and not len(pos):
            raise _foreign(source, pname)
        vals = flat_np[pos]
    code = (vals >= BASE) & (vals < BASE + total)
    if not code.all():
        pos, vals = pos[code], vals[code]
    return pos, vals - BASE


def _written_elements(flat: torch.Tensor, placeholder_dtype: torch.dtype) -> int:
    if placeholder_dtype == torch.float64:
        return int((~torch.isnan(flat)).sum())
    return int((flat != -1).sum())


def _split_at_tensors(g0: np.ndarray, length: np.ndarray, pos0: np.ndarray, pid: int, starts: np.ndarray) -> np.ndarray:
    """Runs of global indices as rows (tensor id, start in it, length, parameter id, parameter start),
    split where a run crosses from one checkpoint tensor into the next (q then k in a fused qkv)."""
    first_t = np.searchsorted(starts, g0, side="right") - 1
    last_t = np.searchsorted(starts, g0 + length - 1, side="right") - 1
    rows = [first_t, g0 - starts[first_t], length, np.full(len(g0), pid), pos0]
    out = np.stack(rows).astype(np.int64)
    crossing = np.flatnonzero(last_t > first_t)
    if not len(crossing):
        return out
    extra = []
    for r in crossing.tolist():
        g, n, p = int(g0[r]), int(length[r]), int(pos0[r])
        pieces = []
        while n:
            t = int(np.searchsorted(starts, g, side="right") - 1)
            take = min(n, int(starts[t + 1]) - g)
            pieces.append([t, g - int(starts[t]), take, pid, p])
            g, n, p = g + take, n - take, p + take
        extra.extend(pieces)
    keep = np.ones(out.shape[1], dtype=bool)
    keep[crossing] = False
    return np.concatenate([out[:, keep], np.array(extra, dtype=np.int64).T], axis=1)


def _numel(name: str, shape) -> int:
    numel = int(np.prod(shape)) if shape else 1
    if numel > MAX_TENSOR_ELEMENTS:
        raise IndexMapError(f"{name}: {numel} elements exceed 2^40")
    return numel


def _foreign(source: str, pname: str) -> IndexMapError:
    return IndexMapError(f"{source}: no checkpoint tensor reaches engine parameter {pname}; the broadcast is of "
                         "another model than the engine serves: point the engine at the trainer's broadcast root")
