"""Inside each vLLM worker: the extension vLLM mixes into its worker class (``worker_extension_cls``).

:class:`RltuneWorkerExtension` adds six methods that an orchestrator calls through vLLM's
``collective_rpc`` (every worker of the engine runs each): ``rltune_attach``, ``rltune_prepare``,
``rltune_prepared``, ``rltune_update``, ``rltune_verify`` and ``rltune_weights``. Each takes one JSON string and returns a JSON-able dict,
so the same calls work in-process (``LLM.collective_rpc``) and over HTTP (``vllm serve`` with
``VLLM_SERVER_DEV_MODE=1``: ``POST /collective_rpc``). An rltune error comes back as
``{"ok": false, "error": <class name>, "message": ...}`` rather than as an exception, so that
every transport carries it the same way; :mod:`rltune.sync.vllm.receiver` raises it again.

What attaching does, on every worker:

1. A gloo group over the worker's TP group with a time-out (``timeout_s``), so a worker that
   fails or dies makes the others' collectives fail within that time instead of hanging.
2. The checkpoint -> parameter index map, recorded by running the engine's **own**
   ``load_weights`` on a second, unprocessed instance of the model built in float64 from the
   engine's config (qkv / gate_up packing, vocabulary padding, TP slicing all come from vLLM).
3. **Plain weights** (CPU engines). vLLM's CPU path repacks every linear weight after loading
   (oneDNN or its own packed GEMM) and empties ``layer.weight``; the embedding and ``lm_head``
   keep ``weight`` but compute from a packed copy. A write to ``weight`` then changes nothing the
   kernels read, yet would pass any checksum of ``weight``. Re-running the packing for every
   patched layer after each delta would cost as much as vLLM's own full reload (AdamW touches every
   layer each step), so the extension keeps plain weights instead: each linear layer computes with
   ``F.linear(x, layer.weight)``, its weight restored from the engine's own checkpoint through the
   same unprocessed instance. Patches and checksums then act on exactly the tensors the kernels
   read. GPU engines compute from ``layer.weight`` as loaded and need none of this.
   **Fused-MoE experts** are handled the other way round: vLLM's CPU experts repack ``w13_weight``
   and ``w2_weight`` after loading (``cpu_prepack_moe_weight``, a tiled interleave that moves every
   element and computes with none), so the index map follows the repack instead of undoing it. The
   experts' own ``process_weights_after_loading`` is run on weights that spell each element's index
   in base-256 digits (exact in the weights' dtype), which says where it moves each element; that
   move is replayed on the unprocessed instance's codes before the map is read off
   (:func:`replay_expert_repack`). The engine keeps computing with vLLM's own grouped-GEMM kernel,
   and a patched engine holds the same bytes as a fresh one. The map then has one run per expert
   element (the interleave leaves no two neighbours adjacent): fine at test sizes, a cost to
   revisit (a strided run) before models with billions of expert elements.
4. **Cast tensors.** A checkpoint tensor that the engine holds in another dtype (vLLM builds
   GLM-4.5's router in float32 whatever the checkpoint holds) cannot take a delta of the
   checkpoint's bits: it leaves the receiver's map and is loaded by value with the loader's own
   cast, at anchors only; a delta that changes one is refused before anything is written
   (:mod:`rltune.sync.casting`).
5. The latest complete anchor (only the rows this worker holds) and the deltas since, verified.

Before every update writes anything, the worker checks that each parameter it writes is still the
module's registered parameter, with the same storage and size, and (CPU) that every linear layer
still computes with the plain weight; otherwise (someone ran ``reload_weights``, which repacks) it
raises :class:`EngineWeightsMovedError`: call ``attach`` again.

``prepare(step)`` starts a thread that reads and decodes this worker's changes of ``step`` into
reused buffers and returns at once, so the engine keeps serving while it runs; ``update(step)``
waits for it (at most ``timeout_s``), applies the changes in place and verifies every tensor the
worker holds (GPU: the fused Triton apply kernel; CPU: the same apply compiled for the CPU,
:mod:`rltune.sync.kernels.cpu_kernels`, whose oracle is the torch reference). On a CPU the prepare
thread also does the apply's reads and checksum arithmetic against the weights held (they do not
change while the engine serves), so the pause holds only the stores; a patch staged against weights
written since (another update, an anchor load) is dropped and the delta applied in full
(``prestaged`` in the update's result lists the deltas stored from a staged patch).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
import time
from typing import Any

import torch

from rltune.errors import RltuneError
from rltune.sync import format as fmt
from rltune.sync.group import TorchCollectives, TpGroup, as_typed


class VllmSyncError(RltuneError):
    """The vLLM integration cannot attach to or update an engine (the message says why and what to do)."""


class EngineWeightsMovedError(VllmSyncError):
    """A parameter the receiver writes is no longer what the engine computes with; attach again."""


class NotAttachedError(VllmSyncError):
    """``prepare`` or ``update`` before ``attach``."""


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU GEMM the extension gives every linear layer: the layer's own, patchable weight."""
    return torch.nn.functional.linear(x, weight, bias)


# --------------------------------------------------------------------------------------------- the model


def build_unprocessed_model(vllm_config, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A second instance of the engine's model, parameters in ``dtype``, no weights loaded, not processed.

    vLLM registers each attention layer by name in the compilation config when it is built; the
    registry is swapped out while the copy is built so the serving model's entries stay as they are.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cc = vllm_config.compilation_config
    saved = {name: getattr(cc, name) for name in ("static_forward_context", "static_all_moe_layers")
             if hasattr(cc, name)}
    for name, value in saved.items():
        setattr(cc, name, type(value)())
    try:
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype), torch.device(device):
            return initialize_model(vllm_config=vllm_config, prefix="")
    finally:
        for name, value in saved.items():
            setattr(cc, name, value)


def record_index_map(vllm_config, spec: dict[str, tuple[list[int], str]], source: str,
                     serving: torch.nn.Module | None = None):
    """The worker's checkpoint -> parameter map, from vLLM's own ``load_weights`` on float64 placeholders.

    ``serving``: the engine's own model; the expert weights its fused-MoE kernels repacked after
    loading are followed through that same repack (:func:`replay_expert_repack`).
    """
    from vllm.config import set_current_vllm_config

    from rltune.sync.indexmap import IndexMap

    def placeholder_model(dtype: torch.dtype) -> torch.nn.Module:
        model = build_unprocessed_model(vllm_config, dtype)
        # parameters vLLM builds in a dtype of their own (GLM-4.5's float32 router) hold codes too; what the
        # engine holds them in is read from the serving model (rltune.sync.casting)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        return model

    post_load = None if serving is None else (lambda placeholder: replay_expert_repack(serving, placeholder))
    with set_current_vllm_config(vllm_config):
        return IndexMap.record(placeholder_model, spec, torch.float64, source, post_load=post_load)


EXPERT_WEIGHTS = ("w13_weight", "w2_weight")
_DIGIT_BITS = 8  # integers 0..255 are exact in bf16, fp16 and fp32 alike


def fused_experts_of(module: torch.nn.Module | None):
    """The fused-MoE experts implementation a vLLM MoE layer computes with, or None (not an MoE layer)."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or not all(hasattr(module, leaf) for leaf in EXPERT_WEIGHTS):
        return None
    return experts


def expert_repack_sources(experts, shapes: dict[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Where the experts' own post-load repack moves each element of ``w13_weight`` and ``w2_weight``.

    For each weight: ``src`` (int64, flat, one entry per element of the repacked weight, whose shape is
    ``src.shape``) holding the flat index in the loaded weight that the element comes from, or -1 for an
    element the repack adds (padding). Found by running the repack itself (vLLM's CPU path:
    ``cpu_prepack_moe_weight``, a tiled interleave) on weights of ``dtype`` whose elements hold one
    base-256 digit of ``index + 1`` at a time: every value is an integer the dtype holds exactly, so
    the digits that come out spell where each element came from. A repack that computes with values
    (any element not a digit, an index twice or not at all) raises :class:`IndexMapError`.
    """
    import copy

    from rltune.sync.format import IndexMapError

    largest = max(int(torch.Size(s).numel()) for s in shapes.values())
    passes = max(1, -(-(largest + 1).bit_length() // _DIGIT_BITS))
    digits: dict[str, list[torch.Tensor]] = {leaf: [] for leaf in shapes}
    out_shapes: dict[str, torch.Size] = {}
    for d in range(passes):
        stand_in = torch.nn.Module()
        for leaf, shape in shapes.items():
            tag = (torch.arange(1, torch.Size(shape).numel() + 1, dtype=torch.int64) >> (_DIGIT_BITS * d)) & 0xFF
            stand_in.register_parameter(leaf, torch.nn.Parameter(tag.to(dtype).reshape(shape), requires_grad=False))
        # a copy: the repack may note what it decided on the experts object the engine computes with
        copy.copy(experts).process_weights_after_loading(stand_in)
        for leaf in shapes:
            packed = stand_in.get_parameter(leaf).detach()
            out_shapes[leaf] = packed.shape
            digits[leaf].append(packed.reshape(-1).to(torch.float64))
    sources = {}
    for leaf, shape in shapes.items():
        numel = torch.Size(shape).numel()
        stacked = torch.stack(digits[leaf])
        if not bool(torch.all((stacked == torch.round(stacked)) & (stacked >= 0) & (stacked < 256))):
            raise IndexMapError(f"{type(experts).__name__}.process_weights_after_loading computes with the values of "
                                f"{leaf} (a repacked element is not one of the values loaded); the delta path needs a "
                                "repack that only moves elements")
        src = sum(stacked[d].to(torch.int64) << (_DIGIT_BITS * d) for d in range(passes)) - 1
        moved = src[src >= 0]
        if len(moved) != numel or not torch.equal(torch.sort(moved).values, torch.arange(numel)):
            raise IndexMapError(f"{type(experts).__name__}.process_weights_after_loading does not move each element "
                                f"of {leaf} to exactly one place; the delta path needs one place per element")
        sources[leaf] = src.reshape(out_shapes[leaf])
    return sources


def replay_expert_repack(serving: torch.nn.Module, placeholder: torch.nn.Module) -> int:
    """Move the placeholder copy's expert weights the way the serving engine's MoE kernels moved its own.

    vLLM's CPU fused-MoE experts repack ``w13_weight`` and ``w2_weight`` after loading (a tiled layout
    for its grouped GEMM) and compute from the repacked tensors only; the unprocessed copy the index
    map is recorded on never ran that. Each MoE layer's repack is replayed on the copy's codes so the
    map names the positions the engine's kernels read. Returns the MoE layers moved.
    """
    from rltune.sync.format import IndexMapError

    serving_modules = dict(serving.named_modules())
    moved = 0
    for name, module in placeholder.named_modules():
        live = serving_modules.get(name)
        experts = fused_experts_of(live)
        if experts is None:
            continue
        shapes = {leaf: getattr(module, leaf).shape for leaf in EXPERT_WEIGHTS}
        sources = expert_repack_sources(experts, shapes, getattr(live, EXPERT_WEIGHTS[0]).dtype)
        for leaf, src in sources.items():
            held = getattr(live, leaf)
            if held.shape != src.shape:
                raise IndexMapError(f"engine parameter {name}.{leaf} is {list(held.shape)}, its experts' repack makes "
                                    f"{list(src.shape)}: the engine repacked it differently after loading")
            codes = getattr(module, leaf)
            flat = codes.data.reshape(-1)
            out = torch.full((src.numel(),), float("nan"), dtype=flat.dtype)
            keep = src.reshape(-1) >= 0
            out[keep] = flat[src.reshape(-1)[keep]]
            codes.data = out.reshape(src.shape)
        moved += 1
    return moved


def load_unprocessed(vllm_config, dtype: torch.dtype) -> torch.nn.Module:
    """A second instance of the engine's model on the CPU, loaded by the engine's own loader from the
    engine's boot checkpoint and not processed after loading: every element where the loader put it,
    holding the value the engine booted with."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    fresh = build_unprocessed_model(vllm_config, dtype)
    with set_current_vllm_config(vllm_config):
        get_model_loader(vllm_config.load_config).load_weights(fresh, vllm_config.model_config)
    return fresh


def keep_plain_weights(model: torch.nn.Module, vllm_config, fresh: torch.nn.Module | None = None) -> int:
    """CPU: make every layer vLLM repacked compute with its plain, registered weight again.

    The weights vLLM emptied come from ``fresh`` (:func:`load_unprocessed`, built here when not given):
    the values the engine booted with. Returns the layers changed.
    """
    layers = [(name, m) for name, m in model.named_modules() if hasattr(m, "cpu_linear")]
    if not layers:
        return 0
    emptied = [name for name, m in layers
               if any(p.numel() == 0 for p in m.parameters(recurse=False))]
    if emptied:
        if fresh is None:
            fresh = load_unprocessed(vllm_config, next(p.dtype for p in model.parameters() if p.is_floating_point()))
        fresh_modules = dict(fresh.named_modules())
        for name in emptied:
            module, source = dict(model.named_modules())[name], fresh_modules[name]
            for pname, p in list(module.named_parameters(recurse=False)):
                plain = source.get_parameter(pname)
                if p.shape != plain.shape or p.dtype != plain.dtype:
                    module.register_parameter(pname, plain)
    for _, m in layers:
        m.cpu_linear = plain_linear
    return len(layers)


def boot_values(fresh: torch.nn.Module, loaded) -> callable:
    """``name -> tensor``: checkpoint tensor ``name`` as the engine booted with it, read from ``fresh``
    (:func:`load_unprocessed`) through ``loaded``, the index map of the loader's own layout. Elements
    this worker does not hold are zero (the layout check reads only the held ones)."""
    from rltune.sync.kernels.reference import as_bits

    named = dict(fresh.named_parameters())
    params = [named[n] for n in loaded.param_names]

    def boot(name: str) -> torch.Tensor:
        runs = loaded.tensors[name]
        dtype = params[int(runs.param[0])].dtype if len(runs.param) else torch.float32
        out = torch.zeros(runs.numel, dtype=dtype)
        bits = as_bits(out)
        for cs, ln, pid, ps in zip(runs.ckpt_start.tolist(), runs.length.tolist(), runs.param.tolist(),
                                   runs.param_start.tolist(), strict=True):
            bits[cs:cs + ln] = as_bits(params[pid].data).reshape(-1)[ps:ps + ln]
        return out

    return boot


class KernelGuard:
    """Checks, in O(parameters), that every parameter the receiver writes is what the engine computes with.

    Built once at attach: the (module, attribute) that holds each written parameter, its storage
    address and size, and the layers that must compute with :func:`plain_linear` (CPU).
    """

    def __init__(self, model: torch.nn.Module, params: dict[str, torch.Tensor]):
        modules = dict(model.named_modules())
        self.slots = []
        for name, p in params.items():
            owner, _, leaf = name.rpartition(".")
            self.slots.append((name, modules[owner], leaf, p, p.data_ptr(), p.numel()))
        self.plain = [(name, m) for name, m in modules.items() if hasattr(m, "cpu_linear")]

    def __call__(self) -> None:
        # vLLM's parameter classes override __torch_function__: ~4 us a data_ptr() through it, ~0.1 us without
        with torch._C.DisableTorchFunctionSubclass():
            self._check()

    def _check(self) -> None:
        for name, module, leaf, p, address, numel in self.slots:
            live = module._parameters.get(leaf)
            if p.is_meta or (live is not None and live.is_meta):
                raise EngineWeightsMovedError(
                    f"engine parameter {name} holds no weights (a meta tensor): a reload of the engine's weights "
                    "stopped part way (vLLM's layerwise reload_weights does on an attached CPU engine); the engine "
                    "cannot serve and attaching cannot repair it: start a fresh engine")
            if live is not p or p.numel() != numel or numel == 0 or p.data_ptr() != address:
                raise EngineWeightsMovedError(
                    f"engine parameter {name} was replaced or moved since attach (vLLM's reload_weights and its "
                    "post-load processing repack and empty linear weights); a patch would write a tensor the kernels "
                    "no longer read: call attach again")
        for name, m in self.plain:
            if m.cpu_linear is not plain_linear:
                raise EngineWeightsMovedError(f"layer {name} computes from a repacked copy of its weight again; "
                                              "call attach again")


# --------------------------------------------------------------------------------------------- TP groups


def _tp_group(timeout_s: float):
    """(gloo group over this worker's TP group with a time-out, or None with TP 1, TP rank, TP size)."""
    import datetime

    import torch.distributed as dist
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    if tp.world_size == 1:
        return None, 0, 1
    world = dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = None
    # new_group is collective over the whole world: every worker creates every TP group's copy.
    for first in range(0, world, tp.world_size):
        ranks = list(range(first, first + tp.world_size))
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
            if ranks != list(tp.ranks):
                raise VllmSyncError(f"this worker's TP group is ranks {list(tp.ranks)}, not the consecutive ranks "
                                    f"{ranks} rltune assumes; run one engine per process group")
    return mine, tp.rank_in_group, tp.world_size


# --------------------------------------------------------------------------------------------- the worker's state


class WorkerSync:
    """One worker's receiver state (what ``rltune_attach`` builds and the other calls use)."""

    def __init__(self, worker, root: str, timeout_s: float, verify: str):
        from rltune.sync.receiver import DeltaReceiver
        from rltune.sync.store import BroadcastStore

        self.worker = worker
        self.timeout_s = timeout_s
        self.model = worker.model_runner.get_model()
        self.device = next(self.model.parameters()).device
        self.group, self.tp_rank, self.tp_size = _tp_group(timeout_s)
        # attaching follows the TP-group protocol the receiver's updates follow (rltune.sync.group)
        tp = TpGroup(None if self.group is None else TorchCollectives(self.group),
                     lost="nothing was loaded on this worker: attach again once every worker of the engine runs")
        self.tp = tp
        self.store = store = BroadcastStore(root)
        step = tp.decide(lambda: self._latest(store), "attaching: finding the latest step", sends="the step to attach to")
        manifest = tp.phase(lambda: store.manifest(step), f"attaching: reading step {step}'s manifest")
        source = str(store.step_dir(step) / fmt.MANIFEST_NAME)
        spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
        config = worker.vllm_config
        start = time.perf_counter()
        self.index_map = tp.phase(lambda: record_index_map(config, spec, source, self.model),
                                  "attaching: recording the index map")
        self.record_s = time.perf_counter() - start
        # the weights the engine booted with, as its own loader laid them out: for plain CPU weights and for
        # the layout check; built only when one of them needs it
        layout_key = self.index_map.fingerprint()
        cached = getattr(worker, "_rltune_layout", None)
        checking = not (cached and cached[0] == layout_key)
        fresh = None
        if checking or self.device.type == "cpu":
            dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
            fresh = tp.phase(lambda: load_unprocessed(config, dtype), "attaching: loading the boot checkpoint")
        self.plain_layers = keep_plain_weights(self.model, config, fresh) if self.device.type == "cpu" else 0
        named = dict(self.model.named_parameters())
        self.params = {n: named[n] for n in self.index_map.param_names}
        self.guard = KernelGuard(self.model, self.params)
        tp.phase(self.guard, "attaching: checking the parameters the receiver writes")
        # GPU: the fused Triton kernel; CPU: its compiled CPU pass (the torch reference, ~1 µs a change on
        # two cores, would hold the pause for seconds at 100 M parameters)
        fused_backend = "triton" if self.device.type == "cuda" else "numba"
        # tensors the engine holds in another dtype than the checkpoint's (GLM-4.5's float32 router) are set
        # apart now, loaded by value and never patched (rltune.sync.casting)
        self.receiver = DeltaReceiver(root, self.model, self.index_map, group=self.group, fused=True,
                                      fused_backend=fused_backend, manifest=manifest)
        self.cast = self.receiver.cast
        self.receiver.before_write = self.guard
        self.layout = self._layout(worker, layout_key, cached, fresh)
        self.verify = verify
        self._prefetch: tuple[int, threading.Thread, dict[str, Any]] | None = None

    def _layout(self, worker, key: str, cached, fresh) -> dict[str, int]:
        """The first-update layout check (:meth:`DeltaReceiver.check_layout`) at the engine's first attach,
        while it holds its boot weights; a later attach of the same map reuses the moves found then."""
        if cached and cached[0] == key:
            self.receiver.relocate(cached[1])
            return dict(cached[2], reused=1)
        if getattr(worker, "_rltune_written", False):
            raise VllmSyncError("the engine's weights were written since it booted and the index map differs from "
                                "the one its layout was checked with at its first attach; start a fresh engine for "
                                "another model")
        loaded = self.index_map.loaded or self.index_map
        report = self.receiver.check_layout(boot_values(fresh, loaded), source=str(worker.vllm_config.model_config.model))
        summary = report.summary()
        worker._rltune_layout = (key, report.moves, summary)
        return dict(summary, reused=0)

    @staticmethod
    def _latest(store) -> int:
        steps = store.complete_steps()
        if not steps:
            raise fmt.ChainError(f"{store.root}: no complete step to attach to; publish the boot checkpoint "
                                 "(DeltaPublisher.publish(0)) before attaching engines")
        return steps[-1]

    # ----------------------------------------------------------------------------------------- calls

    def load_latest(self) -> dict[str, Any]:
        self.worker._rltune_written = True  # from here on the engine may no longer hold its boot weights
        return _report(self.receiver.load_latest(), self.receiver)

    def prepare(self, step: int) -> dict[str, Any]:
        self._join_prefetch()
        result: dict[str, Any] = {}

        def run():
            start = time.perf_counter()
            result["prefetched"] = self.receiver.prefetch(step)
            result["prefetch_s"] = time.perf_counter() - start

        thread = threading.Thread(target=run, name=f"rltune-prefetch-{step}", daemon=True)
        self._prefetch = (step, thread, result)
        thread.start()
        return dict(step=step, started=True)

    def prepared(self) -> dict[str, Any]:
        """Whether the prefetch begun last has finished (``step`` None: none was begun)."""
        if self._prefetch is None:
            return dict(step=None, done=True)
        step, thread, _ = self._prefetch
        return dict(step=step, done=not thread.is_alive())

    def _join_prefetch(self) -> dict[str, Any]:
        if self._prefetch is None:
            return {}
        step, thread, result = self._prefetch
        thread.join(self.timeout_s)
        if thread.is_alive():
            # the thread keeps its own copy of nothing the update uses: the update reads the step itself
            self._prefetch = None
            return dict(prefetched=False, prefetch_step=step, prefetch_error="prefetch did not finish in time")
        self._prefetch = None
        error = self.receiver.last_prefetch_error
        return dict(result, prefetch_step=step, prefetch_error=None if error is None else f"{type(error).__name__}: {error}")

    def update(self, step: int, wait_s: float = 0.0) -> dict[str, Any]:
        prefetch = self._join_prefetch()
        self.worker._rltune_written = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        report = self.receiver.apply(step, wait_s=wait_s)
        if self.verify == "full":
            self._verify_full(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out = _report(report, self.receiver)
        out.update(prefetched=bool(prefetch.get("prefetched")) and prefetch.get("prefetch_step") == step,
                   prefetch_s=prefetch.get("prefetch_s"), prefetch_error=prefetch.get("prefetch_error"))
        return out

    def _verify_full(self, step: int) -> None:
        """Recompute every share from the parameters (O(weights)) and check both checksums, on top of the
        running check."""
        self.receiver.recompute_shares()
        self.receiver.verify(step)

    def check_weights(self) -> dict[str, Any]:
        """Check the weights held now, recomputed from every parameter, against the trainer's checksums of
        the step held; a mismatch (a write outside the receiver) marks the worker invalid: the next
        update reloads and replays."""
        rx = self.receiver
        if not rx.valid:
            raise fmt.ChainError(f"{rx.store.root}: this worker holds no verified step to check (it never loaded one "
                                 "or its last update failed); update or attach first")
        self._verify_full(rx.step)
        self.cast.verify()
        return dict(step=rx.step, attempt=rx.attempt)

def _report(report, receiver) -> dict[str, Any]:
    return dict(ok=True, action=report.action, step=report.step, anchor=report.anchor, deltas=list(report.deltas),
                changes=report.changes_applied, seconds=report.seconds, phases=dict(report.phases),
                prestaged=list(report.prestaged),
                anchor_loads=receiver.anchor_loads, deltas_applied=receiver.deltas_applied,
                fallbacks=list(report.fallbacks), valid=receiver.valid, attempt=receiver.attempt)


# --------------------------------------------------------------------------------------------- the extension


def _step(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit():
        raise VllmSyncError(f"step must be a non-negative integer, got {str(value)[:40]!r}")
    return int(value)


def _wait_s(value: Any, timeout_s: float) -> float:
    # the other workers wait for TP rank 0's plan in a collective bounded by timeout_s: a longer wait
    # would fail them with GroupUnreachableError while rank 0 is still politely waiting
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < timeout_s:
        raise VllmSyncError(f"wait_s must be a number in [0, timeout_s={timeout_s:g}), got {str(value)[:40]!r}")
    return float(value)


def _call(fn, request: str) -> dict[str, Any]:
    try:
        args = json.loads(request) if request else {}
    except (TypeError, ValueError):
        args = None
    if not isinstance(args, dict):
        return dict(ok=False, error="VllmSyncError", message=f"request must be a JSON object, got {str(request)[:80]!r}")
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as exc:  # a request whose fields the call does not take
        return dict(ok=False, error="VllmSyncError", message=f"request {str(request)[:80]!r}: {exc}")
    try:
        return fn(**args)
    except Exception as exc:  # every failure comes back as a typed result, never as an engine crash
        exc = as_typed(exc, "the worker call")
        return dict(ok=False, error=type(exc).__name__, message=str(exc))


class RltuneWorkerExtension:
    """Mixed into vLLM's worker class: ``LLM(..., worker_extension_cls=rltune.sync.vllm.WORKER_EXTENSION)``."""

    def _rltune_sync(self) -> WorkerSync:
        state = getattr(self, "_rltune_state", None)
        if state is None:
            raise NotAttachedError("this engine is not attached to a broadcast root; call attach() first")
        return state

    def rltune_attach(self, request: str = "") -> dict[str, Any]:
        """``{"root": DIR, "timeout_s": 120, "verify": "running" | "full", "load": true}``: build the state, load
        the latest step (``load`` false: load nothing; the first update reloads an anchor and replays)."""
        def attach(root: str, timeout_s: float = 120.0, verify: str = "running", load: bool = True) -> dict[str, Any]:
            if verify not in ("running", "full"):
                raise VllmSyncError(f"verify must be 'running' or 'full', got {verify!r}")
            if not isinstance(load, bool):
                raise VllmSyncError(f"load must be true or false, got {load!r}")
            start = time.perf_counter()
            state = WorkerSync(self, root, float(timeout_s), verify)
            self._rltune_state = state
            if load:
                out = state.load_latest()
            else:
                out = dict(ok=True, action="none", step=None, anchor=None, deltas=[], changes=0, seconds=0.0, phases={},
                           anchor_loads=0, deltas_applied=0, fallbacks=[], valid=False, attempt=None)
            out.update(attach_s=time.perf_counter() - start, record_s=state.record_s, tp_rank=state.tp_rank,
                       tp_size=state.tp_size, plain_layers=state.plain_layers, cast=state.cast.describe(),
                       layout=state.layout,
                       engine_only={k: v for k, v in state.index_map.engine_only.items()})
            return out
        return _call(attach, request)

    def rltune_prepare(self, request: str = "") -> dict[str, Any]:
        """``{"step": S}``: start reading and decoding step S's changes; returns at once."""
        return _call(lambda step: dict(ok=True, **self._rltune_sync().prepare(_step(step))), request)

    def rltune_prepared(self, request: str = "") -> dict[str, Any]:
        """``{}``: whether the prefetch begun last has finished (``{"step": S, "done": bool}``)."""
        return _call(lambda: dict(ok=True, **self._rltune_sync().prepared()), request)

    def rltune_update(self, request: str = "") -> dict[str, Any]:
        """``{"step": S, "wait_s": 0}``: bring the weights to step S in place (or reload + replay) and verify
        them; ``wait_s``: how long to wait politely for a step the trainer is still writing."""
        def update(step: int, wait_s: float = 0.0) -> dict[str, Any]:
            start = time.perf_counter()
            state = self._rltune_sync()
            out = state.update(_step(step), _wait_s(wait_s, state.timeout_s))
            out["worker_s"] = time.perf_counter() - start
            return out
        return _call(update, request)

    def rltune_verify(self, request: str = "") -> dict[str, Any]:
        """``{}``: recompute both checksums of every tensor from the parameters and check the step held."""
        return _call(lambda: dict(ok=True, **self._rltune_sync().check_weights()), request)

    def rltune_weights(self, request: str = "") -> dict[str, Any]:
        """``{"tensors": false, "plain": false}``: every parameter's SHA-256, shape and dtype (and, with
        ``tensors``, a CPU copy: in-process and multiprocess engines only, not over HTTP). ``plain``: first
        make an unattached CPU engine compute with plain weights (its reference for "a full reload")."""
        def weights(tensors: bool = False, plain: bool = False) -> dict[str, Any]:
            model = self.model_runner.get_model()
            if plain and getattr(self, "_rltune_state", None) is None and \
                    next(model.parameters()).device.type == "cpu":
                keep_plain_weights(model, self.vllm_config)
            return dict(ok=True, weights=parameter_digests(model, tensors))
        return _call(weights, request)


def parameter_digests(model: torch.nn.Module, tensors: bool = False) -> dict[str, Any]:
    """name -> {sha256, shape, dtype[, tensor]} of every parameter, its bytes as the engine holds them."""
    out = {}
    for name, p in model.named_parameters():
        data = p.detach().contiguous().cpu()
        entry: dict[str, Any] = dict(
            sha256=hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest(),
            shape=list(data.shape), dtype=fmt.dtype_name(data.dtype))
        if tensors:
            entry["tensor"] = data.clone()
        out[name] = entry
    return out


__all__ = ["EngineWeightsMovedError", "NotAttachedError", "RltuneWorkerExtension", "VllmSyncError", "WorkerSync",
           "KernelGuard", "build_unprocessed_model", "expert_repack_sources", "fused_experts_of", "keep_plain_weights",
           "parameter_digests", "plain_linear", "record_index_map", "replay_expert_repack"]
