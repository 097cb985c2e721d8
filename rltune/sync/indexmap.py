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

    @classmethod
    def record(cls, build_engine: Callable[[torch.dtype], torch.nn.Module],
               spec: dict[str, tuple[list[int], str]], placeholder_dtype: torch.dtype = torch.int64,
               source: str = "the checkpoint") -> IndexMap:
        """Record by running ``build_engine(placeholder_dtype).load_weights`` on placeholders.

        ``spec``: checkpoint name -> (shape, dtype name), e.g. from a manifest's ``tensors``.
        ``placeholder_dtype``: int64 or float64, the dtype the copy's parameters are built in.
        ``source`` names where ``spec`` came from (a manifest path) in error messages.
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
        param_names = list(params)
        per_tensor: dict[int, list[np.ndarray]] = {}
        engine_only: dict[str, int] = {}
        for pid, pname in enumerate(param_names):
            flat = params[pname].data.reshape(-1)
            if placeholder_dtype == torch.float64:
                written = ~torch.isnan(flat)
                if not bool(written.any()) and flat.numel():
                    raise _foreign(source, pname)
                vals_f = flat[written]
                if not bool(torch.all(vals_f == torch.round(vals_f))):
                    raise IndexMapError(f"{pname}: the engine's loader computes with checkpoint values (a code "
                                        "is no longer an integer); the delta path needs plain copies")
                vals = vals_f.to(torch.int64).numpy()
                pos = np.nonzero(written.numpy())[0]
            else:
                flat_np = flat.numpy()
                pos = np.nonzero(flat_np != -1)[0]
                if not len(pos) and flat_np.size:
                    raise _foreign(source, pname)
                vals = flat_np[pos]
            code = (vals >= BASE) & (vals < BASE + total)
            if (~code).any():
                engine_only[pname] = int((~code).sum())
            pos, g = pos[code], vals[code] - BASE
            tids = np.searchsorted(starts, g, side="right") - 1
            for tid in np.unique(tids):
                sel = tids == tid
                per_tensor.setdefault(int(tid), []).append(
                    np.stack([g[sel] - starts[tid], np.full(int(sel.sum()), pid), pos[sel]]))
        tensors = {}
        for tid, name in enumerate(names):
            numel = numels[tid]
            if tid not in per_tensor:
                empty = np.zeros(0, dtype=np.int64)
                tensors[name] = TensorRuns(name, numel, empty, empty, empty, empty)
                continue
            ckpt, pid, pos = np.concatenate(per_tensor[tid], axis=1)
            order = np.argsort(ckpt, kind="stable")
            ckpt, pid, pos = ckpt[order], pid[order], pos[order]
            if np.any(np.diff(ckpt) == 0):
                raise IndexMapError(f"{name}: the engine writes some checkpoint elements to two places in one worker; "
                                    "the delta path needs one place per element")
            brk = np.nonzero((np.diff(ckpt) != 1) | (np.diff(pos) != 1) | (np.diff(pid) != 0))[0] + 1
            run_starts = np.concatenate(([0], brk))
            lengths = np.diff(np.concatenate((run_starts, [len(ckpt)])))
            tensors[name] = TensorRuns(name, numel, ckpt[run_starts], lengths, pid[run_starts], pos[run_starts])
        return cls(param_names, tensors, engine_only)


def _numel(name: str, shape) -> int:
    numel = int(np.prod(shape)) if shape else 1
    if numel > MAX_TENSOR_ELEMENTS:
        raise IndexMapError(f"{name}: {numel} elements exceed 2^40")
    return numel


def _foreign(source: str, pname: str) -> IndexMapError:
    return IndexMapError(f"{source}: no checkpoint tensor reaches engine parameter {pname}; the broadcast is of "
                         "another model than the engine serves: point the engine at the trainer's broadcast root")
