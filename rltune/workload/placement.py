"""Which device each trainer rank and each engine uses (the GPU split, ``placement.*``).

Shared (both counts 0, the default): the trainer and every engine use the config's own devices
(``cuda`` is the current GPU). Split: trainer rank ``r`` on ``cuda:r`` for the first
``trainer_gpus`` GPUs, engine ``e`` on ``cuda:(trainer_gpus + e % rollout_gpus)``, so moving one
GPU from rollout to training is one knob change each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltune.errors import RltuneError
from rltune.workload.config import WorkloadConfig


class PlacementError(RltuneError):
    """A GPU split asks for more GPUs than this machine has."""


@dataclass(frozen=True)
class Placement:
    trainer: list[str]  # device of each trainer rank
    engines: list[str]  # device of each engine process


def place(cfg: WorkloadConfig, gpus_visible: int, trainer_device: str, engine_device: str) -> Placement:
    """Devices for ``cfg``; ``*_device`` are the resolved unsplit devices ('cpu' or 'cuda')."""
    pl = cfg.placement
    ranks, engines = cfg.trainer_ranks, cfg.engine.num_engines
    if not pl.split:
        return Placement([trainer_device] * ranks, [engine_device] * engines)
    need = pl.trainer_gpus + pl.rollout_gpus
    if need > gpus_visible:
        raise PlacementError(f"placement.trainer_gpus {pl.trainer_gpus} + placement.rollout_gpus {pl.rollout_gpus} = {need} GPUs, "
                             f"this machine shows {gpus_visible}; lower them or set both to 0 to share")
    return Placement([f"cuda:{r}" for r in range(pl.trainer_gpus)],
                     [f"cuda:{pl.trainer_gpus + e % pl.rollout_gpus}" for e in range(engines)])


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
