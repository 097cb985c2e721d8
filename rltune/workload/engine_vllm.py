"""The reference workload on real vLLM engines (``engine.backend: vllm``): one vLLM engine per engine process.

Each engine process speaks the HF engine's message protocol (:mod:`rltune.workload.engine`:
generate / cancel / load / stats / stop in, ready / result / loaded / stats / error out), so the
engine client, the trials and every RL mode are the same for both backends. What runs behind it:

- **offline** (``engine.serve: false``): a vLLM ``LLMEngine`` inside the engine process, its engine
  core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The loop adds requests, runs one
  ``step()`` of vLLM's own scheduler (continuous batching, chunked prefill, prefix caching,
  preemption: whatever the engine arguments say) and hands back every finished request.
- **served** (``engine.serve: true``): the engine process starts ``vllm serve`` on 127.0.0.1
  (``python -m vllm.entrypoints.launchers.api_server.entry``, with ``VLLM_SERVER_DEV_MODE=1`` and
  ``--enable-scale-out``) and relays each request to its token-in/token-out route
  ``/inference/v1/generate`` from a thread; a cancel is vLLM's ``/inference/v1/abort_requests``.

Sampling returns each token's log-probability under the temperature-scaled distribution
(``logprobs_mode=processed_logprobs``), what the trainer computes: the trainer-rollout gap
compares like with like. Generation stops at the tokenizer's ``<eos>`` (``stop_token_ids``).

Weights go in through the ``vllm`` loader of the job's weight-sync transport
(:mod:`rltune.sync.transports`), which reaches the engine's workers through an RPC handle (vLLM's
own ``collective_rpc``: in-process offline, ``/collective_rpc`` served) and brackets its update
with the handle's pause and resume, always between two of vLLM's scheduler steps (mid-flight in
fully async, as in the HF engine). The engine process names no transport: it attaches the loader
before serving, starts its prefetch when a load arrives and keeps serving until it is ready
(:class:`rltune.workload.engine.WeightLoads`). Resuming resets the prefix cache (its blocks hold
keys and values of the old weights) and sets vLLM's weight version to rltune's; a request's
version is the oldest of vLLM's weight version spans over its tokens.

Counters come from vLLM itself: its Prometheus families (offline: the engine process's registry,
rendered as ``/metrics`` text; served: ``GET /metrics``), differenced per step with
:func:`rltune.profile.adapters.vllm.delta` and turned into the stage table's columns by the same
stage map ``rltune profile --vllm-metrics`` uses (:class:`VllmStepMetrics`). ``kv_cache_usage`` is
the peak of ``vllm:kv_cache_usage_perc`` over the step (offline: every scheduler step, through a
vLLM stat logger; served: polled while requests run), not its value at the step's end.

Engine arguments: ``engine.vllm`` holds vLLM ``EngineArgs`` fields as they are; rltune sets the
ones in :data:`RESERVED` from the rest of the config. One convention of rltune's own:
``spec_tokens: 0`` turns speculative decoding off (vLLM takes no 0), so a tuning job can move
``spec_tokens`` with ``spec_method: ngram`` written beside it. :func:`check_engine_args` builds vLLM's own
engine config from them before any engine starts, so a misspelt key or a value vLLM refuses is
one line naming the key, with vLLM's message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.errors import RltuneError, UnknownKeyError, WrongTypeError
from rltune.workload.engine import WeightLoads, drain
from rltune.workload.sampling import seeded_key

if TYPE_CHECKING:
    from rltune.workload.config import WorkloadConfig

# EngineArgs fields rltune sets itself, and where each comes from.
RESERVED = {
    "model": "the engines boot from the run's own checkpoint (<run_dir>/engine-boot)",
    "dtype": "set model.engine_dtype",
    "seed": "set orchestrator.seed",
    "skip_tokenizer_init": "the workload's character tokenizer runs in the orchestrator; engines take token ids",
    "tokenizer": "the workload's character tokenizer runs in the orchestrator; engines take token ids",
    "logprobs_mode": "the trainer-rollout gap compares temperature-scaled log-probs (processed_logprobs)",
    "max_model_len": "set env.context_limit_tokens and env.max_new_tokens (their sum)",
    "kv_cache_memory_bytes": "set engine.kv_cache_tokens (the KV budget in tokens at the engine dtype)",
    "worker_extension_cls": "rltune's weight-sync extension (rltune.sync.vllm) is always installed",
    "disable_log_stats": "the step's engine counters come from vLLM's stats",
    "generation_config": "sampling parameters come from the workload's env.* keys",
    "tensor_parallel_size": "the reference workload runs one-worker engines; scale with engine.num_engines",
}
SERVE_TIMEOUT_S = 600.0  # vllm serve is ready in ~20 s on an idle 2-core CPU, minutes when it is shared
HTTP_TIMEOUT_S = 600.0
KV_POLL_S = 0.05  # served engines: how often the KV-cache gauge is read while requests run (~2 ms a read here)


class VllmEngineArgsError(RltuneError):
    """vLLM refused the engine arguments (the message names the key and keeps vLLM's own words)."""


# --------------------------------------------------------------------------------------------- settings


@dataclass
class VllmEngineSettings:
    """What a vLLM engine process needs to start (picklable)."""

    device: str
    boot_dir: str
    run_dir: str
    engine_args: dict[str, Any]  # every EngineArgs field but ``model``
    serve: bool
    serve_flags: list[str]  # served: engine_args as vllm serve flags
    eos_id: int
    num_threads: int  # OMP threads bound per engine (0: vLLM's own binding)
    loader: Any  # the weight-sync transport's vllm loader (rltune.sync.transports), driven through the engine's RPC
    cpu_lists: list[str] = field(default_factory=list)  # per engine: VLLM_CPU_OMP_THREADS_BIND
    backend: str = "vllm"


def max_model_len(cfg: WorkloadConfig) -> int:
    """The longest context one request can reach: a turn's prompt (<= the context limit) plus its answer."""
    return cfg.env.context_limit_tokens + cfg.env.max_new_tokens


def kv_cache_bytes(cfg: WorkloadConfig) -> int:
    """``engine.kv_cache_tokens`` as vLLM's kv_cache_memory_bytes: the memory that many tokens take at
    the engine dtype (a KV cache in a narrower dtype, ``kv_cache_dtype: fp8``, holds more tokens in it)."""
    from rltune.workload.model import PRESETS

    p = PRESETS[cfg.model.preset]
    width = 2 if cfg.model.engine_dtype == "bfloat16" else 4
    return cfg.engine.kv_cache_tokens * p["num_hidden_layers"] * 2 * p["num_key_value_heads"] * p["head_dim"] * width


def engine_arguments(cfg: WorkloadConfig) -> dict[str, Any]:
    """Every EngineArgs field the engines get except ``model``: rltune's reserved ones, then ``engine.vllm``."""
    from rltune.sync.vllm import WORKER_EXTENSION

    args: dict[str, Any] = dict(
        dtype=cfg.model.engine_dtype, seed=cfg.orchestrator.seed, skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs", max_model_len=max_model_len(cfg),
        kv_cache_memory_bytes=kv_cache_bytes(cfg), worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=False, generation_config="vllm")
    args.update(cfg.engine.vllm)
    if args.get("spec_tokens") == 0:
        # speculative decoding off: vLLM takes no 0 draft tokens, and spec_method alone asks for a count
        args.pop("spec_tokens")
        args.pop("spec_method", None)
    return args


def check_reserved(cfg: WorkloadConfig, file: str) -> None:
    """Refuse ``engine.vllm`` keys rltune sets itself (no vLLM import: part of config validation)."""
    for key in cfg.engine.vllm:
        if key in RESERVED:
            raise WrongTypeError(file, f"engine.vllm.{key}", f"rltune sets this vLLM argument itself: {RESERVED[key]}")


def _one_line(text: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    out = "; ".join(lines)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _blamed_key(user_keys: list[str], message: str) -> str:
    """The user's key vLLM's message is about (the one whose name, or the config field it sets, it mentions)."""
    if len(user_keys) == 1:
        return user_keys[0]
    hits = [k for k in user_keys if k in message]
    if not hits:  # vLLM names its config field (cache_dtype), the argument is kv_cache_dtype
        hits = [k for k in user_keys if any(part in message for part in (k.split("_", 1)[-1], k.rsplit("_", 1)[0]))]
    return hits[0] if len(hits) == 1 else ", ".join(hits or user_keys)


def usage_context(serve: bool):
    """vLLM's usage context, which picks its defaults (max_num_seqs 256 offline, 128 served, on a CPU)."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER if serve else UsageContext.LLM_CLASS


def check_engine_args(cfg: WorkloadConfig, file: str) -> dict[str, Any]:
    """Build vLLM's own engine config from the engines' arguments; raise one line naming the key if vLLM refuses.

    Unknown keys are checked against ``EngineArgs``' fields (with a did-you-mean); values go through
    ``EngineArgs.create_engine_config``, vLLM's own validation, on a config-only copy of the model
    (nothing is loaded, nothing starts). Returns the resolved scheduler and cache settings.
    """
    from vllm.engine.arg_utils import EngineArgs

    check_reserved(cfg, file)
    with _quiet_vllm():
        return _check_engine_args(cfg, file, EngineArgs)


@contextlib.contextmanager
def _quiet_vllm():
    """vLLM's own log while it builds a config only to check it: errors only. Its handler writes to
    stdout, where 'rltune workload check' and 'rltune auto --json' print what a script reads."""
    import logging

    before = logging.root.manager.disable  # as vLLM's own suppress_logging: its loggers set their own levels
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def _check_engine_args(cfg: WorkloadConfig, file: str, EngineArgs) -> dict[str, Any]:  # noqa: N803 (vLLM's class)
    import difflib
    import tempfile

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in cfg.engine.vllm:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            try:
                EngineArgs(model="model", **{key: cfg.engine.vllm[key]})
            except TypeError as exc:  # vLLM's own words for an argument it does not have
                words = str(exc)
            else:
                words = f"EngineArgs has no field {key!r}"
            raise UnknownKeyError(file, f"engine.vllm.{key}", f"not a vLLM engine argument: {words}{hint}")
    args = engine_arguments(cfg)
    user_keys = list(cfg.engine.vllm)
    saved_env = dict(os.environ)
    try:
        with tempfile.TemporaryDirectory(prefix="rltune-vllm-check-") as model_dir:
            from rltune.workload.model import model_config

            hf_config = model_config(cfg.model.preset)
            # what the engines boot from names its class (write_boot_checkpoint); without it vLLM
            # resolves a pooling model and would validate against another runner's rules
            hf_config.architectures = ["Qwen3ForCausalLM"]
            hf_config.save_pretrained(model_dir)
            try:
                config = EngineArgs(model=model_dir, **args).create_engine_config(usage_context(cfg.engine.serve))
            except Exception as exc:  # pydantic ValidationError, ValueError, NotImplementedError: vLLM's refusals
                words = _one_line(f"{type(exc).__name__}: {exc}")
                where = f"engine.vllm.{_blamed_key(user_keys, str(exc))}" if user_keys else "engine"
                raise VllmEngineArgsError(f"{file}: {where}: vLLM refused the engine arguments: {words}") from None
    finally:
        # vLLM's CPU platform sets LD_PRELOAD, OMP and worker variables for the processes it starts;
        # the orchestrator's own children (sandboxes, torchrun) must not inherit them.
        os.environ.clear()
        os.environ.update(saved_env)
    return dict(max_num_seqs=config.scheduler_config.max_num_seqs,
                max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                enable_chunked_prefill=config.scheduler_config.enable_chunked_prefill,
                enable_prefix_caching=config.cache_config.enable_prefix_caching,
                block_size=config.cache_config.block_size, kv_cache_dtype=config.cache_config.cache_dtype,
                speculative=None if config.speculative_config is None else config.speculative_config.method)


def write_boot_checkpoint(module, directory: Path, engine_dtype) -> Path:
    """The trainer's initial weights, cast to the engines' dtype, as a Hugging Face checkpoint the engines boot from."""
    import copy

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(module.config)
    config.architectures = [type(module).__name__]  # what vLLM picks its model class by (else: a pooling model)
    config.save_pretrained(directory)
    state = {n: (t.detach().to(engine_dtype) if t.is_floating_point() else t.detach()).contiguous().cpu()
             for n, t in module.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def cpu_lists(num_engines: int, threads: int) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND of each engine: ``threads`` cores each, round-robin over this process's
    cores; empty strings (vLLM's own binding) when ``threads`` is 0."""
    if threads <= 0:
        return [""] * num_engines
    cores = sorted(os.sched_getaffinity(0))
    return [",".join(str(cores[(e * threads + k) % len(cores)]) for k in range(threads)) for e in range(num_engines)]


def settings_for(cfg: WorkloadConfig, run_dir: Path, boot_dir: Path, loader) -> VllmEngineSettings:
    """``loader``: the transport publisher's ``loader("vllm")``."""
    from rltune.workload.tokenizer import TOKENIZER

    args = engine_arguments(cfg)
    return VllmEngineSettings(
        device="cpu", boot_dir=str(boot_dir), run_dir=str(run_dir), engine_args=args,
        serve=cfg.engine.serve, serve_flags=cli_flags(args) if cfg.engine.serve else [], eos_id=TOKENIZER.eos_id,
        num_threads=cfg.engine.num_threads, loader=loader,
        cpu_lists=cpu_lists(cfg.engine.num_engines, cfg.engine.num_threads))


def cli_flags(engine_args: dict[str, Any]) -> list[str]:
    """EngineArgs fields as ``vllm serve`` flags: ``--max-num-seqs 64``, ``--enable-x`` / ``--no-enable-x``.

    A value equal to the field's own default is left out: the server's parser defaults to it too, and
    some of its switches (``--disable-log-stats``) have no ``--no-`` form.
    """
    from vllm.engine.arg_utils import EngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.default is not dataclasses.MISSING}
    argv: list[str] = []
    for key, value in engine_args.items():
        if value is None or (key in defaults and type(value) is type(defaults[key]) and value == defaults[key]):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


# --------------------------------------------------------------------------------------------- counters


def snapshot_from_text(text: str) -> dict[str, float]:
    from rltune.profile.adapters.vllm import parse_prometheus

    return parse_prometheus(text)


def _sum_snapshots(snapshots: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for snap in snapshots:
        for key, value in snap.items():
            if key.endswith(("/mean", "/p50", "/p90")) or key == "vllm:spec_decode_acceptance_rate":
                continue  # recomputed from the summed counts, sums and buckets
            out[key] = out.get(key, 0.0) + value
    return out


class VllmStepMetrics:
    """Per-step engine columns from every engine's vLLM counters (orchestrator side).

    Each engine's ``stats`` reply holds its vLLM snapshot (Prometheus families, cumulative) and the
    peak KV-cache use since its last reply. The step's figures are the increments of the engines'
    summed snapshots since the previous step, mapped to columns by the ``vllm`` stage map.
    """

    def __init__(self, baselines: list[dict[str, float]]):
        self.last = _sum_snapshots(baselines)

    def columns(self, engine_stats: list[dict[str, Any]]) -> dict[str, float | None]:
        from rltune.profile.adapters.vllm import delta
        from rltune.profile.stage_map import map_metrics

        now = _sum_snapshots([s["vllm"] for s in engine_stats])
        step = delta(self.last, now)
        self.last = now
        core, _ = map_metrics("vllm", step)
        out: dict[str, float | None] = {
            "engine_queue_s": core.get("engine_queue_s"),
            "engine_prefill_s": core.get("engine_prefill_s"),
            "engine_decode_s": core.get("engine_decode_s"),
            "engine_preemptions": core.get("engine_preemptions"),
            "kv_cache_usage": max((s["kv_peak_frac"] for s in engine_stats if s["kv_peak_frac"] is not None),
                                  default=None),
            # extras (vLLM's own figures for the step)
            "engine_gen_tokens": core.get("gen_tokens"),
            "engine_decode_steps": step.get("vllm:iteration_tokens_total/count"),
            "engine_ttft_s": step.get("vllm:time_to_first_token_seconds/mean"),
            "engine_requests": step.get("vllm:e2e_request_latency_seconds/count"),
            "engine_prompt_tokens": step.get("vllm:prompt_tokens_total"),
        }
        queries, hits = step.get("vllm:prefix_cache_queries_total"), step.get("vllm:prefix_cache_hits_total")
        if queries:
            out["engine_prefix_cache_hit_frac"] = (hits or 0.0) / queries
        drafted = step.get("vllm:spec_decode_num_draft_tokens_total")
        if drafted:
            out["engine_spec_acceptance"] = step.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / drafted
        busy = [s.get("busy_s") for s in engine_stats]
        if all(b is not None for b in busy):
            out["engine_busy_s"] = sum(busy)
        return out


# --------------------------------------------------------------------------------------------- weights


class _Rpc:
    """The loader's view of an offline engine (``collective_rpc`` in-process); ``resume`` also resets
    the prefix cache and sets the weight version, inside the update."""

    def __init__(self, engine, after_update):
        self.engine, self.after_update = engine, after_update

    def call(self, method: str, request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        return list(self.engine.collective_rpc(method, timeout=timeout_s, args=(json.dumps(request),)))

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        return list(self.engine.collective_rpc(method, kwargs=kwargs))

    def pause(self) -> None:
        pass  # offline: updates run between two scheduler steps, when no forward pass runs

    def resume(self) -> None:
        self.after_update()


# --------------------------------------------------------------------------------------------- engines


class _Base:
    """What both kinds share: the message loop, weight loads, version stamps, results, stats."""

    def __init__(self, index: int, s: VllmEngineSettings, out):
        self.index, self.s, self.out = index, s, out
        self.version = 0
        self.parent_pid = os.getppid()
        self.cancelled: set[int] = set()
        self.kv_peak = 0.0
        self.loads: WeightLoads | None = None  # set in start(), on the engine's RPC handle

    # subclasses: start, submit, cancel, idle, serving, pump, snapshot, close
    def request_seed(self, key: int) -> int:
        """vLLM's per-request seed for a request's ``sample_key``, mixed with the job's seed."""
        return seeded_key(int(self.s.engine_args.get("seed") or 0), key) & 0x7FFFFFFF

    def attach(self, rpc) -> dict[str, Any]:
        """Hand the transport's loader the engine's RPC handle, before the engine serves."""
        self.loads = WeightLoads(self.s.loader, rpc, self.index, self.out)
        return self.s.loader.attach(rpc)

    def serve(self, in_queue) -> None:
        info = self.start()
        self.out.put(("ready", self.index, info))
        while True:
            if os.getppid() != self.parent_pid:
                self.close()
                return
            pending = self.loads.pending is not None
            # a load waiting for its prefetch: look again soon (served engines have no loop work to pace them)
            for msg in drain(in_queue, wait=self.idle() or (pending and self.serving()), timeout=0.01 if pending else 0.5):
                if msg[0] == "stop":
                    self.close()
                    return
                self.handle(msg)
            self.pump()
            if self.loads.due(serving=self.serving()):
                self.loads.finish(self._set_version)

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            _, req_id, prompt, max_new, temperature, submitted, key = msg
            self.submit(int(req_id), list(prompt), int(max_new), float(temperature), int(key))
        elif kind == "cancel":
            self.cancelled.add(int(msg[1]))
            self.cancel(int(msg[1]))
        elif kind == "load":
            _, version, message = msg
            self.next_version = int(version)  # what resuming after the update stamps (reset_and_stamp)
            self.loads.begin(int(version), message)
        elif kind == "stats":
            stats = self.stats()
            stats["kv_peak_frac"] = self.kv_peak
            self.kv_peak = self.current_kv()  # the next step starts from what the cache holds now
            self.out.put(("stats", self.index, stats))
        else:
            raise ValueError(f"engine got an unknown message {kind!r}")

    def _set_version(self, version: int) -> None:
        self.version = version  # (vLLM's own weight version was set when the update resumed the engine)

    def finish(self, req_id: int, tokens: list[int], logprobs: list[float], spans, reason: str | None) -> None:
        if req_id in self.cancelled or reason == "abort":
            self.cancelled.discard(req_id)
            return
        versions = [int(v) for v in spans if str(v).isdigit()]
        self.out.put(("result", self.index, req_id, {
            "tokens": tokens, "logprobs": logprobs, "version": min(versions) if versions else self.version,
            "queue_s": None, "prefill_s": None, "decode_s": None, "preemptions": 0,
            "eos": bool(tokens) and tokens[-1] == self.s.eos_id,
        }))


def _sampling(max_new: int, temperature: float, eos: int, seed: int | None = None) -> dict[str, Any]:
    """A request's sampling parameters. ``seed`` (vLLM's per-request seed) gives the request its own
    generator, as the HF engine's requests have (rltune.workload.sampling): its draws do not depend on
    what the batch it shares drew before it."""
    return dict(max_tokens=max_new, temperature=temperature, logprobs=0, stop_token_ids=[eos], detokenize=False,
                **({} if seed is None else {"seed": seed}))


class OfflineEngine(_Base):
    """A vLLM ``LLMEngine`` in this process, stepped by the message loop."""

    def start(self) -> dict[str, Any]:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        start = time.perf_counter()
        engine_self = self

        from vllm.v1.metrics.loggers import StatLoggerBase

        class KvPeakLogger(StatLoggerBase):
            """vLLM's per-step scheduler stats: the KV-cache use after every step, for the step's peak."""

            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    engine_self.kv_peak = max(engine_self.kv_peak, float(scheduler_stats.kv_cache_usage))
                    engine_self.kv_now = float(scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self):
                pass

        self.kv_now = 0.0
        args = EngineArgs(model=self.s.boot_dir, **self.s.engine_args)
        self.engine = LLMEngine.from_engine_args(args, usage_context(False), stat_loggers=[KvPeakLogger])
        self.engine.set_weight_version("0")  # vLLM labels each token's weights; rltune's versions count from 0
        self.requests: dict[str, int] = {}  # vLLM's request id -> ours
        self.busy_s = 0.0
        self.steps = 0
        info: dict[str, Any] = {"boot_s": time.perf_counter() - start}
        info.update(self.attach(_Rpc(self.engine, self._after_update)))
        self._warm_up()
        self.kv_peak = 0.0
        info.update(params=0, warm_up_s=time.perf_counter() - start - info["boot_s"], vllm=self.snapshot())
        return info

    def _warm_up(self) -> None:
        """One request with logprobs before the engine reports ready: vLLM's first one costs seconds once."""
        from vllm import SamplingParams

        self.engine.add_request("rltune-warm-up", {"prompt_token_ids": [self.s.eos_id] * 4},
                                SamplingParams(**_sampling(4, 1.0, self.s.eos_id)))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _after_update(self) -> None:
        self.engine.reset_prefix_cache()
        self.version = self.next_version
        self.engine.set_weight_version(str(self.version))

    def idle(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def serving(self) -> bool:
        return self.engine.has_unfinished_requests()

    def submit(self, req_id: int, prompt: list[int], max_new: int, temperature: float, key: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**_sampling(max_new, temperature, self.s.eos_id, self.request_seed(key)),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        internal = self.engine.add_request(str(req_id), {"prompt_token_ids": prompt}, params)
        self.requests[str(req_id)] = req_id
        self.requests[internal] = req_id

    def cancel(self, req_id: int) -> None:
        if str(req_id) in self.requests:
            self.engine.abort_request([str(req_id)])

    def pump(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        start = time.perf_counter()
        outputs = self.engine.step()
        self.busy_s += time.perf_counter() - start
        self.steps += 1
        for out in outputs:
            if not out.finished:
                continue
            req_id = self.requests.pop(out.request_id, None)
            if req_id is None:
                continue
            self.requests.pop(str(req_id), None)
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            logprobs = [float(lp[t].logprob) for lp, t in zip(comp.logprobs or [], tokens, strict=True)]
            spans = [s.version for s in (getattr(comp, "weight_versions", None) or [])]
            self.finish(req_id, tokens, logprobs, spans, comp.finish_reason)

    def snapshot(self) -> dict[str, float]:
        from prometheus_client import REGISTRY, generate_latest

        return snapshot_from_text(generate_latest(REGISTRY).decode())

    def current_kv(self) -> float:
        return self.kv_now

    def stats(self) -> dict[str, Any]:
        out = {"vllm": self.snapshot(), "busy_s": self.busy_s, "engine_steps": float(self.steps)}
        self.busy_s, self.steps = 0.0, 0
        return out

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            del self.engine


class ServedEngine(_Base):
    """``vllm serve`` on 127.0.0.1, started by this process; requests relayed over HTTP from threads."""

    def start(self) -> dict[str, Any]:
        import socket
        import subprocess
        import sys
        from concurrent.futures import ThreadPoolExecutor

        import rltune

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.s.boot_dir,
                "--host", "127.0.0.1", "--port", str(self.port), "--enable-scale-out",
                *self.s.serve_flags]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1")
        package_root = str(Path(rltune.__file__).resolve().parents[1])  # the worker extension imports rltune
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        self.log_path = Path(self.s.run_dir) / f"engine-{self.index}-serve.log"
        self.log = open(self.log_path, "w", encoding="utf-8")
        start = time.perf_counter()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(start)
        info: dict[str, Any] = {"boot_s": time.perf_counter() - start, "url": self.url}
        self._http("POST", "/update_weight_version", {"new_version": "0"})
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="rltune-vllm-http")
        self.outstanding = 0
        self.lock = threading.Lock()
        info.update(self.attach(self._rpc()))
        self._http("POST", "/inference/v1/generate", self._body("rltune-warm-up", [self.s.eos_id] * 4, 4, 1.0))
        self.stop_polling = threading.Event()
        self.kv_peak, self.kv_sampled = 0.0, False
        self.poller = threading.Thread(target=self._poll_kv, name="rltune-vllm-kv", daemon=True)
        self.poller.start()
        info.update(params=0, vllm=self.snapshot())
        return info

    def _wait_ready(self, start: float) -> None:
        import urllib.request

        while True:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
                raise RltuneError(f"vllm serve exited with {self.proc.returncode} before it was ready "
                                  f"(log: {self.log_path}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.perf_counter() - start > SERVE_TIMEOUT_S:
                raise RltuneError(f"vllm serve was not ready within {SERVE_TIMEOUT_S:.0f} s (log: {self.log_path})")
            time.sleep(0.5)

    def _rpc(self):
        from rltune.sync.vllm.receiver import HttpRpc

        engine = self

        class ServedRpc(HttpRpc):
            def resume(self) -> None:
                engine._after_update()
                super().resume()

        return ServedRpc(self.url, pause_mode="keep", http_timeout_s=HTTP_TIMEOUT_S)

    def _http(self, method: str, path: str, body: Any = None, timeout: float = HTTP_TIMEOUT_S) -> Any:
        import urllib.request

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise RltuneError(f"{self.url}{path}: HTTP {exc.code}: {detail}") from None
        if path == "/metrics":
            return raw.decode("utf-8", "replace")
        return json.loads(raw) if raw else None

    def _body(self, request_id: str, prompt: list[int], max_new: int, temperature: float,
              seed: int | None = None) -> dict[str, Any]:
        return dict(request_id=request_id, token_ids=prompt, model=self.s.boot_dir,
                    sampling_params=_sampling(max_new, temperature, self.s.eos_id, seed))

    def _after_update(self) -> None:
        self._http("POST", "/reset_prefix_cache")
        self.version = self.next_version
        self._http("POST", "/update_weight_version", {"new_version": str(self.version)})

    def idle(self) -> bool:
        return True  # requests run in the server; this loop only relays messages

    def serving(self) -> bool:
        return self.outstanding > 0

    def pump(self) -> None:
        pass

    def submit(self, req_id: int, prompt: list[int], max_new: int, temperature: float, key: int) -> None:
        with self.lock:
            self.outstanding += 1
        self.pool.submit(self._generate, req_id, prompt, max_new, temperature, key)

    def _generate(self, req_id: int, prompt: list[int], max_new: int, temperature: float, key: int) -> None:
        try:
            out = self._http("POST", "/inference/v1/generate",
                             self._body(f"rltune-{req_id}", prompt, max_new, temperature, self.request_seed(key)))
            choice = out["choices"][0]
            tokens = list(choice["token_ids"])
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            spans = [s["version"] for s in choice.get("weight_versions") or []]
            self.finish(req_id, tokens, logprobs, spans, choice.get("finish_reason"))
        except Exception:  # the orchestrator turns this into an RltuneError naming the engine
            self.out.put(("error", self.index, traceback.format_exc()))
        finally:
            with self.lock:
                self.outstanding -= 1

    def cancel(self, req_id: int) -> None:
        self.pool.submit(self._http, "POST", "/inference/v1/abort_requests", {"request_ids": [f"rltune-{req_id}"]})

    def _poll_kv(self) -> None:
        import re

        gauge = re.compile(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+(\S+)", re.M)
        while not self.stop_polling.wait(KV_POLL_S):
            if not self.outstanding:
                continue
            try:
                text = self._http("GET", "/metrics", timeout=5)
            except (OSError, RltuneError):
                continue
            values = [float(v) for v in gauge.findall(text)]
            if values:
                self.kv_peak = max(self.kv_peak or 0.0, max(values))
                self.kv_sampled = True

    def snapshot(self) -> dict[str, float]:
        return snapshot_from_text(self._http("GET", "/metrics"))

    def current_kv(self) -> float:
        return 0.0

    def stats(self) -> dict[str, Any]:
        # no reading while requests ran (all began and ended between two polls): not measured, left out
        if not self.kv_sampled:
            self.kv_peak = None
        self.kv_sampled = False
        return {"vllm": self.snapshot(), "busy_s": None}

    def close(self) -> None:
        if getattr(self, "stop_polling", None) is not None:
            self.stop_polling.set()
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001 (a server that ignores SIGTERM is killed)
                proc.kill()
                proc.wait(10)
        if getattr(self, "log", None) is not None:
            self.log.close()


def engine_main(index: int, settings: VllmEngineSettings, in_queue, out_queue) -> None:
    """Entry point of a vLLM engine process."""
    engine = None
    try:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override kv_cache_memory_bytes with whole GiB
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1")
        bind = settings.cpu_lists[index] if index < len(settings.cpu_lists) else ""
        if bind:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        engine = (ServedEngine if settings.serve else OfflineEngine)(index, settings, out_queue)
        engine.serve(in_queue)
    except Exception:  # report any crash to the orchestrator, which turns it into an RltuneError
        out_queue.put(("error", index, traceback.format_exc()))
        if engine is not None:
            engine.close()


__all__ = ["RESERVED", "VllmEngineArgsError", "VllmEngineSettings", "VllmStepMetrics", "check_engine_args",
           "check_reserved", "cli_flags", "engine_arguments", "engine_main", "kv_cache_bytes", "max_model_len",
           "settings_for", "write_boot_checkpoint"]
