"""Checkpoint tensors an engine holds in another dtype: loaded by value with the engine's cast, never patched.

Some engine parameters are not in the checkpoint's dtype: vLLM builds GLM-4.5's MoE router
(``mlp.gate.weight``) and its ``e_score_correction_bias`` in float32 whatever the checkpoint holds,
and its loader casts the bf16 values into them (``param.data.copy_(loaded)``); any engine may keep
a norm in float32 the same way. A sparse delta of the checkpoint's bits cannot patch such a
parameter in place (the engine's bits are not the checkpoint's), and the trainer's checksums are
of the checkpoint's bits, not the engine's.

So these tensors leave the receiver's index map and are handled here, by value, by every
:class:`~rltune.sync.receiver.DeltaReceiver` (torch engines and vLLM workers alike), inside its
update:

- Before an update writes anything (:meth:`CastLoads.stage`, a TP-group phase): for each cast
  tensor, if the target step's manifest gives it the checksums of the values held, nothing to do;
  otherwise its values are read from the newest anchor at or below the step with exactly those
  checksums (the anchor's CRCs checked, the bits read checked against both trainer checksums). No
  such anchor means a delta changed it: :class:`CastTensorChangedError` names the tensor and the
  fix, and nothing is written, so the engine keeps serving its last good weights.
- After the receiver's update (:meth:`CastLoads.write`): the staged values are cast into the
  parameter positions the index map names, with ``Tensor.copy_``, the cast vLLM's loader does, and
  checked element by element (:meth:`CastLoads.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rltune.sync import format as fmt
from rltune.sync.indexmap import IndexMap, TensorRuns


class CastTensorChangedError(fmt.SyncFormatError):
    """A delta changes a checkpoint tensor the engine holds cast to another dtype (it cannot be patched in place)."""


def _no_runs(runs: TensorRuns) -> TensorRuns:
    empty = np.zeros(0, dtype=np.int64)
    return TensorRuns(runs.name, runs.numel, empty, empty.copy(), empty.copy(), empty.copy())


@dataclass
class CastLoads:
    """The cast tensors of one worker: which they are, the checksums of the values held, what is staged."""

    store: object  # rltune.sync.store.BroadcastStore
    index_map: IndexMap  # the full map (the cast tensors' runs included)
    params: list[torch.Tensor]  # by index-map parameter id
    dtypes: dict[str, str]  # cast tensor -> checkpoint dtype name
    held: dict[str, tuple[int, int]] = field(default_factory=dict)  # tensor -> trainer checksums of the values held
    staged: dict[str, tuple[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    staged_step: int | None = None

    @classmethod
    def split(cls, store, index_map: IndexMap, named: dict[str, torch.Tensor],
              manifest: dict) -> tuple[IndexMap, CastLoads]:
        """(the index map the receiver patches through, without the cast tensors; the cast tensors)."""
        params = [named[n] for n in index_map.param_names]
        dtypes = {}
        for name, runs in index_map.tensors.items():
            want = manifest["tensors"][name]["dtype"]
            if runs.held and any(fmt.dtype_name(params[int(pid)].dtype) != want for pid in np.unique(runs.param)):
                dtypes[name] = want
        receiver_map = IndexMap(index_map.param_names,
                                {n: _no_runs(r) if n in dtypes else r for n, r in index_map.tensors.items()},
                                dict(index_map.engine_only), dict(index_map.spec))
        return receiver_map, cls(store, index_map, params, dtypes)

    @property
    def names(self) -> list[str]:
        return list(self.dtypes)

    def describe(self) -> dict[str, str]:
        """Cast tensor -> ``checkpoint dtype -> engine dtype`` (for the attach report)."""
        out = {}
        for name, want in self.dtypes.items():
            runs = self.index_map.tensors[name]
            engine = sorted({fmt.dtype_name(self.params[int(p)].dtype) for p in np.unique(runs.param)})
            out[name] = f"{want} -> {'/'.join(engine)}"
        return out

    # ----------------------------------------------------------------------------------------- stage

    def stage(self, step: int) -> None:
        """Read what ``step`` needs of every cast tensor (nothing written); raise if a delta changed one."""
        self.staged, self.staged_step = {}, None
        if not self.dtypes:
            self.staged_step = step
            return
        target = self.store.manifest(step)
        anchors = [s for s in self.store.complete_steps() if s <= step]
        for name in self.dtypes:
            want = self._checksums(target, name)
            if self.held.get(name) == want:
                continue
            source = next((s for s in reversed(anchors)
                           if (m := self.store.manifest(s))["anchors"] and self._checksums(m, name) == want), None)
            if source is None:
                engine = self.describe()[name].split(" -> ")[1]
                raise CastTensorChangedError(
                    f"{self.store.step_dir(step) / fmt.MANIFEST_NAME}: tensors.{name}: step {step} changes {name}, which "
                    f"the engine holds in {engine} cast from the checkpoint's {self.dtypes[name]}; a delta cannot patch "
                    "a cast tensor in place and no anchor holds its new values. The engine keeps its weights: publish "
                    f"this step as a full checkpoint (publisher.force_full()), or train {name} in {engine} so the "
                    "checkpoint and the engine agree")
            self.staged[name] = (want, self._read(source, name, want))
        self.staged_step = step

    @staticmethod
    def _checksums(manifest: dict, name: str) -> tuple[int, int]:
        t = manifest["tensors"][name]
        return int(t["checksum"]), int(t["checksum2"])

    def _read(self, step: int, name: str, want: tuple[int, int]) -> torch.Tensor:
        """The whole tensor's values from ``step``'s anchors, in the checkpoint's dtype (CRCs and checksums checked)."""
        from rltune.sync.kernels import checksum_pairs
        from rltune.sync.kernels.reference import MASK64

        m = self.store.manifest(step)
        wire = fmt.WIRE_DTYPES[self.dtypes[name]]
        itemsize = wire.bits // 8
        numel = fmt.numel_of(m["tensors"][name]["shape"])
        data = bytearray(numel * itemsize)
        covered = 0
        step_dir = self.store.checked_step_dir(step)
        for f in m["anchors"]:
            path = fmt.safe_child(step_dir, f["file"])
            header, start = fmt.read_part_header(path, expect_bytes=f["bytes"])
            for e in header["entries"]:
                if e["name"] != name:
                    continue
                raw = fmt.read_anchor_range(path, start, e, 0, (e["stop"] - e["start"]) * itemsize)
                data[e["start"] * itemsize:e["stop"] * itemsize] = raw
                covered += e["stop"] - e["start"]
        if covered != numel:
            raise fmt.AnchorCoverError(f"{step_dir}: step {step}: the anchors cover {covered} of the {numel} elements "
                                       f"of {name}")
        values = torch.frombuffer(data, dtype=fmt.torch_dtype(self.dtypes[name])).clone()
        (c1, c2), = checksum_pairs([values], [0])
        if (c1 & MASK64, c2) != want:
            raise fmt.ChecksumMismatchError(f"{step_dir / fmt.MANIFEST_NAME}: step {step}: tensors.{name}: the anchor's "
                                            "values do not match the trainer's checksums; republish the step")
        return values

    # ----------------------------------------------------------------------------------------- write, verify

    def write(self) -> list[str]:
        """Cast the staged values into the engine's parameters (the loader's own ``copy_``); returns the names."""
        written = []
        for name, (sums, values) in self.staged.items():
            self._values[name] = values
            for dst, src in self._pairs(name, values):
                dst.copy_(src)
            self.held[name] = sums
            written.append(name)
        self.staged = {}
        self.verify(written)
        return written

    def verify(self, names: list[str] | None = None) -> None:
        """Every position of each cast tensor holds exactly the engine's cast of the values loaded."""
        for name in self.names if names is None else names:
            if name not in self.held:
                raise fmt.ChainError(f"{self.store.root}: {name} was never loaded into this engine; update first")
            for dst, src in self._pairs(name, self._values[name]):
                if not torch.equal(_bits(dst), _bits(src.to(device=dst.device, dtype=dst.dtype))):
                    self.held.pop(name, None)
                    raise fmt.ChecksumMismatchError(
                        f"{self.store.root}: {name}: the engine's {dst.dtype} values are not the cast of the checkpoint "
                        "values loaded (written outside the receiver); the next update loads it again")

    def forget(self) -> None:
        """After a failed update or an outside write: load every cast tensor again at the next update."""
        self.held, self.staged, self.staged_step, self._values = {}, {}, None, {}

    def _pairs(self, name: str, values: torch.Tensor):
        runs = self.index_map.tensors[name]
        for cs, ln, pid, ps in zip(runs.ckpt_start.tolist(), runs.length.tolist(), runs.param.tolist(),
                                   runs.param_start.tolist(), strict=True):
            yield self.params[pid].data.reshape(-1)[ps:ps + ln], values[cs:cs + ln]

    def __post_init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers of its width (so NaNs and signed zeros compare exactly)."""
    from rltune.sync.kernels.reference import as_bits

    return as_bits(t.contiguous())
