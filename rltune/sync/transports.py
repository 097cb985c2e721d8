"""Weight-sync transports compared by ``rltune sync-bench``, behind one base class.

Every transport carries one trainer's weights to engine workers laid out the way vLLM lays them
out (:class:`~rltune.sync.toy_engine.ToyEngine`: fused qkv / gate_up), so each engine update runs
the engine's own ``load_weights`` or an in-place patch through a recorded index map:

- :class:`FilesystemFull`: the trainer writes a full safetensors checkpoint (fsync'd); in the
  pause the engine reads it and loads every tensor.
- :class:`InProcessCopy`: in the pause the engine copies every trainer tensor into its own
  parameters, device to device (what a CUDA IPC handle gives an engine on the same GPU).
- :class:`SparseDelta`: :class:`~rltune.sync.sender.DeltaPublisher` diffs inside the optimizer
  step and writes a delta; the engine reads and decodes it while serving (prefetch) and in the
  pause patches in place through the receiver's pluggable apply function and verifies checksums.
- :class:`NcclBroadcast`: ``torch.distributed`` broadcast from the trainer (rank 0) to engine
  ranks in their own processes (ranks 1..N), NCCL between GPUs or gloo on a CPU.

The phases are timed by the transport itself (engine ranks of the broadcast time their own side),
with ``torch.cuda.synchronize`` around each timed region on a GPU. Verification (the engine's
weights equal the trainer's bit for bit) reads :meth:`Transport.engine_states`, outside every
timed region.

Example::

    ctx = TransportContext(model, optimizer, ToyEngineConfig.from_hf(model.config), "cuda", workdir)
    t = make_transport("sparse", ctx)
    t.boot()                                   # the engine takes the trainer's boot weights
    for step in range(1, n):
        ...backward...; t.optimizer_step() if t.drives_optimizer_step else optimizer.step()
        published = t.publish(step)            # trainer-blocking
        read_s = t.prefetch(step)              # while the engine serves (None: nothing to do)
        update = t.update(step)                # dispatch-blocking: pause / apply+verify / resume
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rltune.errors import RltuneError
from rltune.sync.toy_engine import ToyEngine, ToyEngineConfig

# NVLink multicast (NVLS) stays off for anything that may use NCCL: it hangs or fails on shared hosts.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TRANSPORT_NAMES = ("filesystem", "inprocess", "sparse", "nccl")

_CMD_STOP, _CMD_UPDATE, _CMD_SEND_WEIGHTS = 0, 1, 2


class TransportError(RltuneError):
    """A weight-sync transport failed."""


class TransportUnavailableError(TransportError):
    """A transport cannot run on this machine (the message says why); sync-bench skips it."""


def set_nccl_safe_env() -> None:
    """Put NCCL_SAFE_ENV into this process's environment (inherited by processes it starts)."""
    os.environ.update(NCCL_SAFE_ENV)


# ---------------------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(devices: tuple[torch.device, ...], out: dict[str, float], key: str) -> Iterator[None]:
    """Time the block into ``out[key]``, synchronising every CUDA device before and after."""
    for d in devices:
        synchronize(d)
    start = time.perf_counter()
    yield
    for d in devices:
        synchronize(d)
    out[key] = time.perf_counter() - start


# ---------------------------------------------------------------------------------------- results


@dataclass
class PublishResult:
    """Trainer side of one broadcast."""

    seconds: float  # trainer-blocking
    bytes: int  # written to files or sent over the wire
    details: dict[str, float] = field(default_factory=dict)


@dataclass
class UpdateResult:
    """Engine side of one broadcast, inside the window in which dispatch to the engine is stopped."""

    pause_s: float
    apply_s: float  # apply + verify (sparse) or transfer + load (full transports)
    resume_s: float
    checksum_verified: bool | None = None  # the transport's own verification; None: it has none
    changes: int | None = None
    details: dict[str, float] = field(default_factory=dict)

    @property
    def dispatch_blocking_s(self) -> float:
        return self.pause_s + self.apply_s + self.resume_s


@dataclass
class TransportContext:
    """What every transport is built from: the trainer, the engine layout and where to put files."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    engine_config: ToyEngineConfig
    engine_device: torch.device | str
    workdir: Path
    anchor_interval: int = 50
    chunk_elements: int = 1 << 26
    differ: str = "auto"  # sparse: DeltaPublisher's differ (auto, triton, torch)
    nccl_engines: int = 1
    nccl_timeout_s: float = 300.0
    dense_fraction: float | None = None  # sparse: publish a step this dense as a full checkpoint (None: never)
    apply_fn: Callable | None = None  # sparse engine's in-place apply; None: kernels.apply_mapped_delta or the reference

    def __post_init__(self) -> None:
        self.engine_device = torch.device(self.engine_device)
        self.workdir = Path(self.workdir)

    @property
    def trainer_device(self) -> torch.device:
        return next(self.model.parameters()).device

    def trainer_state(self) -> dict[str, torch.Tensor]:
        """The trainer's checkpoint tensors (views of the live weights, no copy)."""
        return {n: t.detach() for n, t in self.model.state_dict().items()}

    def new_engine(self, device: torch.device | None = None) -> ToyEngine:
        dtype = next(self.model.parameters()).dtype
        with torch.device(device or self.engine_device):
            return ToyEngine(self.engine_config, dtype=dtype)


class EngineGate:
    """Stops and restarts dispatch to an engine worker.

    Pausing waits for the worker's in-flight device work, so no forward pass reads a weight while
    it is rewritten; resuming waits for the update's last kernel before dispatch reopens.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.accepting = True

    def pause(self) -> None:
        self.accepting = False
        synchronize(self.device)

    def resume(self) -> None:
        synchronize(self.device)
        self.accepting = True


# ---------------------------------------------------------------------------------------- base


class Transport(ABC):
    """One way of moving trainer weights into engine workers (see the module docstring)."""

    name: str = ""
    drives_optimizer_step = False  # True: the trainer's optimizer step must go through optimizer_step()

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx
        self.devices = tuple(dict.fromkeys([ctx.trainer_device, ctx.engine_device]))

    @abstractmethod
    def boot(self) -> None:
        """Step 0: the engine takes the trainer's current weights (the checkpoint it boots from)."""

    def optimizer_step(self) -> dict[str, float]:
        """Run the trainer's optimizer step (only transports that diff inside it); returns timings."""
        raise TransportError(f"{self.name}: does not drive the optimizer step; call optimizer.step()")

    @abstractmethod
    def publish(self, step: int) -> PublishResult:
        """Trainer side of broadcast ``step`` (after its optimizer step)."""

    def prefetch(self, step: int) -> float | None:
        """Engine work done while it keeps serving; seconds, or None when there is none."""
        return None

    @abstractmethod
    def update(self, step: int) -> UpdateResult:
        """Engine side of broadcast ``step``, in the pause."""

    @abstractmethod
    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        """Every engine worker's parameters (name -> tensor), for bit-for-bit verification."""

    def close(self) -> None:  # noqa: B027 (most transports hold nothing to release)
        """Release processes and files."""

    def _timed_update(self, gate: EngineGate, apply: Callable[[], tuple[bool | None, int | None]]) -> UpdateResult:
        t: dict[str, float] = {}
        with timed(self.devices, t, "pause"):
            gate.pause()
        with timed(self.devices, t, "apply"):
            verified, changes = apply()
        with timed(self.devices, t, "resume"):
            gate.resume()
        return UpdateResult(t["pause"], t["apply"], t["resume"], verified, changes)


def _state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _engine_params(engine: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in engine.named_parameters()}


# ---------------------------------------------------------------------------------------- full checkpoint


class FilesystemFull(Transport):
    """Full safetensors checkpoint per step; the engine reads and loads all of it in the pause."""

    name = "filesystem"

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self.dir = ctx.workdir / "filesystem"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engine = ctx.new_engine()
        self.gate = EngineGate(ctx.engine_device)
        self.path: Path | None = None

    def _write(self, step: int) -> int:
        from rltune.sync.format import save_safetensors_atomic

        state = {n: t.contiguous().cpu() for n, t in self.ctx.trainer_state().items()}
        path = self.dir / f"step-{step:06d}.safetensors"
        save_safetensors_atomic(state, path, {"step": str(step)})
        if self.path is not None and self.path != path:
            self.path.unlink(missing_ok=True)  # the engine has loaded it: keep one checkpoint on disk
        self.path = path
        return path.stat().st_size

    def _load(self) -> None:
        from safetensors.torch import load_file

        state = load_file(str(self.path), device=str(self.ctx.engine_device))
        self.engine.load_weights(state.items())

    def boot(self) -> None:
        self._write(0)
        self._load()

    def publish(self, step: int) -> PublishResult:
        t: dict[str, float] = {}
        with timed(self.devices, t, "write"):
            size = self._write(step)
        return PublishResult(t["write"], size)

    def update(self, step: int) -> UpdateResult:
        def load():
            self._load()
            return None, None
        return self._timed_update(self.gate, load)

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        return [_engine_params(self.engine)]

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class InProcessCopy(Transport):
    """Full copy from the trainer's tensors into the engine's, device to device, in the pause."""

    name = "inprocess"

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self.engine = ctx.new_engine()
        self.gate = EngineGate(ctx.engine_device)

    def boot(self) -> None:
        self.engine.load_weights(self.ctx.trainer_state().items())

    def publish(self, step: int) -> PublishResult:
        # The trainer only has to finish its step: the engine reads the trainer's own tensors.
        t: dict[str, float] = {}
        with timed(self.devices, t, "publish"):
            state = self.ctx.trainer_state()
        return PublishResult(t["publish"], _state_bytes(state))

    def update(self, step: int) -> UpdateResult:
        def copy():
            self.engine.load_weights(self.ctx.trainer_state().items())
            return None, None
        return self._timed_update(self.gate, copy)

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        return [_engine_params(self.engine)]


# ---------------------------------------------------------------------------------------- sparse delta


def default_apply_fn() -> Callable:
    """The sync kernels' dispatching apply when present (Triton on CUDA), else the torch reference."""
    try:
        from rltune.sync.kernels import apply_mapped_delta
    except ImportError:
        from rltune.sync.ops import apply_mapped_delta_ref

        return apply_mapped_delta_ref
    return apply_mapped_delta


class SparseDelta(Transport):
    """DeltaPublisher (diff inside the optimizer step) + DeltaReceiver (prefetch, patch in place, verify)."""

    name = "sparse"
    drives_optimizer_step = True

    def __init__(self, ctx: TransportContext):
        from rltune.sync.sender import DeltaPublisher

        super().__init__(ctx)
        self.root = ctx.workdir / "sparse"
        self.publisher = DeltaPublisher(ctx.model, ctx.optimizer, self.root, ctx.anchor_interval, dense_fraction=ctx.dense_fraction,
                                        run_id=f"sync-bench-{uuid.uuid4().hex[:8]}", chunk_elements=ctx.chunk_elements,
                                        differ=ctx.differ)
        self.engine = ctx.new_engine()
        self.gate = EngineGate(ctx.engine_device)
        self.apply_fn = ctx.apply_fn or default_apply_fn()
        self.receiver = None
        self._hook_s = 0.0
        # Time the publisher's diff (the delta's cost inside the optimizer step) by wrapping its hooks
        # and, with the Triton differ, the step's collection of the changes. An update the kernels step
        # themselves (fused AdamW) counts whole: its AdamW and its diff are one kernel.
        for attr in ("_before_update", "_after_update", "_step_adamw", "_take_sink_changes"):
            setattr(self.publisher, attr, self._timed_hook(getattr(self.publisher, attr)))

    def _timed_hook(self, hook: Callable) -> Callable:
        device = self.ctx.trainer_device

        def run(*args):
            synchronize(device)
            start = time.perf_counter()
            result = hook(*args)
            synchronize(device)
            self._hook_s += time.perf_counter() - start
            return result
        return run

    def boot(self) -> None:
        from rltune.sync.indexmap import IndexMap
        from rltune.sync.receiver import DeltaReceiver

        manifest = self.publisher.publish(0)
        spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
        cfg = self.ctx.engine_config
        imap = IndexMap.record(lambda dt: ToyEngine(cfg, dtype=dt), spec)
        self.receiver = DeltaReceiver(self.root, self.engine, imap, apply_fn=self.apply_fn)
        self.receiver.load_latest()

    def optimizer_step(self) -> dict[str, float]:
        self._hook_s = 0.0
        t: dict[str, float] = {}
        with timed(self.devices, t, "step"):
            self.publisher.step()
        return {"optimizer_step_s": t["step"], "diff_in_step_s": self._hook_s}

    def publish(self, step: int) -> PublishResult:
        t: dict[str, float] = {}
        with timed(self.devices, t, "publish"):
            manifest = self.publisher.publish(step)
        delta = sum(f["bytes"] for f in manifest["parts"])
        anchor = sum(f["bytes"] for f in manifest["anchors"])
        return PublishResult(t["publish"], delta + anchor,
                             dict(delta_bytes=float(delta), anchor_bytes=float(anchor),
                                  anchor=float(manifest["kind"] == "anchor")))

    def prefetch(self, step: int) -> float | None:
        if self.receiver.store.manifest(step)["kind"] == "full":
            return None  # a step published full (too dense for a delta) is loaded in the pause
        t: dict[str, float] = {}
        with timed(self.devices, t, "prefetch"):
            ok = self.receiver.prefetch(step)
        if not ok:
            raise TransportError(f"{self.root}: step {step} could not be prefetched (not a complete delta); "
                                 "the engine would read it in the pause")
        return t["prefetch"]

    def update(self, step: int) -> UpdateResult:
        from rltune.sync import format as fmt

        def apply():
            try:
                report = self.receiver.apply(step)
            except fmt.ChecksumMismatchError:
                return False, None
            full = self.receiver.store.manifest(step)["kind"] == "full"
            if report.action != ("reload" if full else "delta"):
                raise TransportError(f"{self.root}: step {step} was a {report.action}, not an in-place delta; the "
                                     "engine fell off the delta chain")
            return True, report.changes_applied
        return self._timed_update(self.gate, apply)

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        return [_engine_params(self.engine)]


# ---------------------------------------------------------------------------------------- NCCL broadcast


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    # Bytes move bit for bit and every backend carries uint8 (NCCL has no int16, gloo no float8).
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class _EngineRankArgs:
    init_method: str
    backend: str
    world: int
    engine_config: ToyEngineConfig
    spec: list[tuple[str, tuple[int, ...]]]
    dtype: torch.dtype
    device_type: str
    timeout_s: float


def _engine_rank_main(rank: int, args: _EngineRankArgs) -> None:
    """An engine rank: receive each broadcast into buffers, load them, report its timings and weights."""
    import torch.distributed as dist

    set_nccl_safe_env()
    if args.device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, init_method=args.init_method, rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        with torch.device(device):
            engine = ToyEngine(args.engine_config, dtype=args.dtype)
        gate = EngineGate(device)
        buffers = {name: torch.empty(shape, dtype=args.dtype, device=device) for name, shape in args.spec}
        control = torch.zeros(2, dtype=torch.int64, device=device)
        while True:
            dist.broadcast(control, src=0)
            command = int(control[0])
            if command == _CMD_STOP:
                break
            if command == _CMD_SEND_WEIGHTS:
                for p in engine.parameters():
                    dist.send(_byte_view(p), dst=0)
                continue
            t: dict[str, float] = {}
            with timed((device,), t, "pause"):
                gate.pause()
            with timed((device,), t, "transfer"):
                for buf in buffers.values():
                    dist.broadcast(_byte_view(buf), src=0)
                engine.load_weights(buffers.items())
            with timed((device,), t, "resume"):
                gate.resume()
            dist.send(torch.tensor([t["pause"], t["transfer"], t["resume"]], dtype=torch.float64, device=device), dst=0)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


class NcclBroadcast(Transport):
    """Broadcast from the trainer (rank 0, this process) to engine ranks 1..N in processes of their own.

    On CUDA: NCCL, engine rank ``r`` on GPU ``r`` (needs 1 + N GPUs). On a CPU: gloo, same protocol.
    Rank 0 drives the engines through a control broadcast (update, send weights, stop).
    """

    name = "nccl"

    def __init__(self, ctx: TransportContext):
        import torch.distributed as dist

        super().__init__(ctx)
        n = ctx.nccl_engines
        if n < 1:
            raise TransportError(f"nccl_engines must be >= 1, got {n}")
        trainer = ctx.trainer_device
        if trainer.type == "cuda":
            gpus = torch.cuda.device_count()
            if gpus < 1 + n:
                raise TransportUnavailableError(f"nccl: needs {1 + n} GPUs (trainer + {n} engine ranks), this machine "
                                                f"has {gpus}")
            if trainer.index not in (None, 0):
                raise TransportUnavailableError("nccl: the trainer must be on cuda:0 (engine rank r uses cuda:r)")
            self.backend, device_type = "nccl", "cuda"
        else:
            self.backend, device_type = "gloo", "cpu"
        if dist.is_initialized():
            raise TransportUnavailableError("nccl: this process already has a default process group; "
                                            "run sync-bench outside torchrun")
        set_nccl_safe_env()
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        self.devices = (self.device,)
        state = ctx.trainer_state()
        self.names = list(state)
        dtype = next(ctx.model.parameters()).dtype
        self.world = 1 + n
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        args = _EngineRankArgs(init_method, self.backend, self.world, ctx.engine_config,
                               [(k, tuple(v.shape)) for k, v in state.items()], dtype, device_type, ctx.nccl_timeout_s)
        mp = torch.multiprocessing.get_context("spawn")
        self.procs = [mp.Process(target=_engine_rank_main, args=(r, args), daemon=True) for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        dist.init_process_group(self.backend, init_method=init_method, rank=0, world_size=self.world,
                                timeout=datetime.timedelta(seconds=ctx.nccl_timeout_s))
        self._shapes = _engine_params(ctx.new_engine(torch.device("meta")))
        self._pending_timings = False
        self._closed = False

    def _control(self, command: int, step: int) -> None:
        import torch.distributed as dist

        dead = [p.pid for p in self.procs if not p.is_alive()]
        if dead:
            raise TransportError(f"nccl: engine rank process(es) {dead} exited; see their traceback above")
        dist.broadcast(torch.tensor([command, step], dtype=torch.int64, device=self.device), src=0)

    def _broadcast_weights(self, step: int) -> None:
        import torch.distributed as dist

        self._control(_CMD_UPDATE, step)
        for t in self.ctx.trainer_state().values():
            dist.broadcast(_byte_view(t.contiguous()), src=0)
        self._pending_timings = True

    def _engine_timings(self) -> list[list[float]]:
        import torch.distributed as dist

        out = []
        for r in range(1, self.world):
            buf = torch.zeros(3, dtype=torch.float64, device=self.device)
            dist.recv(buf, src=r)
            out.append(buf.tolist())
        self._pending_timings = False
        return out

    def boot(self) -> None:
        self._broadcast_weights(0)
        self._engine_timings()

    def publish(self, step: int) -> PublishResult:
        t: dict[str, float] = {}
        with timed(self.devices, t, "broadcast"):
            self._broadcast_weights(step)
        return PublishResult(t["broadcast"], _state_bytes(self.ctx.trainer_state()) * (self.world - 1))

    def update(self, step: int) -> UpdateResult:
        if not self._pending_timings:
            raise TransportError("nccl: update() without a publish() before it")
        per_rank = self._engine_timings()
        # Dispatch resumes when the slowest engine rank has its weights.
        pause, transfer, resume = max(per_rank, key=sum)
        return UpdateResult(pause, transfer, resume, details=dict(engine_ranks=float(len(per_rank))))

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        import torch.distributed as dist

        self._control(_CMD_SEND_WEIGHTS, -1)
        states = []
        for r in range(1, self.world):
            state = {}
            for name, meta in self._shapes.items():
                buf = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                dist.recv(_byte_view(buf), src=r)
                state[name] = buf
            states.append(state)
        return states

    def close(self) -> None:
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                self._control(_CMD_STOP, -1)
        finally:
            # Tear down our side before waiting for the engine ranks: with NCCL, an engine's
            # destroy_process_group waits for rank 0's (on the 2-GPU H200 run, joining first
            # left the engine waiting until it was terminated after 60 s).
            dist.destroy_process_group()
            for p in self.procs:
                p.join(timeout=60)
            for p in self.procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=10)
        failed = [p.exitcode for p in self.procs if p.exitcode not in (0, None)]
        if failed:
            raise TransportError(f"nccl: engine rank processes exited with codes {failed}")


TRANSPORTS: dict[str, type[Transport]] = {
    "filesystem": FilesystemFull,
    "inprocess": InProcessCopy,
    "sparse": SparseDelta,
    "nccl": NcclBroadcast,
}


def make_transport(name: str, ctx: TransportContext) -> Transport:
    """Build a transport by name (``filesystem``, ``inprocess``, ``sparse``, ``nccl``)."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise TransportError(f"unknown transport {name!r}; choose from {', '.join(TRANSPORTS)}") from None
    return cls(ctx)


__all__ = [
    "NCCL_SAFE_ENV",
    "TRANSPORTS",
    "TRANSPORT_NAMES",
    "EngineGate",
    "FilesystemFull",
    "InProcessCopy",
    "NcclBroadcast",
    "PublishResult",
    "SparseDelta",
    "Transport",
    "TransportContext",
    "TransportError",
    "TransportUnavailableError",
    "UpdateResult",
    "default_apply_fn",
    "make_transport",
    "set_nccl_safe_env",
]
