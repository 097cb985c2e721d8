"""job.yaml: everything rltune needs to know about one RL job, in one versioned file.

A job is one model on one workload with a fixed GPU budget. The file says what the model and the
workload are (the theory model and the case library's similarity both read these facts), the RL
mode, the baseline knob values, how to launch the job with overrides, where its metrics come from,
and the limits a tuned setup must keep.

Knobs are *abstract* names shared with the knowledge base (``micro_batch_size``,
``rl_mode``, ...). ``launch.knob_map`` says which override key of the job's own config dialect each
abstract knob sets; ``launch.dialect`` says how an override is spelled on the command line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml

JOB_SCHEMA_VERSION = 1
MAX_STEPS = 1_000_000  # steps of one run: a run of more is a typo (or needs no tuner's trial)

RlMode = Literal["sync", "one_step_async", "fully_async"]
RL_MODES = ("sync", "one_step_async", "fully_async")
Dialect = Literal["rltune", "hydra", "prime-rl", "argparse"]
LogFormat = Literal["auto", "rltune", "verl", "prime-rl", "slime", "openrlhf", "trl", "nemo-rl", "skyrl", "ms-swift",
                    "areal"]
KnobValue = int | float | str | bool


@dataclass
class ModelSpec:
    name: str = field(doc="model name, e.g. 'Qwen3-0.6B' or 'qwen3-tiny'")
    total_params: float = field(doc="total parameters", min=1, max=1e15)
    active_params: float = field(doc="parameters active per token (= total for dense models)", min=1, max=1e15)
    layers: int = field(doc="transformer layers", min=1, max=10_000)
    hidden: int = field(doc="hidden size", min=1, max=1_000_000)
    kv_heads: int = field(doc="key/value heads", min=1, max=10_000)
    head_dim: int = field(doc="dimension of one attention head", min=1, max=100_000)
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = field("bf16", doc="weight dtype the engines serve")
    moe: bool = field(False, doc="mixture-of-experts model")

    def validate(self) -> None:
        if not self.name.strip():
            raise FieldProblem("name", "give the model's name (e.g. 'Qwen3-0.6B')")
        if self.active_params > self.total_params:
            raise FieldProblem("active_params", f"must not exceed total_params ({self.total_params:g})")


@dataclass
class WorkloadSpec:
    kind: Literal["math", "coding", "tool_use"] = field(doc="math (single turn, verifier) or multi-turn tool use")
    tasks_per_batch: int = field(doc="tasks in one batch", min=1, max=10_000_000)
    trials_per_task: int = field(doc="trials (samples) per task; GRPO compares within this group", min=1, max=100_000)
    answer_cap_tokens: int = field(doc="max generated tokens per model turn", min=1, max=100_000_000)
    context_limit_tokens: int = field(doc="max tokens of a whole trial; at least answer_cap_tokens", min=1, max=100_000_000)
    trial_timeout_s: float | None = field(None, doc="a trial is cut off after this many seconds (null: never)", min=0, max=1e7)
    temperature: float = field(1.0, doc="sampling temperature", min=0, max=100)

    def validate(self) -> None:
        if self.context_limit_tokens < self.answer_cap_tokens:
            raise FieldProblem("context_limit_tokens", f"is below answer_cap_tokens ({self.answer_cap_tokens}): a trial "
                                                       "could not hold one whole answer; raise it or lower the cap")


@dataclass
class GpuBudget:
    count: int = field(doc="GPUs the job may use in total (0: CPU only)", min=0, max=1_000_000)
    device: str = field("H200", doc="accelerator kind, e.g. 'H200', 'B300' or 'cpu'")
    trainer: int = field(0, doc="GPUs given to the trainer in the baseline", min=0, max=1_000_000)
    rollout: int = field(0, doc="GPUs given to rollout engines in the baseline", min=0, max=1_000_000)
    cpu_hosts: int = field(0, doc="extra CPU hosts for sandboxes", min=0, max=1_000_000)

    def validate(self) -> None:
        if not self.device.strip():
            raise FieldProblem("device", "give the accelerator kind, e.g. 'H200', or 'cpu'")
        if self.trainer + self.rollout > self.count:
            raise FieldProblem("trainer", f"trainer + rollout GPUs ({self.trainer + self.rollout}) exceed count ({self.count})")


# sbatch options rltune derives from the job itself; a second value in slurm_args would contradict it.
SLURM_ARGS_SET_BY_RLTUNE = {
    "--time": "from launch.timeout_s", "-t": "from launch.timeout_s",
    "--output": "the run directory's launch.log", "-o": "the run directory's launch.log",
    "--error": "merged into launch.log", "-e": "merged into launch.log",
    "--job-name": "rltune-<run id>", "-J": "rltune-<run id>",
    "--chdir": "from launch.workdir", "-D": "from launch.workdir",
    "--parsable": "to read the job id", "--wait": "rltune follows the job", "-W": "rltune follows the job",
    "--array": "one trial is one job", "-a": "one trial is one job",
}
_RAY_ADDRESS = re.compile(r"https?://[A-Za-z0-9.\-]+:\d{1,5}/?")
# 'ray job submit' option -> (JobSubmissionClient.submit_job keyword, how its value is read).
_RAY_OPTIONS = {
    "--entrypoint-num-cpus": ("entrypoint_num_cpus", float),
    "--entrypoint-num-gpus": ("entrypoint_num_gpus", float),
    "--entrypoint-memory": ("entrypoint_memory", int),
    "--entrypoint-resources": ("entrypoint_resources", json.loads),
    "--runtime-env-json": ("runtime_env", json.loads),
    "--metadata-json": ("metadata", json.loads),
}


def ray_submit_options(args: list[str]) -> dict[str, Any]:
    """``launch.ray_args`` as keyword arguments of Ray's ``JobSubmissionClient.submit_job``.

    Spelled as for ``ray job submit`` (``--opt=value`` or ``--opt value``); raises ValueError naming
    the option that is unknown or whose value does not read.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag not in _RAY_OPTIONS:
            raise ValueError(f"unknown option {args[i]!r}; expected one of {', '.join(_RAY_OPTIONS)}")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"{flag} needs a value")
            i += 1
            value = args[i]
        key, read = _RAY_OPTIONS[flag]
        try:
            parsed = read(value)
        except ValueError:
            raise ValueError(f"{flag}: cannot read {value!r} as {'JSON' if read is json.loads else read.__name__}") from None
        if read is json.loads and not isinstance(parsed, dict):
            raise ValueError(f"{flag}: expected a JSON object, found {value!r}")
        if key in ("entrypoint_num_cpus", "entrypoint_num_gpus", "entrypoint_memory") and parsed < 0:
            raise ValueError(f"{flag}: must not be negative, found {value!r}")
        out[key] = parsed
        i += 1
    return out


@dataclass
class LaunchSpec:
    command: list[str] = field(doc="argv of the job, no shell; '{run_dir}' and '{steps}' are filled in")
    launcher: Literal["local", "torchrun", "slurm", "ray"] = field("local", doc="how the argv is started: here (local, torchrun), as a SLURM batch job (slurm) or as a Ray job (ray)")
    dialect: Dialect = field("rltune", doc="how an override is spelled: rltune/hydra 'a.b=v', prime-rl '--a.b v', argparse '--flag v'")
    knob_map: dict[str, str] = field(default_factory=dict, doc="abstract knob -> the job's own override key")
    steps_override: str | None = field(None, doc="override key that sets the number of steps (e.g. 'trainer.total_steps')")
    workdir: str = field(".", doc="working directory, relative to job.yaml")
    env: dict[str, str] = field(default_factory=dict, doc="extra environment variables")
    timeout_s: float = field(1800.0, doc="wall-clock limit of one run; a run past it is killed and recorded as failed (slurm, ray: counted from when the job starts)", min=1, max=1e7)
    queue_timeout_s: float | None = field(None, doc="slurm, ray: how long a run may wait in the scheduler's queue before it is cancelled as timed out (null: no limit)", min=1, max=1e7)
    nproc_per_node: int = field(1, doc="torchrun: processes per node", min=1, max=1024)
    slurm_args: list[str] = field(default_factory=list, doc="slurm: the allocation's arguments (--partition, --nodes, --gpus-per-node, ...), given to sbatch and to the srun inside it; rltune sets --time, --output, --job-name and --chdir itself")
    ray_address: str | None = field(None, doc="ray: the cluster's jobs API, http://HEAD:8265 (null: $RAY_API_SERVER_ADDRESS or $RAY_ADDRESS)")
    ray_args: list[str] = field(default_factory=list, doc="ray: 'ray job submit' options: --entrypoint-num-cpus=N, --entrypoint-num-gpus=N, --entrypoint-memory=BYTES, --entrypoint-resources=JSON, --runtime-env-json=JSON, --metadata-json=JSON")

    def validate(self) -> None:
        if not self.command or not self.command[0].strip():
            raise FieldProblem("command", "give the job's argv, its program first (e.g. [python, train.py, ...])")
        for i, arg in enumerate(self.slurm_args):
            # '--time=10', '--time 10' (two items) and the short '-t10' / '-t 10' all name the option.
            flag = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
            if flag in SLURM_ARGS_SET_BY_RLTUNE:
                raise FieldProblem(f"slurm_args[{i}]", f"rltune sets {flag} itself ({SLURM_ARGS_SET_BY_RLTUNE[flag]}); remove it")
        try:
            ray_submit_options(self.ray_args)
        except ValueError as exc:
            raise FieldProblem("ray_args", str(exc)) from None
        if self.ray_address is not None and not _RAY_ADDRESS.fullmatch(self.ray_address):
            raise FieldProblem("ray_address", f"expected the jobs API address http(s)://HOST:PORT (the dashboard's, "
                                              f"8265 by default), found {self.ray_address!r}")


@dataclass
class MetricsSpec:
    format: LogFormat = field("rltune", doc="log format of the metrics file")
    path: str = field("{run_dir}/metrics.jsonl", doc="where the job writes its metrics; '{run_dir}' is filled in")
    vllm_metrics_url: str | None = field(None, doc="a vLLM /metrics endpoint to scrape during the run")


@dataclass
class Limits:
    noise_pct: float = field(4.0, doc="floor of the noise in %: a trial must beat the baseline by more than this and than the baseline's measured spread", min=0, max=100)
    recheck_below_pct: float | None = field(None, doc="a gain smaller than this is measured again before deciding (default 2 x the noise)", min=0, max=100)
    baseline_runs: int = field(2, doc="runs of the untuned baseline in 'rltune auto'; the range of their mean steps is the measured run-to-run noise", min=1, max=10)
    gap_ratio_max: float = field(2.0, doc="trainer-rollout gap may grow to this multiple of the untuned baseline's", min=1, max=1e6)
    sample_age_mean_max: float = field(3.0, doc="cap on the mean sample age, in weight versions", min=0, max=1e6)
    sample_age_max: int = field(8, doc="no sample may be older than this many weight versions", min=0, max=1_000_000)
    steps: int = field(10, doc="steps a trial runs", min=1, max=MAX_STEPS)
    warmup_steps: int = field(2, doc="first steps kept in the table but left out of medians", min=0, max=MAX_STEPS)
    min_forecast_gain_pct: float = field(5.0, doc="only candidates forecast at least this much faster are run", min=0, max=100)

    def validate(self) -> None:
        if self.warmup_steps >= self.steps:
            raise FieldProblem("warmup_steps", f"must be smaller than steps ({self.steps})")


@dataclass
class JobSpec:
    schema_version: int = field(doc="version of this schema (1)")
    name: str = field(doc="job name; cases from runs of the same name, model, workload and mode anchor each other")
    model: ModelSpec = field(doc="model facts")
    workload: WorkloadSpec = field(doc="workload facts")
    gpus: GpuBudget = field(doc="the fixed GPU budget")
    launch: LaunchSpec = field(doc="how to run the job")
    knobs: dict[str, KnobValue] = field(default_factory=dict, doc="baseline value of every abstract knob the tuner may move; 'rl_mode' is one (sync | one_step_async | fully_async)")
    metrics: MetricsSpec = field(default_factory=MetricsSpec, doc="where the metrics come from")
    limits: Limits = field(default_factory=Limits, doc="acceptance limits, fixed before any trial")

    @property
    def rl_mode(self) -> str:
        """The baseline RL mode (knob ``rl_mode``, default ``sync``)."""
        return str(self.knobs.get("rl_mode", "sync"))

    def validate(self) -> None:
        problem = name_problem(self.name)
        if problem:
            raise FieldProblem("name", problem)
        if self.rl_mode not in RL_MODES:
            raise FieldProblem("knobs.rl_mode", f"expected one of {', '.join(RL_MODES)}, found {self.rl_mode!r}")
        for knob, value in self.knobs.items():
            problem = knob_value_problem(knob, value)
            if problem:
                raise FieldProblem(f"knobs.{knob}", problem)
        for knob in self.launch.knob_map:
            if knob not in self.knobs:
                raise FieldProblem(f"launch.knob_map.{knob}", "maps a knob with no baseline value; add it under 'knobs'")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a job (file and directory names are made from it), or None."""
    if not name.strip():
        return "give the job a name (e.g. 'qwen3-8b-math')"
    if name != name.strip() or any(c in name for c in "/\\") or name in (".", "..") or not name.isprintable():
        return f"{name!r} is not a plain name: no path separators, surrounding spaces or control characters"
    return None


def _knob_info(knob: str) -> Any:
    from rltune.contracts.knowledge import shipped_knobs

    return shipped_knobs().get(knob)


def knob_value_problem(knob: str, value: Any, baseline: Any = None) -> str | None:
    """Why ``value`` cannot be knob ``knob``'s value, or None.

    A knob the shipped knowledge base describes takes values of its type (an int knob a whole
    number); a numeric knob whose smallest value there is 1 or more is a count (>= 1), one whose
    smallest is 0 is never negative (the knowledge's range bounds what a fix may reach, not a
    job's baseline). ``rl_mode`` is one of the RL modes. Otherwise, given ``baseline`` (a job's own
    value), the value has its kind: a number for a number, true/false for true/false, text for text.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"expected a finite number, found {value!r}"
    if knob == "rl_mode":
        return None if value in RL_MODES else f"expected one of {', '.join(RL_MODES)}, found {_shown(value)}"
    info = _knob_info(knob)
    kind = info.type if info is not None else _kind_of(baseline)
    if kind is None:
        return None
    numeric = kind in ("int", "float")
    if kind == "bool" and not isinstance(value, bool):
        return f"expected true or false, found {_shown(value)}"
    if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"expected {'an integer' if kind == 'int' else 'a number'}, found {_shown(value)}"
    if kind == "int" and info is not None and not isinstance(value, int):
        return f"expected an integer, found {_shown(value)}"
    if kind == "str" and not isinstance(value, str):
        return f"expected a string, found {_shown(value)}"
    if numeric and info is not None and info.min is not None:
        if info.min >= 1 and value < 1:
            return f"expected a count >= 1, found {value!r}"
        if info.min >= 0 and value < 0:
            return f"expected a value >= 0, found {value!r}"
    return None


def _kind_of(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "float"  # a job's own numeric knob: any number (its baseline may be written as 1 for 1.0)
    if isinstance(value, str):
        return "str"
    return None


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    return f"{value!r}"


def check_knob_overrides(job: JobSpec, overrides: Mapping[str, Any] | Iterable[tuple[str, Any]],
                         source: str) -> dict[str, KnobValue]:
    """Validate knob overrides against ``job`` and return them as a mapping.

    ``overrides`` is a mapping or (knob, value) pairs in the order given (``--set`` flags); a knob
    given twice is refused. Every knob must be one of the job's knobs (did-you-mean otherwise) and
    each value of its kind (:func:`knob_value_problem`). ``source`` names where the overrides come
    from in the message: ``--set``, ``forecast.yaml: forecasts[2].overrides``.
    """
    import difflib

    from rltune.errors import UnknownKeyError, WrongTypeError

    pairs = list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides)
    out: dict[str, KnobValue] = {}
    for knob, value in pairs:
        if knob in out:
            raise WrongTypeError(source, knob, f"given twice ({_shown(out[knob])}, then {_shown(value)}); give it once")
        if knob not in job.knobs:
            close = difflib.get_close_matches(knob, list(job.knobs), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"the job's knobs: {', '.join(job.knobs) or 'none'}"
            raise UnknownKeyError(source, knob, f"not a knob of job {job.name!r} ({hint}); add it under 'knobs' "
                                                "with its baseline value")
        problem = knob_value_problem(knob, value, job.knobs[knob])
        if problem:
            raise WrongTypeError(source, knob, f"{problem} (the job's baseline is {job.knobs[knob]!r})")
        out[knob] = value
    return out


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job.yaml."""
    return load_yaml(JobSpec, path, JOB_SCHEMA_VERSION)


def save_job(job: JobSpec, path: str | Path) -> None:
    dump_yaml(job, path)


def job_identity(job: JobSpec) -> dict[str, Any]:
    """The facts that make two runs 'the same job' for anchoring."""
    return {
        "job": job.name,
        "model": job.model.name,
        "workload": job.workload.kind,
        "gpus": job.gpus.count,
        "device": job.gpus.device,
    }
