"""Checkpoint element -> engine parameter element map, recorded from the engine's own loader.

The map is recorded once by running the engine's ``load_weights(iterable of (name, tensor))`` on a
copy of the engine built with int64 parameters filled with -1, fed placeholder tensors whose
elements hold ``(tensor id << 40) | element index``. Whatever packing (fused qkv, gate_up), name
mapping and tensor-parallel slicing the loader does, it does to the placeholders, so afterwards
every parameter element says which checkpoint element it holds: no per-model tables.

The map is stored as *runs*: ``(checkpoint start, length, parameter, parameter start)`` over which
both sides advance by one, so a row slice is one run and a column slice one run per row.

Example::

    spec = {name: (t["shape"], t["dtype"]) for name, t in manifest["tensors"].items()}
    imap = IndexMap.record(lambda dtype: ToyEngine(cfg, tp_rank, tp_size, dtype=dtype), spec)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rltune.sync.format import MAX_TENSOR_ELEMENTS, IndexMapError

_ID_SHIFT = 40


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


class IndexMap:
    """Per checkpoint tensor, the runs of elements this engine worker holds."""

    def __init__(self, param_names: list[str], tensors: dict[str, TensorRuns]):
        self.param_names = param_names
        self.tensors = tensors

    @classmethod
    def record(cls, build_engine: Callable[[torch.dtype], torch.nn.Module],
               spec: dict[str, tuple[list[int], str]]) -> IndexMap:
        """Record by running ``build_engine(torch.int64).load_weights`` on placeholders.

        ``spec``: checkpoint name -> (shape, dtype name), e.g. from a manifest's ``tensors``.
        """
        engine = build_engine(torch.int64)
        params = dict(engine.named_parameters())
        for p in params.values():
            p.data.fill_(-1)
        names = list(spec)
        if len(names) >= 1 << (63 - _ID_SHIFT):
            raise IndexMapError(f"{len(names)} checkpoint tensors exceed the recorder's id space")

        def placeholders():
            for tid, name in enumerate(names):
                shape = spec[name][0]
                numel = int(np.prod(shape)) if shape else 1
                if numel > MAX_TENSOR_ELEMENTS:
                    raise IndexMapError(f"{name}: {numel} elements exceed 2^40")
                yield name, (torch.arange(numel, dtype=torch.int64) | (tid << _ID_SHIFT)).reshape(shape)

        engine.load_weights(placeholders())
        param_names = list(params)
        per_tensor: dict[int, list[np.ndarray]] = {}
        for pid, pname in enumerate(param_names):
            flat = params[pname].data.reshape(-1).numpy()
            pos = np.nonzero(flat >= 0)[0]
            vals = flat[pos]
            tids = vals >> _ID_SHIFT
            for tid in np.unique(tids):
                sel = tids == tid
                per_tensor.setdefault(int(tid), []).append(
                    np.stack([vals[sel] & ((1 << _ID_SHIFT) - 1), np.full(sel.sum(), pid), pos[sel]]))
        tensors = {}
        for tid, name in enumerate(names):
            shape = spec[name][0]
            numel = int(np.prod(shape)) if shape else 1
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
            starts = np.concatenate(([0], brk))
            lengths = np.diff(np.concatenate((starts, [len(ckpt)])))
            tensors[name] = TensorRuns(name, numel, ckpt[starts], lengths, pid[starts], pos[starts])
        return cls(param_names, tensors)
