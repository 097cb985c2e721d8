"""Trainer tensor element -> checkpoint tensor element map, recorded once from the model's own conversion.

A trainer names and lays out its tensors as its modules hold them; the engines load the checkpoint.
The two differ where transformers converts between them: transformers 5 keeps a MoE's experts fused
(Qwen3-MoE's ``mlp.experts.gate_up_proj`` is one ``[E, 2I, H]`` tensor) while the checkpoint stores
``mlp.experts.{e}.gate_proj.weight``, ``up_proj`` and ``down_proj`` per expert. Deltas, anchors and
checksums are written in checkpoint names and coordinates, so that an engine loads them as it loads
the checkpoint.

:func:`record_conversion` replays the conversion ``save_pretrained`` applies (transformers'
``revert_weight_conversion``, trainer -> checkpoint) once, on placeholder tensors whose elements
hold *codes* ``BASE + g`` (float64; ``g`` the element's index in the concatenation of the trainer
tensors one converter takes together), and reads from every checkpoint tensor it produces where
each trainer element landed. No per-model tables: whatever stacking, splitting or permuting the
mapping does, it does to the codes. Tensors the mapping only renames (every tensor of a dense model)
take no placeholder at all: they map whole, to the name transformers gives them.

Memory: placeholders are made one converter group at a time (one layer's fused expert tensor, or
the tensors one converter concatenates), so recording holds about 16 bytes per element of the
largest group (its codes and the checkpoint tensors made of them), never the model.

A conversion that computes with the values (a scale, a sum, a transpose with arithmetic, a cast of
the dtype) cannot carry a sparse delta; the codes show it: a checkpoint element that holds no exact
code, a code written twice, or a trainer element written nowhere raises :class:`ConversionError`
naming the trainer tensor and the checkpoint tensor.

The map is stored as *runs* ``(trainer flat start, length, checkpoint id, checkpoint flat start)``
over which both sides advance by one: a whole tensor is one run, a Qwen3-MoE expert projection one
run per expert (``O(E)`` per fused tensor).

Example::

    conv = record_conversion(model)               # before or after fully_shard: reads names and shapes
    conv.checkpoint_tensors()                     # {ckpt name: (shape, dtype)}, what the engine loads
    for t0, n, ckpt, c0 in conv.runs_in(name, a, b):   # this rank's flat slice [a, b) of a trainer tensor
        ...                                       # elements t0..t0+n-1 are conv.ckpt_names[ckpt][c0..c0+n-1]
    ids, pos = conv.locate(name, changed_idx)     # vectorized, for the step's changed elements
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from rltune.errors import RltuneError
from rltune.sync.indexmap import BASE, _split_at_tensors

_FLOAT_EXACT = 1 << 53


class ConversionError(RltuneError):
    """The trainer -> checkpoint conversion cannot carry a sparse delta, or was asked about a tensor it lacks."""


Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class Conversion:
    """Where every element of every trainer tensor lies in the checkpoint.

    ``trainer``: trainer name -> (shape, dtype), in the model's state-dict order.
    ``ckpt_names``: the checkpoint tensors, in the order ``save_pretrained`` writes them; a run's
    checkpoint id indexes this list. ``ckpt_spec``: checkpoint name -> (shape, dtype).
    ``table``: trainer name -> int64 ``[4, R]``: trainer flat start (ascending), length, checkpoint
    id, checkpoint flat start; the runs cover the trainer tensor's elements exactly once.
    """

    trainer: Spec
    ckpt_names: list[str]
    ckpt_spec: Spec
    table: dict[str, np.ndarray]
    _on_device: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    # -- the contract the publisher reads -------------------------------------------------------
    def checkpoint_tensors(self) -> Spec:
        """Checkpoint name -> (shape, dtype): the tensors deltas, anchors and checksums are written for."""
        return {n: self.ckpt_spec[n] for n in self.ckpt_names}

    def trainer_tensors(self) -> Spec:
        """Trainer name -> (shape, dtype): the tensors the map was recorded for."""
        return dict(self.trainer)

    def runs(self, trainer_name: str) -> list[tuple[int, int, str, int]]:
        """``(trainer_flat_start, length, ckpt_name, ckpt_flat_start)`` covering the tensor once, ascending."""
        t = self._table(trainer_name)
        return [(int(a), int(n), self.ckpt_names[int(c)], int(p)) for a, n, c, p in t.T.tolist()]

    def runs_in(self, trainer_name: str, start: int, stop: int) -> list[tuple[int, int, str, int]]:
        """The runs of the flat slice ``[start, stop)`` only (an FSDP rank's dim-0 shard), clipped to it."""
        t = self._table(trainer_name)
        numel = _numel(self.trainer[trainer_name][0])
        if not 0 <= start <= stop <= numel:
            raise ConversionError(f"{trainer_name}: slice [{start}, {stop}) is outside its {numel} elements")
        first = int(np.searchsorted(t[0], start, side="right")) - 1
        out = []
        for a, n, c, p in t[:, max(first, 0):].T.tolist():
            if a >= stop:
                break
            lo, hi = max(a, start), min(a + n, stop)
            if hi > lo:
                out.append((lo, hi - lo, self.ckpt_names[c], p + lo - a))
        return out

    def locate(self, trainer_name: str, flat_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flat indices of a trainer tensor: (checkpoint ids into ``ckpt_names``, checkpoint flat indices).

        Vectorized, on ``flat_idx``'s device; indices outside the tensor raise :class:`ConversionError`.
        """
        numel = _numel(self._spec(trainer_name)[0])
        idx = flat_idx.reshape(-1).to(torch.int64)
        if idx.numel() and (bool(idx.min() < 0) or bool(idx.max() >= numel)):
            raise ConversionError(f"{trainer_name}: locate was given an index outside its {numel} elements")
        table = self._device_table(trainer_name, idx.device)
        r = torch.searchsorted(table[0], idx, right=True) - 1
        return table[2][r], table[3][r] + idx - table[0][r]

    @property
    def is_identity(self) -> bool:
        """Every trainer tensor is the checkpoint tensor of the same name, shape and dtype, element for element."""
        if set(self.trainer) != set(self.ckpt_spec):
            return False
        for name, t in self.table.items():
            if t.shape[1] != 1 or self.ckpt_names[int(t[2, 0])] != name or self.ckpt_spec[name] != self.trainer[name]:
                return False
        return True

    # -- helpers built on the runs ----------------------------------------------------------------
    def to_checkpoint(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors made of trainer tensors (every trainer tensor given, full size), through the runs."""
        missing = [n for n in self.trainer if n not in tensors]
        if missing:
            raise ConversionError(f"to_checkpoint needs every trainer tensor; missing {missing[:3]}")
        any_t = next(iter(tensors.values()), None)
        device = any_t.device if any_t is not None else torch.device("cpu")
        out = {n: torch.empty(shape, dtype=dtype, device=device) for n, (shape, dtype) in self.ckpt_spec.items()}
        flat_out = {n: t.view(-1) for n, t in out.items()}
        for name, t in self.table.items():
            src = tensors[name].detach().reshape(-1)
            for a, n, c, p in t.T.tolist():
                flat_out[self.ckpt_names[c]][p:p + n] = src[a:a + n]
        return out

    def fingerprint(self) -> str:
        """A digest of every name, shape, dtype and run: equal fingerprints, equal maps."""
        h = hashlib.sha256(repr([(n, self.ckpt_spec[n]) for n in self.ckpt_names]).encode())
        for name in self.trainer:
            h.update(repr((name, self.trainer[name])).encode())
            h.update(np.ascontiguousarray(self.table[name], dtype=np.int64).tobytes())
        return h.hexdigest()

    def _spec(self, trainer_name: str):
        try:
            return self.trainer[trainer_name]
        except KeyError:
            raise ConversionError(f"{trainer_name}: not a tensor of the model the conversion was recorded for; "
                                  "record it again from this model") from None

    def _table(self, trainer_name: str) -> np.ndarray:
        self._spec(trainer_name)
        return self.table[trainer_name]

    def _device_table(self, trainer_name: str, device: torch.device) -> torch.Tensor:
        key = (trainer_name, str(device))
        if key not in self._on_device:
            self._on_device[key] = torch.from_numpy(self._table(trainer_name)).to(device)
        return self._on_device[key]


def record_conversion(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None) -> Conversion:
    """Record where each element of ``model``'s tensors lands in the checkpoint ``save_pretrained`` writes.

    ``state_dict``: the trainer tensors (default ``model.state_dict()``); only names, global shapes
    (a DTensor's ``shape``) and dtypes are read, never values. A model that is no transformers
    ``PreTrainedModel`` has no conversion: the identity. Tied names are kept, each under its own
    name (the publisher sends a tied weight's deltas once, under its first name).
    """
    tensors = model.state_dict() if state_dict is None else state_dict
    trainer: Spec = {n: (tuple(int(s) for s in t.shape), t.dtype) for n, t in tensors.items()}
    for name, (shape, _) in trainer.items():
        if _numel(shape) > _FLOAT_EXACT - BASE:
            raise ConversionError(f"{name}: {_numel(shape)} elements exceed what float64 placeholders hold exactly")
    if not _is_transformers_model(model):
        return _identity(trainer)
    from transformers.core_model_loading import revert_weight_conversion

    def convert(sd):
        try:
            return revert_weight_conversion(model, sd)
        except (KeyError, ValueError, RuntimeError, IndexError, TypeError) as exc:
            raise ConversionError(f"{', '.join(list(sd)[:3])}: transformers' conversion to the checkpoint failed "
                                  f"({type(exc).__name__}: {exc})") from None

    # The whole conversion on meta tensors (no memory): the checkpoint names, shapes and dtypes, in save order.
    try:
        whole = convert({n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in trainer.items()})
        whole_spec: Spec | None = {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}
    except NotImplementedError:  # an op without a meta kernel: the placeholder passes alone decide
        whole_spec = None

    produced: dict[str, tuple[tuple[int, ...], torch.dtype, list[str]]] = {}  # ckpt name -> shape, dtype, sources
    rows: dict[str, list[np.ndarray]] = {n: [] for n in trainer}  # trainer name -> [4, r] pieces, ckpt by name
    ckpt_ids: dict[str, int] = {}
    for members, renamed, converted in _groups(model, list(trainer)):
        if not converted:  # a rename: the tensor lands whole under its new name
            (name,) = members
            _claim(produced, renamed, trainer[name][0], trainer[name][1], members)
            cid = ckpt_ids.setdefault(renamed, len(ckpt_ids))
            rows[name].append(np.array([[0], [_numel(trainer[name][0])], [cid], [0]], dtype=np.int64))
            continue
        _replay(convert, members, trainer, produced, rows, ckpt_ids)

    if whole_spec is not None:
        got = {n: s for n, (s, _, _) in produced.items()}
        if got != {n: s for n, (s, _) in whole_spec.items()}:
            extra, lost = sorted(set(got) - set(whole_spec)), sorted(set(whole_spec) - set(got))
            changed = sorted(n for n in set(got) & set(whole_spec) if got[n] != whole_spec[n][0])
            raise ConversionError(
                "the conversion replayed converter by converter differs from transformers' whole-model conversion "
                f"(only here: {extra[:3]}, only there: {lost[:3]}, other shape: {changed[:3]}); "
                "this transformers version groups tensors differently: report it with the model's class")
        # the dtypes the real tensors get (a cast shows here, where float64 codes would hide a cast to float32)
        produced = {n: (s, whole_spec[n][1], src) for n, (s, _, src) in produced.items()}
        order = list(whole_spec)
    else:
        order = sorted(produced, key=_natural_key)
    for cname, (_, cdtype, sources) in produced.items():
        for src in sources:
            if trainer[src][1] != cdtype:
                raise ConversionError(f"trainer tensor {src} ({trainer[src][1]}) -> checkpoint tensor {cname} "
                                      f"({cdtype}): the conversion casts the values; a delta needs one dtype on both "
                                      "sides: train the tensor in the checkpoint's dtype")
    remap = np.array([order.index(n) for n in sorted(ckpt_ids, key=ckpt_ids.get)], dtype=np.int64)
    table = {}
    for name in trainer:
        t = np.concatenate(rows[name], axis=1)
        t[2] = remap[t[2]]
        t = t[:, np.argsort(t[0], kind="stable")]
        _check_cover(name, _numel(trainer[name][0]), t, order)
        table[name] = np.ascontiguousarray(t)
    return Conversion(trainer, order, {n: (produced[n][0], produced[n][1]) for n in order}, table)


def _replay(convert, members: list[str], trainer: Spec, produced, rows, ckpt_ids) -> None:
    """Run one converter group on codes and append, per trainer tensor, the runs its elements form."""
    numels = [_numel(trainer[n][0]) for n in members]
    starts = np.concatenate(([0], np.cumsum(numels, dtype=np.int64))).astype(np.int64)
    total = int(starts[-1])
    placeholders = {}
    for name, start, numel in zip(members, starts[:-1].tolist(), numels, strict=True):
        codes = torch.arange(BASE + start, BASE + start + numel, dtype=torch.float64)
        placeholders[name] = codes.reshape(trainer[name][0])
    out = convert(placeholders)
    del placeholders
    who = " + ".join(members)
    for cname in list(out):
        t = out.pop(cname)
        shape = tuple(int(d) for d in t.shape)
        if t.dtype != torch.float64:
            raise ConversionError(f"trainer tensor {who} -> checkpoint tensor {cname}: the conversion casts the values "
                                  f"to {t.dtype}; a delta needs a permutation, slice, split or stack of them")
        v = t.detach().reshape(-1).cpu().numpy()
        ok = (v >= BASE) & (v < BASE + total) & (v == np.floor(v))
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise ConversionError(f"trainer tensor {who} -> checkpoint tensor {cname}: element {bad} holds {float(v[bad])}, "
                                  "no element of the trainer tensor: the conversion computes with the values (a "
                                  "scale, sum or cast); a delta needs a permutation, slice, split or stack of them")
        g = (v - BASE).astype(np.int64)
        del v, t
        if len(g):
            brk = np.flatnonzero(np.diff(g) != 1) + 1
            first = np.concatenate(([0], brk)).astype(np.int64)
            length = np.diff(np.concatenate((first, [len(g)]))).astype(np.int64)
            pieces = _split_at_tensors(g[first], length, first, 0, starts)  # rows: member, start, length, -, ckpt pos
        else:
            pieces = np.zeros((5, 0), dtype=np.int64)
        sources = [members[i] for i in np.unique(pieces[0]).tolist()]
        dtypes = {trainer[s][1] for s in sources}
        if len(dtypes) > 1:
            raise ConversionError(f"checkpoint tensor {cname} is made of trainer tensors of several dtypes "
                                  f"({', '.join(sources)}); a delta needs one dtype on both sides")
        dtype = dtypes.pop() if dtypes else trainer[members[0]][1]
        _claim(produced, cname, shape, dtype, sources)
        cid = ckpt_ids.setdefault(cname, len(ckpt_ids))
        for i, name in enumerate(members):
            mine = pieces[:, pieces[0] == i]
            if mine.shape[1]:
                rows[name].append(np.stack([mine[1], mine[2], np.full(mine.shape[1], cid), mine[4]]))


def _claim(produced, cname: str, shape, dtype, sources: list[str]) -> None:
    if cname in produced:
        raise ConversionError(f"checkpoint tensor {cname} is produced twice (from {produced[cname][2]} and {sources}); "
                              "the checkpoint would hold one of them only")
    produced[cname] = (shape, dtype, sources)


def _check_cover(name: str, numel: int, t: np.ndarray, ckpt_names: list[str]) -> None:
    """The runs of one trainer tensor (sorted by start) cover each of its elements exactly once."""
    start, length = t[0], t[1]
    ends = start + length
    if len(start) > 1:
        twice = np.flatnonzero(start[1:] < ends[:-1])
        if len(twice):
            r = int(twice[0])
            raise ConversionError(f"trainer tensor {name}: element {int(start[r + 1])} lands in checkpoint tensors "
                                  f"{ckpt_names[int(t[2, r])]} and {ckpt_names[int(t[2, r + 1])]}: the conversion "
                                  "duplicates values; a delta needs each element in one place")
    gaps = np.flatnonzero(np.concatenate((start[:1] != 0, start[1:] != ends[:-1], ends[-1:] != numel)))
    if numel and (not len(start) or len(gaps)):
        where = 0 if not len(start) else (int(ends[gaps[0] - 1]) if gaps[0] > 0 else 0)
        into = sorted({ckpt_names[int(c)] for c in t[2].tolist()})
        raise ConversionError(f"trainer tensor {name}: element {where} lands in no checkpoint tensor (it feeds "
                              f"{into[:3] or 'none'}): the conversion drops values; a delta needs every element kept")


def _groups(model, names: list[str]) -> list[tuple[list[str], str, bool]]:
    """(trainer names one converter takes together, the key transformers files them under, converted?).

    Mirrors how ``revert_weight_conversion`` gathers the state dict; ``record_conversion`` checks the
    result against one whole-model pass, so a transformers release that groups otherwise is caught.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    groups: dict[str, tuple[list[str], bool]] = {}
    for name in sorted(names, key=dot_natural_key):
        renamed, pattern = rename_source_key(name, renamings, converters, reverse=True) if reverse else (name, None)
        members, converted = groups.setdefault(renamed, ([], pattern is not None))
        members.append(name)
        if len(members) > 1 and not converted:  # two tensors renamed onto one name: let the whole replay decide
            groups[renamed] = (members, True)
    return [(members, key, converted) for key, (members, converted) in groups.items()]


def _identity(trainer: Spec) -> Conversion:
    names = list(trainer)
    table = {n: np.array([[0], [_numel(trainer[n][0])], [i], [0]], dtype=np.int64) for i, n in enumerate(names)}
    return Conversion(dict(trainer), names, dict(trainer), table)


def _is_transformers_model(model: torch.nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def _natural_key(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1
