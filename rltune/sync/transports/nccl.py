"""``nccl``: a ``torch.distributed`` broadcast from the trainer (rank 0) to engine ranks in their own processes.

On CUDA: NCCL, engine rank ``r`` on GPU ``r`` (needs 1 + N GPUs). On a CPU: gloo, same protocol.
Rank 0 drives the engine ranks through a control broadcast (update, send weights, stop); each
engine rank runs :class:`NcclLoader` in its loop: it receives every tensor into buffers and loads
them through the engine's own loader. The engine side times itself (pause / transfer / resume) and
reports to rank 0, which :meth:`NcclPublisher.engine_timings` returns.
"""

from __future__ import annotations

import datetime
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rltune.sync.transports.base import (
    EngineGate,
    Loader,
    LoadResult,
    Publisher,
    PublishResult,
    TransportError,
    TransportUnavailableError,
    load_into,
    set_nccl_safe_env,
    state_bytes,
    timed,
    trainer_state,
)

_CMD_STOP, _CMD_UPDATE, _CMD_SEND_WEIGHTS = 0, 1, 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    # Bytes move bit for bit and every backend carries uint8 (NCCL has no int16, gloo no float8).
    return t.detach().reshape(-1).view(torch.uint8)


class NcclLoader(Loader):
    """An engine rank's side: receive every tensor of the broadcast into buffers, load them."""

    def __init__(self, spec: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype):
        self.spec, self.dtype = spec, dtype
        self.buffers: dict[str, torch.Tensor] | None = None

    def load(self, engine: torch.nn.Module, message: dict[str, Any]) -> LoadResult:
        import torch.distributed as dist

        device = next(engine.parameters()).device
        if self.buffers is None:
            self.buffers = {name: torch.empty(shape, dtype=self.dtype, device=device) for name, shape in self.spec}
        for buf in self.buffers.values():
            dist.broadcast(_byte_view(buf), src=0)
        load_into(engine, self.buffers.items())
        return LoadResult(bytes=float(state_bytes(self.buffers)))


@dataclass(frozen=True)
class _EngineRankArgs:
    init_method: str
    backend: str
    world: int
    build_engine: Callable[..., torch.nn.Module]  # picklable: build_engine(dtype=...) on the current device
    loader: NcclLoader
    dtype: torch.dtype
    device_type: str
    timeout_s: float


def _engine_rank_main(rank: int, args: _EngineRankArgs) -> None:
    """An engine rank: take each broadcast through its loader, report its timings and weights."""
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
            engine = args.build_engine(dtype=args.dtype)
        gate = EngineGate(device)
        control = torch.zeros(2, dtype=torch.int64, device=device)
        while True:
            dist.broadcast(control, src=0)
            command, step = int(control[0]), int(control[1])
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
                args.loader.load(engine, dict(step=step))
            with timed((device,), t, "resume"):
                gate.resume()
            dist.send(torch.tensor([t["pause"], t["transfer"], t["resume"]], dtype=torch.float64, device=device), dst=0)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


class NcclPublisher(Publisher):
    """Broadcast from this process (rank 0) to ``engines`` engine ranks it starts (see the module docstring).

    ``build_engine(dtype=...)`` (picklable) builds an engine rank's model on its device.
    """

    name = "nccl"

    def __init__(self, model: torch.nn.Module, build_engine: Callable[..., torch.nn.Module], engines: int = 1,
                 timeout_s: float = 300.0):
        import torch.distributed as dist

        if engines < 1:
            raise TransportError(f"nccl: engines must be >= 1, got {engines}")
        self.model = model
        trainer = next(model.parameters()).device
        if trainer.type == "cuda":
            gpus = torch.cuda.device_count()
            if gpus < 1 + engines:
                raise TransportUnavailableError(f"nccl: needs {1 + engines} GPUs (trainer + {engines} engine ranks), "
                                                f"this machine has {gpus}")
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
        state = trainer_state(model)
        dtype = next(model.parameters()).dtype
        self.world = 1 + engines
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._loader = NcclLoader([(k, tuple(v.shape)) for k, v in state.items()], dtype)
        args = _EngineRankArgs(init_method, self.backend, self.world, build_engine, self._loader, dtype, device_type,
                               timeout_s)
        mp = torch.multiprocessing.get_context("spawn")
        self.procs = [mp.Process(target=_engine_rank_main, args=(r, args), daemon=True) for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        dist.init_process_group(self.backend, init_method=init_method, rank=0, world_size=self.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        with torch.device("meta"):
            self._shapes = {n: p.detach() for n, p in build_engine(dtype=dtype).named_parameters()}
        self._pending_timings = False
        self._closed = False

    def _control(self, command: int, step: int) -> None:
        import torch.distributed as dist

        dead = [p.pid for p in self.procs if not p.is_alive()]
        if dead:
            raise TransportError(f"nccl: engine rank process(es) {dead} exited; see their traceback above")
        dist.broadcast(torch.tensor([command, step], dtype=torch.int64, device=self.device), src=0)

    def publish(self, step: int) -> PublishResult:
        import torch.distributed as dist

        if self._pending_timings:
            self.engine_timings()  # the previous broadcast's reports, unread
        t: dict[str, float] = {}
        with timed((self.device,), t, "broadcast"):
            self._control(_CMD_UPDATE, step)
            for tensor in trainer_state(self.model).values():
                dist.broadcast(_byte_view(tensor.contiguous()), src=0)
        self._pending_timings = True
        return PublishResult(t["broadcast"], state_bytes(trainer_state(self.model)) * (self.world - 1),
                             message=dict(step=step))

    def loader(self, family: str = "torch") -> NcclLoader:
        self._check_family(family)
        return self._loader  # what every engine rank runs; they got it when they were started

    def engine_timings(self) -> list[list[float]]:
        """Each engine rank's (pause, transfer, resume) seconds of the last broadcast."""
        import torch.distributed as dist

        if not self._pending_timings:
            raise TransportError("nccl: engine timings asked for without a publish() before")
        out = []
        for r in range(1, self.world):
            buf = torch.zeros(3, dtype=torch.float64, device=self.device)
            dist.recv(buf, src=r)
            out.append(buf.tolist())
        self._pending_timings = False
        return out

    def engine_states(self) -> list[dict[str, torch.Tensor]]:
        """Every engine rank's parameters, sent to rank 0."""
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
