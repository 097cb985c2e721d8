"""Trainer side: take the delta from the optimizer step itself and publish it.

:func:`rltune.sync.chunked.chunked_step` steps AdamW (``torch.optim.AdamW``/``Adam``, fused or not)
or :class:`SignSGD` in updates of at most ``chunk_elements`` elements (small parameters together,
a large one in chunks) and calls a hook around each. :class:`DeltaPublisher`'s hook is a
:class:`~rltune.sync.chunked.DeltaRecorder` of this rank's rows (``publisher.recorder``): it reads the
update's old wire bits just before the write and diffs them with the new bits just after, so it
never keeps a copy of the weights: with the Triton diff/extract kernels into device memory and one
host sync at the end of the step (``differ="auto"``, the default, when the weights live on a GPU,
or ``"triton"``), or with the torch reference (``"torch"``, and ``"auto"`` on CPU weights).
Tensors that no optimizer steps (buffers, frozen parameters) are diffed against a small copy taken
at the last anchor/full checkpoint.

``publish(step)`` checks, from the live weights, that every tensor holds exactly what the step
wrote (a weight changed outside the step raises) before any file of the step is named in the store
(a delta's part is written beside the check, under its temporary name), then writes this rank's
summary; rank 0 writes the manifest and the COMPLETE marker last and prunes old chains. A broadcast
that follows no optimizer step publishes a full checkpoint. Every ``interval`` steps the step also
carries an anchor (per-rank slices, no gather).

Example::

    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    pub = DeltaPublisher(model, opt, root="/shared/broadcast", interval=50)
    pub.publish(0)                       # step 0: the checkpoint engines boot from (full)
    for step in range(1, n):
        loss(model).backward()
        pub.step()                       # replaces opt.step(); records the delta
        opt.zero_grad()
        pub.publish(step)                # delta (anchor every 50 steps)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rltune.errors import RltuneError
from rltune.sync import codec, store
from rltune.sync import format as fmt
from rltune.sync.chunked import (
    DEFAULT_MAX_ELEMENTS,
    DeltaRecorder,
    NonFiniteChangesError,
    UnknownParameterError,
    chunked_step,
    local_tensor,
    optimizers,
)
from rltune.sync.kernels import ChangeCapacityError, KernelBackendError, checksum_pairs
from rltune.sync.kernels.reference import MASK64, checksum2_add, diff_ref
from rltune.sync.ops import count_nonfinite, wire_bits, wire_diff, wire_width

DEFAULT_CHUNK_ELEMENTS = DEFAULT_MAX_ELEMENTS


class SignSGD(torch.optim.Optimizer):
    """p <- p * (1 - lr * weight_decay) - lr * sign(grad). Elementwise, so it steps in chunks exactly."""

    def __init__(self, params, lr: float = 1e-5, weight_decay: float = 0.0):
        if lr <= 0:
            raise PublisherConfigError(f"SignSGD: lr must be positive, got {lr}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_chunk(p, p.grad, group, 0, p.numel())
        return loss

    @staticmethod
    def step_chunk(p: torch.Tensor, grad: torch.Tensor, group: dict, start: int, stop: int) -> None:
        pc = p.view(-1)[start:stop]
        if group["weight_decay"]:
            pc.mul_(1 - group["lr"] * group["weight_decay"])
        pc.add_(torch.sign(grad.reshape(-1)[start:stop]), alpha=-group["lr"])


_SHARE_BATCH_BYTES = 256 << 20  # wire bits checksummed together by one live check call


class PublisherConfigError(RltuneError):
    """A DeltaPublisher option is invalid, or the model and optimizer it was given do not fit together."""


class UnmappablePlacementError(PublisherConfigError):
    """A DTensor parameter is laid out in a way the publisher cannot map to its flat range of the whole
    tensor (a dim other than 0 sharded, a tensor-parallel or strided placement, a mesh other than
    (shard) or (replicate, shard))."""


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How an FSDP2 (``fully_shard``) model's DTensor parameters are spread: this rank's place in the
    shard group, and whether it publishes (HSDP: only replicate coordinate 0 writes; the other
    replicas hold the same shards)."""

    rank: int
    """This rank's coordinate in the shard dim of the mesh."""
    world: int
    """Ranks in one shard group (the mesh's shard dim)."""
    publishes: bool
    """False on an HSDP replica other than the first: it steps but writes nothing."""


def shard_layout(state: dict[str, torch.Tensor]) -> ShardLayout | None:
    """The :class:`ShardLayout` of a model's state (``state_dict(keep_vars=True)``), or None when it
    holds no DTensor. Refuses, naming the first tensor and its placement, any DTensor that is not
    ``Shard(0)`` on a 1-D mesh or ``(Replicate(), Shard(0))`` on a 2-D one, and DTensors on different
    meshes. Reads only the tensors' specs: no collective."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch without distributed
        return None
    mesh, layout = None, None
    for name, t in state.items():
        if not isinstance(t, DTensor):
            continue
        places = tuple(t.placements)
        fsdp = (len(places) == 1 and type(places[0]) is Shard and places[0].dim == 0) or (
            len(places) == 2 and type(places[0]) is Replicate and type(places[1]) is Shard and places[1].dim == 0)
        if not fsdp or t.dim() == 0:
            raise UnmappablePlacementError(
                f"parameter {name}: placement {places} on a {t.device_mesh.ndim}-D mesh; DeltaPublisher maps FSDP2 "
                "shards only: (Shard(0),) on a 1-D mesh or (Replicate(), Shard(0)) on a 2-D (HSDP) mesh. Shard "
                "this parameter with fully_shard's default placement (dim 0), or leave it unsharded")
        if mesh is None:
            mesh = t.device_mesh
            shard_dim = mesh.ndim - 1
            layout = ShardLayout(rank=mesh.get_local_rank(shard_dim), world=mesh.size(shard_dim),
                                 publishes=mesh.ndim == 1 or mesh.get_local_rank(0) == 0)
        elif t.device_mesh != mesh:
            raise UnmappablePlacementError(f"parameter {name}: on mesh {t.device_mesh}, other parameters on {mesh}; "
                                           "DeltaPublisher needs every DTensor on one mesh")
    return layout


@dataclasses.dataclass(frozen=True)
class DeltaPublisherConfig:
    """Every option of :class:`DeltaPublisher`, checked when the config is made."""

    interval: int = 50
    """A full anchor every ``interval`` steps, for engines that join or fall off the delta chain."""
    rank: int = 0
    """This trainer rank; it publishes rows ``[rank*R/world, (rank+1)*R/world)`` of every tensor."""
    world: int = 1
    """Trainer ranks publishing together (data parallel: each holds the full tensors)."""
    run_id: str | None = None
    """Names one training run in every file; engines reload when it changes. None: a random id (single
    rank only: ranks must agree on it)."""
    incarnation: str | None = None
    """Names this start of the trainer's processes, the same on every rank: each publish's attempt id
    is made from (run_id, incarnation, step), so the files a crashed or earlier start left behind are
    never taken for this one's. None: a random one on a single rank; with world > 1 torchelastic's
    ``TORCHELASTIC_RUN_ID``/``TORCHELASTIC_RESTART_COUNT`` when set, else "0" (then a restart must
    change run_id)."""
    keep_anchors: int = 2
    """Anchors (with the deltas after each) kept on disk: 2 keeps the previous anchor's chain, so an
    engine that finds the latest anchor damaged falls back to it and replays every delta since."""
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    """Elements per optimizer update the diff hook sees (small parameters together, large ones in chunks)."""
    wire_dtype: torch.dtype | None = None
    """Cast floating weights as sent (fp32 master weights published as bf16); None: each in its own dtype."""
    finalize_timeout_s: float = 600.0
    """How long rank 0 waits for every rank's part before the step fails."""
    dense_fraction: float | None = None
    """A step that changed more than this share of the elements goes out as a full checkpoint: writing
    the raw bytes beats encoding that many changes (H200: 300 M changes took 19.6 s to encode, a full
    write of the same model 1.4-2.0 s). None: never. Ranks decide alone, so single rank only."""
    coding: str = "entropy"
    """How a delta's changes are written: entropy (the near-entropy codec, ~1.2 B a bf16 change at 1-3 % changed,
    ~30 ns a change to code on a host core), plain (fixed-width positions and values, ~6 B a change
    at memory speed: for engines on the trainer's host, where bytes sit in the page cache)."""
    encoder: str = "auto"
    """Where a delta is coded: gpu (rltune.sync.codec_gpu, the same bytes, 7x the host's 16 threads on
    the H200), host (the host's cores), auto (the GPU when the weights live on one)."""
    differ: str = "auto"
    """How a chunk's changes are found inside the step: triton (diff/extract kernels into device memory,
    one host sync per step), torch (the reference: nonzero and two host syncs per chunk), auto (triton
    when the weights live on a GPU). H200, 0.5 B model: torch adds 68-121 ms to the step, the kernels
    2.3-8.3 ms, with byte-identical deltas (docs/BENCHMARKS.md)."""
    change_capacity: float = 0.1
    """With the kernels: the share of this rank's elements one step may change; more goes out full."""
    fuse_step: bool = True
    """With the kernels on a GPU and torch's fused AdamW, the kernels step each update themselves with
    the diff's first pass inside it (bit-identical), so the weights are neither copied before the
    update nor read twice after it. False: staged."""

    def __post_init__(self) -> None:
        def bad(field_name: str, problem: str) -> PublisherConfigError:
            return PublisherConfigError(f"DeltaPublisherConfig.{field_name}: {problem}")

        if self.interval < 1:
            raise bad("interval", f"must be >= 1 (an anchor every N steps), got {self.interval}")
        if self.keep_anchors < 1:
            raise bad("keep_anchors", f"must be >= 1 (the latest anchor's chain), got {self.keep_anchors}")
        if self.incarnation is not None and (not isinstance(self.incarnation, str) or len(self.incarnation) > 256):
            raise bad("incarnation", "must be a string of at most 256 characters")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise bad("rank", f"rank {self.rank} outside world {self.world}; use 0 <= rank < world")
        if self.chunk_elements < 1:
            raise bad("chunk_elements", f"must be >= 1, got {self.chunk_elements}")
        if self.finalize_timeout_s <= 0:
            raise bad("finalize_timeout_s", f"must be positive, got {self.finalize_timeout_s}")
        if self.dense_fraction is not None and not 0 < self.dense_fraction <= 1:
            raise bad("dense_fraction", f"must be in (0, 1] or None, got {self.dense_fraction}")
        if self.coding not in ("entropy", "plain"):
            raise bad("coding", f"coding must be entropy or plain, got {self.coding!r}")
        if self.encoder not in ("auto", "gpu", "host"):
            raise bad("encoder", f"encoder must be auto, gpu or host, got {self.encoder!r}")
        if self.differ not in ("auto", "triton", "torch"):
            raise bad("differ", f"differ must be auto, triton or torch, got {self.differ!r}")
        if not 0 < self.change_capacity <= 1:
            raise bad("change_capacity", f"change_capacity must be in (0, 1], got {self.change_capacity}")
        if self.wire_dtype is not None and fmt.wire_dtype(self.wire_dtype) is None:
            raise bad("wire_dtype", f"{self.wire_dtype} has no wire format; use torch.bfloat16")
        if self.world > 1 and self.run_id is None:
            raise bad("run_id", f"with world {self.world} every rank must be given the same run_id; a random one "
                      "per rank would never match")


class DeltaPublisher:
    """Publishes a model's weights to a broadcast root: deltas from the optimizer step, anchors, full checkpoints.

    ``rank``/``world``: this trainer rank publishes rows ``[rank*R/world, (rank+1)*R/world)`` of each
    tensor (dim 0), as flat element ranges; every rank holds the full tensors (data parallel) and no
    rank gathers another's weights. ``wire_dtype`` casts the weights as sent (fp32 master weights
    published as bf16); by default each tensor goes in its own dtype. ``recorder``: the
    :class:`~rltune.sync.chunked.DeltaRecorder` of this rank's rows that :meth:`step` hands to the chunked
    optimizer step (``recorder.sink``: its change sink, None with the torch differ).

    Nothing NaN or infinite is published: a step whose changes hold such values (a NaN loss or
    gradient) makes the next publish a full checkpoint, and a full publish checks every weight it
    would send; if any is not finite it raises :class:`~rltune.sync.format.NonFiniteWeightsError`
    before writing anything, so the store and the engines keep the last good step. Restore finite
    weights (the last good checkpoint) and publish again. A delta needs no pass over every weight:
    the weights it leaves alone were finite when last published (the live check proves them
    unchanged), and its changes were checked when the step recorded them.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, root: str | Path,
                 interval: int | None = None, rank: int | None = None, world: int | None = None, *,
                 config: DeltaPublisherConfig | None = None, **options: Any):
        """``config`` holds every option (:class:`DeltaPublisherConfig`); ``interval``, ``rank``, ``world`` and
        keyword ``options`` are shorthands that build or override it, validated the same way."""
        overrides = dict(options)
        for key, value in (("interval", interval), ("rank", rank), ("world", world)):
            if value is not None:
                overrides[key] = value
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(DeltaPublisherConfig)})
        if unknown:
            raise PublisherConfigError(f"DeltaPublisher: unknown option {unknown[0]!r}; the options are the fields of "
                                       "DeltaPublisherConfig")
        if config is None:
            config = DeltaPublisherConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        state = model.state_dict(keep_vars=True)
        # FSDP2: the mesh says who this rank is; nothing is written before the placements are checked
        self.layout = shard_layout(state)
        if self.layout is not None:
            given = {k: getattr(config, k) for k in ("rank", "world") if k in overrides or
                     getattr(config, k) != getattr(DeltaPublisherConfig, k)}
            want = dict(rank=self.layout.rank, world=self.layout.world)
            if any(given[k] != want[k] for k in given):
                raise PublisherConfigError(f"DeltaPublisher: rank/world {given} disagree with the FSDP2 mesh's shard "
                                           f"group {want}; leave rank and world out for a sharded model")
            config = dataclasses.replace(config, **want)
        self.publishes = self.layout is None or self.layout.publishes
        self.config = config
        self.model, self.optimizer, self.root = model, optimizer, Path(root)
        self.interval, self.rank, self.world = config.interval, config.rank, config.world
        self.run_id = config.run_id or uuid.uuid4().hex
        self.incarnation = config.incarnation if config.incarnation is not None else (
            uuid.uuid4().hex if config.world == 1 else
            f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        self.keep_anchors = config.keep_anchors
        self.chunk_elements, self.wire_dtype = config.chunk_elements, config.wire_dtype
        self.finalize_timeout_s, self.dense_fraction = config.finalize_timeout_s, config.dense_fraction
        self.encoder, self.differ = config.encoder, config.differ
        self.change_capacity, self.fuse_step = config.change_capacity, config.fuse_step
        if self.publishes:
            self.root.mkdir(parents=True, exist_ok=True)

        self.names: list[str] = list(state)
        self.tensors: dict[str, torch.Tensor] = {}
        self.tied_to: dict[str, str | None] = {}
        first_by_storage: dict[int, str] = {}
        for name, t in state.items():
            key = id(t)
            self.tied_to[name] = first_by_storage.get(key)
            first_by_storage.setdefault(key, name)
            self.tensors[name] = t
        self.first_names = [n for n in self.names if self.tied_to[n] is None]
        stepped = {id(p) for opt in optimizers(optimizer) for g in opt.param_groups for p in g["params"]}
        self.static_names = [n for n in self.first_names if id(self.tensors[n]) not in stepped]
        self.ranges = {n: self._rank_range(self.tensors[n]) for n in self.names}
        for n in self.names:
            wire = self._wire_dtype(n)
            if fmt.wire_dtype(wire) is None:
                raise fmt.SyncFormatError(f"tensor {n}: dtype {wire} has no wire format; set wire_dtype=torch.bfloat16")

        self._checksums: dict[str, int] = {}  # this rank's checksum share per first name, as published
        self._checksums2: dict[str, int] = {}  # and its checksum2 share (packed lanes)
        self._static_copy: dict[str, torch.Tensor] = {}
        self._pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # this rank's (idx, diff) pieces
        self.recorder = self._make_recorder(stepped)  # the optimizer step's hook: records this rank's changes
        self._overflow = False  # the step changed more than the sink holds, or wrote non-finite values: publish it full
        self._stepped = False
        self._last_step: int | None = None
        self._last_attempt: str | None = None
        self._anchors: list[int] = []  # anchor and full steps this publisher completed
        self._anchors_at_last_publish: list[int] = []

    # -------------------------------------------------------------------------------- helpers

    def _make_recorder(self, stepped: set[int]) -> DeltaRecorder:
        # the tensors as the chunked step writes them: a DTensor's local shard (element 0 at its range's start)
        named = [(n, local_tensor(self.tensors[n])) for n in self.first_names if id(self.tensors[n]) in stepped]
        if not named:
            raise PublisherConfigError("the optimizer steps none of the tensors of the model given to DeltaPublisher; "
                                       "build the optimizer from that model's parameters")
        spans = [t for n, t in named if self.ranges[n][1] > self.ranges[n][0]]  # tensors with elements of this rank
        one_device = all(t.device == spans[0].device for t in spans)
        sink = bool(spans) and (self.differ == "triton" or (self.differ == "auto" and spans[0].device.type == "cuda"
                                                            and one_device))
        if sink and not one_device:
            raise PublisherConfigError("differ='triton' needs every stepped tensor on one device; use differ='torch'")
        try:
            return DeltaRecorder(named, self.chunk_elements, self.wire_dtype, self.change_capacity, backend="triton",
                                 outputs="device", fuse_adamw="auto" if self.fuse_step else False,
                                 ranges={n: self._stepped_range(n) for n, _ in named}, sink=sink,
                                 origins={n: self._origin(n) for n, _ in named})
        except KernelBackendError:
            raise PublisherConfigError("differ='triton' on CPU weights needs TRITON_INTERPRET=1 in the environment before "
                             "triton is imported; use differ='auto' for the torch reference") from None

    def _wire_dtype(self, name: str) -> torch.dtype:
        t = self.tensors[name]
        return self.wire_dtype if (self.wire_dtype is not None and t.is_floating_point()) else t.dtype

    def _sharded(self, name: str) -> bool:
        return local_tensor(self.tensors[name]) is not self.tensors[name]

    def _origin(self, name: str) -> int:
        """Where element 0 of the tensor the step writes lies in the whole tensor (a shard's range start)."""
        return self.ranges[name][0] if self._sharded(name) else 0

    def _stepped_range(self, name: str) -> tuple[int, int]:
        """This rank's range in the flat elements of the tensor the step writes."""
        a, b = self.ranges[name]
        return (0, b - a) if self._sharded(name) else (a, b)

    def _local(self, name: str) -> torch.Tensor:
        """The flat elements ``ranges[name]`` this rank publishes, as a view of what it holds (a shard's
        local tensor, or its rows of a full tensor)."""
        t = self.tensors[name]
        if self._sharded(name):
            return local_tensor(t).detach().reshape(-1)
        a, b = self.ranges[name]
        return t.detach().reshape(-1)[a:b]

    def _rank_range(self, t: torch.Tensor) -> tuple[int, int]:
        local = local_tensor(t)
        if local is not t:  # an FSDP2 shard: the flat range its rows cover (torch.chunk: the last short or empty)
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if tuple(shape) != tuple(local.shape) or not local.is_contiguous():
                raise UnmappablePlacementError(f"a DTensor of shape {tuple(t.shape)} holds a local {tuple(local.shape)} "
                                               f"tensor, its placements {tuple(t.placements)} say {tuple(shape)}")
            per_row = t.numel() // max(1, t.shape[0])
            start = min(offset[0], t.shape[0]) * per_row
            return start, start + local.numel()
        if self.world == 1 or t.dim() == 0:
            return (0, t.numel()) if self.rank == 0 else (0, 0)
        rows, per_row = t.shape[0], t.numel() // max(1, t.shape[0])
        r0, r1 = rows * self.rank // self.world, rows * (self.rank + 1) // self.world
        return r0 * per_row, r1 * per_row

    def _bits(self, name: str) -> torch.Tensor:
        return wire_bits(self._local(name), self._wire_dtype(name))

    def _shares(self, names: list[str]) -> dict[str, tuple[int, int]]:
        """(checksum, checksum2) of this rank's share of each name, from the live weights, in batches of
        ~256 MB of wire bits (CPU weights: each batch over two threads). A cast to the wire dtype is held
        for one batch only, and CPU float32 weights sent as bfloat16 are rounded inside the pass, with no
        cast copy (on two cores the cast of a 76 M-element model cost more than its checksums)."""
        out: dict[str, tuple[int, int]] = {}
        batch: list[str] = []
        held = 0
        for at, name in enumerate(names):
            batch.append(name)
            a, b = self.ranges[name]
            held += (b - a) * fmt.wire_dtype(self._wire_dtype(name)).bits // 8
            if held >= _SHARE_BATCH_BYTES or at == len(names) - 1:
                shares = [self._local(n) for n in batch]
                pairs = checksum_pairs(shares, [self.ranges[n][0] for n in batch], wire_dtype=self.wire_dtype)
                out.update(zip(batch, pairs, strict=True))
                batch, held = [], 0
        return out

    def attempt_id(self, step: int) -> str:
        """The attempt id of this publisher's publish of ``step``: the same on every rank of one
        incarnation, different for any other incarnation or run."""
        key = f"{self.run_id}\0{self.incarnation}\0{step}".encode()
        return hashlib.sha256(key).hexdigest()[:32]

    # -------------------------------------------------------------------------------- the step

    def step(self) -> None:
        """Run one optimizer step in chunks, recording this rank's changes. Replaces ``optimizer.step()``."""
        if self._last_step is None:
            raise fmt.ChainError("publish the boot checkpoint (publish(0)) before the first optimizer step, so the "
                                 "engines have a base for the first delta")
        try:
            if not self.publishes:  # an HSDP replica other than the first: its shard group's first replica records
                chunked_step(self.optimizer, None, self.chunk_elements)
                return
            chunked_step(self.optimizer, self.recorder, self.chunk_elements)
        except UnknownParameterError:
            raise PublisherConfigError("the optimizer steps a parameter that is not in the model given to DeltaPublisher "
                                       "(or was not in the optimizer when the publisher was made); build the "
                                       "optimizer from that model's parameters first") from None
        self._take_changes()
        self._stepped = True

    def _take_changes(self) -> None:
        """The step's changes from the recorder (with the sink: one host sync), into the running checksums and
        the changes the next publish writes."""
        try:
            deltas = self.recorder.collect_deltas()
        except (ChangeCapacityError, NonFiniteChangesError):
            # the running checksums no longer follow the weights: the publish goes full, and a full
            # publish refuses weights that are not finite
            self._overflow = True
            return
        for d in deltas:
            self._checksums[d.name] = (self._checksums[d.name] + d.checksum_change) & MASK64
            self._checksums2[d.name] = checksum2_add(self._checksums2[d.name], d.checksum2_change)
            self._pending.setdefault(d.name, []).append((d.idx_C, d.diff_C))

    # -------------------------------------------------------------------------------- publishing

    def _verify_live(self, step: int) -> None:
        # both checksums: an outside edit whose position-weighted changes cancel still moves checksum2
        for name, (live, live2) in self._shares([n for n in self.first_names if n not in self.static_names]).items():
            for which, got, want in (("checksum", live, self._checksums[name]),
                                     ("checksum2", live2, self._checksums2[name])):
                if got != want:
                    raise fmt.WeightChangedOutsideStepError(
                        f"step {step}: tensor {name}: live {which} {got} != {want} from the last publish plus the "
                        "step's changes; a weight changed outside the optimizer step (in-place edit, "
                        "load_state_dict). Publish such a change as a full checkpoint: publisher.force_full()")

    def _write_beside_live_check(self, path: Path, data: list[bytes], step: int) -> None:
        """Write a delta's part file while the live check runs, then rename it into place; if the check
        refuses the publish, remove it first, so nothing names it. The write is mostly its fsync, which
        no core waits on, while the check's hash keeps both cores of a two-core host busy: there the
        fsync of a step's 8.5 MB took ~20 ms, the check of 76 M elements ~20-25 ms. (Coding the delta
        beside the check as well was slower there: three busy threads on two cores; so was starting the
        check only once the bytes were in the page cache: 80-90 against 67-72 ms a 19 MB publish.)"""
        path.parent.mkdir(parents=True, exist_ok=True)
        outcome: dict[str, Any] = {}

        def write() -> None:
            try:
                outcome["temporary"] = fmt.write_temporary(path, data)
            except BaseException as exc:  # handed to the publishing thread below
                outcome["error"] = exc

        writer = threading.Thread(target=write, name=f"rltune-publish-{step}", daemon=True)
        writer.start()
        try:
            self._verify_live(step)
        except BaseException:
            writer.join()
            if "temporary" in outcome:
                outcome["temporary"].unlink(missing_ok=True)
            raise
        writer.join()
        if "error" in outcome:
            raise outcome["error"]
        os.replace(outcome["temporary"], path)

    def _refuse_nonfinite(self, step: int, names: list[str]) -> None:
        counts = {name: count_nonfinite(self._bits(name), self._wire_dtype(name)) for name in names}
        device = next(iter(counts.values())).device if counts else None
        values = torch.stack([c.to(device) for c in counts.values()]).tolist() if counts else []
        bad = {name: n for name, n in zip(counts, values, strict=True) if n}
        if bad:
            first = ", ".join(f"{name} {n}" for name, n in list(bad.items())[:3])
            held = "no step yet" if self._last_step is None else f"step {self._last_step}"
            raise fmt.NonFiniteWeightsError(
                f"step {step}: {sum(bad.values())} trainer weights in {len(bad)} tensors are NaN or infinite ({first}"
                f"{', ...' if len(bad) > 3 else ''}); nothing of step {step} was written and the engines keep "
                f"{held}. A NaN loss or gradient reached the optimizer step: restore finite weights (the last good "
                "checkpoint) and publish again")

    def force_full(self) -> None:
        """Make the next publish a full checkpoint (after weights were changed outside the optimizer)."""
        self._stepped = False
        self._pending.clear()

    def publish(self, step: int) -> dict[str, Any] | None:
        """Publish broadcast ``step``; return the manifest on rank 0, None on other ranks."""
        if self._last_step is not None and step <= self._last_step:
            raise fmt.ChainError(f"publish({step}) after publish({self._last_step}): steps must increase")
        if not self.publishes:  # an HSDP replica: the first replica of its shard group writes these shards
            self._last_step, self._last_attempt = step, self.attempt_id(step)
            return None
        step_dir = self.root / fmt.step_dir_name(step)
        attempt = self.attempt_id(step)
        # the checks that can refuse this publish come before any file of it is named in the store (a
        # delta's part is written beside its live check, and removed if the check refuses the publish)
        live_check = self._stepped and self._last_step is not None and not self._overflow
        if live_check:
            kind = "anchor" if step % self.interval == 0 else "delta"
            if kind == "delta" and self._dense():
                kind = "full"
        else:
            kind = "full"
        if kind != "delta":  # an anchor's stepped tensors are its last publish plus checked changes
            if live_check:
                self._verify_live(step)
            self._refuse_nonfinite(step, [n for n in self.first_names if kind == "full" or n in self.static_names])
        if self._last_step is None and self.rank == 0:
            # a resumed (or restarted) trainer: steps above this one belong to a timeline it does not
            # continue; readers must not take them for its latest
            store.remove_after(self.root, step)
        store.clean_leftovers(step_dir, self.rank, attempt, self.world)
        base_step = None if kind == "full" else self._last_step
        base_attempt = None if kind == "full" else self._last_attempt
        header = dict(run_id=self.run_id, attempt=attempt, step=step, rank=self.rank, world=self.world)
        files: dict[str, list[bytes | memoryview]] = {}
        written: set[str] = set()
        if kind != "full":
            name = fmt.part_file_name(self.rank, "delta")
            files[name], static_now = self._delta_part(dict(header, kind="delta", base_step=base_step))
            if kind == "delta":
                self._write_beside_live_check(step_dir / name, files[name], step)
                written.add(name)
            self._take_static(static_now)
        if kind != "delta":
            # an anchor's stepped tensors were just checked equal to their running sums: only the rest is summed
            for name, (c1, c2) in self._shares(self.first_names if kind == "full" else self.static_names).items():
                self._checksums[name], self._checksums2[name] = c1, c2
            for name in self.static_names:
                self._static_copy[name] = self._bits(name).clone()
            files[fmt.part_file_name(self.rank, "anchor")] = self._anchor_part(dict(header, kind="anchor", base_step=None))
        shares = {n: str(self._checksums[self.tied_to[n] or n]) for n in self.names}
        shares2 = {n: str(self._checksums2[self.tied_to[n] or n]) for n in self.names}
        summary = dict(rank=self.rank, attempt=attempt, checksums=shares, checksums2=shares2,
                       files=[dict(rank=self.rank, file=f, bytes=fmt.chunks_size(d)) for f, d in files.items()])
        store.write_rank_files(step_dir, self.rank, {f: d for f, d in files.items() if f not in written}, summary)
        self._pending.clear()
        self._stepped = self._overflow = False
        self._last_step, self._last_attempt = step, attempt
        if kind != "delta":
            self._anchors.append(step)
        if self.rank != 0:
            return None
        # a DTensor's shape is the whole tensor's
        tensors = {n: dict(dtype=fmt.wire_dtype(self._wire_dtype(n)).name, shape=list(self.tensors[n].shape),
                           checksum="0", checksum2="0", tied_to=self.tied_to[n]) for n in self.names}
        manifest = store.finalize_step(step_dir, dict(run_id=self.run_id, attempt=attempt, step=step, kind=kind,
                                                      base_step=base_step, base_attempt=base_attempt,
                                                      world=self.world, tensors=tensors), self.world,
                                       self.finalize_timeout_s)
        self._prune()
        return manifest

    def _dense(self) -> bool:
        """True if this step's pending changes exceed ``dense_fraction`` of the elements (one rank only)."""
        if self.dense_fraction is None or self.world != 1:
            return False
        changed = sum(int(idx.numel()) for pieces in self._pending.values() for idx, _ in pieces)
        total = sum(self.tensors[n].numel() for n in self.first_names if n not in self.static_names)
        return total > 0 and changed > self.dense_fraction * total

    def _prune(self) -> None:
        # An old chain goes only once keep_anchors newer anchors were already complete at the previous
        # broadcast, so an engine that planned a replay of it one broadcast ago still finds it, and one
        # that finds the latest anchor damaged still has the one before. Only this publisher's own
        # anchors count: a resumed trainer never prunes by a step of the timeline it replaced.
        kept = self._anchors_at_last_publish[-self.keep_anchors:]
        if len(kept) == self.keep_anchors:
            store.prune_before(self.root, kept[0])
        self._anchors_at_last_publish = list(self._anchors)

    def _delta_part(self, header: dict[str, Any]) -> tuple[list[bytes], list[tuple[str, torch.Tensor]]]:
        names, jobs = [], []
        static_now: list[tuple[str, torch.Tensor]] = []  # taken in only once every tensor passed its checks
        for name in self.first_names:
            lo, hi = self.ranges[name]
            if name in self.static_names:
                if hi <= lo:
                    continue
                cur = self._bits(name)
                idx, new = diff_ref(self._static_copy[name], cur)
                if idx.numel() == 0:
                    continue
                bad = int(count_nonfinite(new, self._wire_dtype(name)))
                if bad:
                    raise fmt.NonFiniteWeightsError(
                        f"step {header['step']}: {bad} values of {name} (a tensor the optimizer does not step) are NaN "
                        f"or infinite; nothing of step {header['step']} was written and the engines keep step "
                        f"{self._last_step}. Restore finite values and publish again")
                old = self._static_copy[name][idx]
                diff = wire_diff(old, new, wire_width(cur))
                static_now.append((name, cur))
                idx = idx + lo
            else:
                pieces = self._pending.get(name)
                if not pieces:
                    continue
                # most tensors are one update's chunk: a concatenation of one piece would copy it
                idx = torch.cat([p[0] for p in pieces]) if len(pieces) > 1 else pieces[0][0]
                diff = torch.cat([p[1] for p in pieces]) if len(pieces) > 1 else pieces[0][1]
            # the element width from the wire dtype: casting the whole tensor to read it cost more than the encoding
            bits = fmt.wire_dtype(self._wire_dtype(name)).bits if hi > lo else 16
            names.append(name)
            jobs.append((idx.to(torch.int64), diff.to(torch.int64), bits, lo, hi))
        blobs = self._encode(jobs)
        entries, offset = [], 0
        for name, (idx, _, _, lo, hi), blob in zip(names, jobs, blobs, strict=True):
            entries.append(dict(name=name, start=lo, stop=hi, offset=offset, length=len(blob),
                                crc32=fmt.crc32(blob), changes=int(idx.shape[0])))
            offset += len(blob)
        return fmt.part_chunks(dict(header, entries=entries), blobs), static_now

    def _take_static(self, static_now: list[tuple[str, torch.Tensor]]) -> None:
        """The frozen tensors a delta carried changes of, taken in once the publish passed every check."""
        for name, cur in static_now:
            self._checksums[name], self._checksums2[name] = self._shares([name])[name]
            self._static_copy[name] = cur.clone()

    def _encode(self, jobs: list[tuple[torch.Tensor, torch.Tensor, int, int, int]]) -> list[bytes]:
        plain = self.config.coding == "plain"
        on_gpu = bool(jobs) and all(idx.is_cuda for idx, *_ in jobs)
        if not plain and (self.encoder == "gpu" or (self.encoder == "auto" and on_gpu)):
            from rltune.sync.codec_gpu import encode_many_gpu

            return encode_many_gpu(jobs)
        # every block of every tensor on the host's cores (the coder releases the GIL); plain: no coder
        return codec.encode_many([(idx.cpu().numpy(), diff.cpu().numpy(), bits, lo, hi)
                                  for idx, diff, bits, lo, hi in jobs], mode="plain" if plain else "auto")

    def _anchor_part(self, header: dict[str, Any]) -> list[bytes | memoryview]:
        """The anchor part as buffers to write: each tensor's little-endian wire bytes as they lie (no copy
        where the host is little-endian), its CRC blocks taken from views of them."""
        entries, blobs, offset = [], [], 0
        for name in self.names:
            lo, hi = self.ranges[name]
            host = self._bits(name).cpu().numpy()
            raw = memoryview(np.ascontiguousarray(host.astype(host.dtype.newbyteorder("<"), copy=False))).cast("B")
            block = fmt.ANCHOR_CRC_BLOCK
            crcs = [fmt.crc32(raw[j:j + block]) for j in range(0, len(raw), block)]
            entries.append(dict(name=name, start=lo, stop=hi, offset=offset, length=len(raw), crc_block=block, crc32s=crcs))
            blobs.append(raw)
            offset += len(raw)
        return fmt.part_chunks(dict(header, entries=entries), blobs)
