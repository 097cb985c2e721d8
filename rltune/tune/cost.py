"""What a tuning run cost in device time, and after how many tuned steps it has paid for itself.

How it is counted: every run directory the work directory holds -- the untuned baselines, every
trial and its re-measurement, runs abandoned after a kill, and the reward check's runs -- costs its
wall time (``launch.json``'s ``wall_s``: from its start to its end, start-up included) times the
devices the job holds: ``gpus.count`` GPUs, or, for a job without GPUs, its one CPU host (device-
seconds of the host). A run cut off before it recorded a result (the process that ran it was killed)
counts from its submission to the last write to its directory. Time rltune spends between runs
(forecasts, the report) is not counted: the devices idle then, and a scheduler would lend them out.

Paid for itself: each tuned step saves ``untuned - tuned`` seconds of the job's devices, so after
``device_s / (devices x (untuned - tuned))`` = ``wall_s / (untuned - tuned)`` tuned steps the saving
equals what tuning spent (the tuning runs' own steps are counted as cost, not as training done).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rltune.contracts.rundir import LAUNCH_NAME, RunDir
from rltune.errors import MalformedFileError


@dataclass
class TuningCost:
    runs: int                  # run directories counted
    unfinished: int            # of them, runs cut off before recording a result (counted to their last write)
    wall_s: float              # their wall time, summed
    devices: int               # devices each run holds (GPUs; 1 for a CPU-only job's host)
    device: str                # 'GPU' or 'CPU host'
    device_s: float            # wall_s x devices
    saving_s_per_step: float | None  # untuned - tuned mean step
    payback_steps: float | None      # tuned steps after which the saving equals device_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_dirs(workdir: Path) -> list[Path]:
    """Every run directory of an auto work directory: its runs and its reward check's."""
    roots = [workdir / "runs", workdir / "reward-check" / "runs"]
    return sorted(d for root in roots if root.is_dir() for d in root.iterdir() if d.is_dir() and RunDir(d).is_run())


def run_wall_s(run_dir: Path) -> tuple[float, bool]:
    """(wall seconds, finished) of one run: its recorded wall time, or submission to last write if it was cut off."""
    run = RunDir(run_dir)
    try:
        record = run.launch_record()
    except MalformedFileError:  # missing or damaged: the run is counted by its files' times below
        record = {}
    wall = record.get("wall_s")
    if isinstance(wall, (int, float)) and not isinstance(wall, bool) and wall >= 0:
        return float(wall), True
    submitted = record.get("submitted_at")
    if not isinstance(submitted, (int, float)) or isinstance(submitted, bool):
        identity = record.get("identity") or {}
        submitted = identity.get("submitted_at") if isinstance(identity, dict) else None
    times = [p.stat().st_mtime for p in run_dir.rglob("*") if p.is_file()]
    if not times:
        return 0.0, False
    start = float(submitted) if isinstance(submitted, (int, float)) else (run_dir / LAUNCH_NAME).stat().st_mtime \
        if (run_dir / LAUNCH_NAME).exists() else min(times)
    return max(0.0, max(times) - start), False


def tuning_cost(workdir: str | Path, gpus: int, untuned_step_s: float | None, tuned_step_s: float | None) -> TuningCost:
    """The cost of the auto run in ``workdir`` (see the module docstring)."""
    workdir = Path(workdir)
    walls = [run_wall_s(d) for d in run_dirs(workdir)]
    wall_s = sum(w for w, _ in walls)
    devices = gpus if gpus > 0 else 1
    saving = untuned_step_s - tuned_step_s if untuned_step_s is not None and tuned_step_s is not None else None
    payback = wall_s / saving if saving is not None and saving > 0 else None
    return TuningCost(runs=len(walls), unfinished=sum(not done for _, done in walls), wall_s=wall_s, devices=devices,
                      device="GPU" if gpus > 0 else "CPU host", device_s=wall_s * devices,
                      saving_s_per_step=saving, payback_steps=payback)


def describe(cost: TuningCost) -> str:
    """One line for a person."""
    unit = f"{cost.device}-seconds" if cost.devices == 1 else f"{cost.device}-seconds ({cost.devices} {cost.device}s)"
    text = f"{cost.device_s:.0f} {unit} over {cost.runs} runs"
    if cost.unfinished:
        text += f" ({cost.unfinished} cut off, counted to their last write)"
    if cost.payback_steps is not None:
        text += f"; paid back after {cost.payback_steps:.0f} tuned steps ({cost.saving_s_per_step:.3g} s saved a step)"
    else:
        text += "; no step saved, so it does not pay back"
    return text


__all__ = ["TuningCost", "describe", "run_dirs", "run_wall_s", "tuning_cost"]
