"""The theory model: one formula per stage for how its time changes with the configuration.

Each stage time is a sum of *terms* from a registry (:data:`TERMS`); a term reads some settings
(knobs or facts), owns named coefficients, and computes seconds for many setups at once (numpy
arrays, so fitting on 1,000 cases and forecasting 100 candidates stay fast). The built-in terms:

- training: ``6 x active params x tokens x passes / (trainer GPUs x efficiency)`` -- gradient
  checkpointing adds a forward pass, no packing pays padding, each micro-batch pays a fixed cost;
  the old-logprob pass (``reuse_rollout_logprobs: false``) adds ``2 x active x tokens``;
- rollout: decode steps over the longest trial (``answer cap x turns``) per wave of concurrent
  sequences -- concurrency is capped by KV-cache capacity, split over engines, and where trials
  run in sandboxes by the pool's slots (a trial holds its sandbox while it generates); static batching
  waits for whole waves, continuous batching refills slots; each decode step reads the weights
  (fp8 halves the bytes) and computes on the active batch; ``engine_compile`` scales the per-step
  overhead; in fully async mode rollout runs ahead (up to the sample-age cap, as many batches as the
  engines' slots hold) and one batch costs a share of that joint time (a fitted efficiency); engines
  on one host's cores (a job without GPUs) take turns on them, so more engines split the batch but
  not the time (a fitted exponent, :func:`engines_sharing_cores`); a generation
  round that feeds several optimizer steps (a generation batch of several steps' samples, a batch
  trained on more than once) costs each step its share; sandboxes add setup (cheaper with a prebuilt image) and execution per trial, divided
  over the sandboxes that really run at once -- the pool, capped by the host cores that run them;
- weight sync: a fixed cost plus bytes / bandwidth per transport (``sparse_delta`` ships only the
  changed fraction);
- an example effect term, the seed's routing-replay CPU copy (``routing_replay: true``).

In the overlapped RL modes a fitted factor per mode and stage stretches the part of rollout and
training that runs alongside the other stage (:func:`overlap_slowdown`): where they share devices
(a CPU-only job) each slows the other for as long as both run, so a cheaper trainer step also frees
the rollout it overlaps. A term
with a ``column`` (the old-logprob pass, ``old_logprob_s``) is also fitted to that column directly.

Coefficients start from physical priors per device class ('cpu' or 'gpu') and are fitted to the
library with ``scipy.optimize.least_squares`` on log-times (a weak pull towards the priors keeps
unidentified coefficients sane). Where a device class holds several jobs, each job with a few runs
gets its own coefficients, tied to the class's by a penalty on their log distance (one tool-use
job's longer sequences no longer bend what the math job's runs fit). Each case counts by how
precisely it measured (:func:`case_fit_weight`). Measured counts a theory quantity predicts
(:data:`COUNT_COLUMNS`: decode steps, a trial's mean sandbox set-up and command time) are fitted
too; they and the per-term columns pin coefficients whatever the cases ran
(:func:`pinned_coefficients`). :meth:`TheoryModel.fit` is cheap and is redone whenever the
library changes; :func:`systematic_miss` reads the forecasts stored beside each case and says
which stages the forecasts miss in one direction, the signal to refit or to register a new term
(:func:`register_term`). A setting no term reads is not estimable by theory: the forecast must
take it from measured pairs (:mod:`rltune.predict.effects`) or count it as uncertain.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rltune.predict.setup import Setup, setup_from_case

if TYPE_CHECKING:
    from rltune.contracts.cases import CaseRecord

STAGES = ("rollout", "training", "weight_sync")
STAGE_COLUMN = {"rollout": "rollout_s", "training": "training_s", "weight_sync": "weight_sync_s"}
EPS_S = 1e-3  # seconds added before taking logs: a stage measured as 0 must not dominate the fit
# Datasheet figures per GPU type: (dense bf16 FLOP/s, dense fp8 FLOP/s, HBM bytes/s, memory bytes, scale-up link bytes/s
# per direction, GPUs in one scale-up domain). They enter the terms as ratios to the reference GPU's (the H200's, the
# card the GPU priors were set on), each type times a fitted factor (``gpu_speed_<type>``, prior 1): a GPU the library
# has seen once is priced by its datasheet, refined by that run. A type not listed is priced as the reference.
GPU_DATASHEET: dict[str, tuple[float, float, float, float, float, int]] = {
    "H100": (989e12, 1979e12, 3.35e12, 80e9, 450e9, 8),
    "H100-HBM2e": (989e12, 1979e12, 3.35e12, 96e9, 450e9, 8),  # a 500 W HBM2e part: H100's figures, its factor refines them
    "H800": (989e12, 1979e12, 3.35e12, 80e9, 200e9, 8),
    "H200": (989e12, 1979e12, 4.8e12, 141e9, 450e9, 8),
    "H20": (148e12, 296e12, 4.0e12, 96e9, 450e9, 8),
    "B200": (2.25e15, 4.5e15, 8.0e12, 180e9, 900e9, 8),
    "B300": (2.25e15, 4.5e15, 8.0e12, 288e9, 900e9, 8),
    "GB200": (2.5e15, 5.0e15, 8.0e12, 186e9, 900e9, 72),
    "GB300": (2.5e15, 5.0e15, 8.0e12, 288e9, 900e9, 72),
    "A100": (312e12, 312e12, 2.04e12, 80e9, 300e9, 8),
    "A800": (312e12, 312e12, 2.04e12, 80e9, 200e9, 8),
    "L40S": (362e12, 733e12, 0.864e12, 48e9, 32e9, 1),
    "L20": (119.5e12, 239e12, 0.864e12, 48e9, 32e9, 1),
    "A6000": (154.8e12, 154.8e12, 0.768e12, 48e9, 32e9, 1),
    "MI300X": (1307e12, 2615e12, 5.3e12, 192e9, 448e9, 8),
}
REFERENCE_GPU = "H200"
INTER_NODE_BYTES_PER_S = 50e9  # one GPU's share of the network between scale-up domains (400 Gb/s per GPU)
GPU_MEMORY_BYTES = {name: sheet[3] for name, sheet in GPU_DATASHEET.items()}
DEFAULT_GPU_CONCURRENCY = 256.0  # sequences an engine on a GPU decodes at once where the job does not say (vLLM's max_num_seqs)
TRAINER_ONLY_WORKLOAD = "trainer_only"  # a trainer benchmark: no rollout, no weight sync (imported public runs)
SANDBOXED_WORKLOADS = ("tool_use", "coding")  # trials that run in sandboxes, over several model turns
# layers x hidden of a model whose shape is not given, from its active parameters: the fit over dense Llama-3 shapes
# (8 B: 32 x 4096, 70 B: 80 x 8192, 405 B: 126 x 16384); it prices attention's share, which grows with the sequence.
WIDTH_DEPTH_SCALE, WIDTH_DEPTH_POWER = 0.0147, 0.702
# key/value cache bytes per token of a model whose shape is not given: 1.45 x sqrt(active params) fits grouped-query
# models from 3 B to 32 B active (Llama 3.1 8B: 131 kB, Qwen3-32B: 262 kB, Qwen3-235B-A22B: 192 kB in bf16)
KV_BYTES_SCALE = 1.45
# Coefficients that are fractions or factors of a physical quantity keep their meaning while fitted.
BOUNDS = {"continuous_fill": (0.05, 1.0), "run_ahead_efficiency": (0.05, 1.0), "sandbox_overlap": (0.01, 1.0), "compile_factor": (0.05, 1.5),
          "prebuilt_factor": (0.01, 1.0),
          "delta_fraction": (0.001, 1.0), "padding_overhead": (0.01, 3.0), "checkpoint_overhead": (0.05, 1.5),
          "lora_factor": (0.3, 1.2), "attention_factor": (0.1, 10.0), "fa3_attention_factor": (0.2, 1.5), "fp8_train_factor": (0.3, 1.2), "selective_overhead": (0.01, 1.0), "offload_overhead": (0.01, 2.0),
          **{f"gpu_speed_{name}": (0.2, 5.0) for name in GPU_DATASHEET},
          **{f"overlap_{mode}_{stage}": (0.5, 10.0) for mode in ("one_step_async", "fully_async") for stage in ("rollout", "training")}}
FREE_RANGE = 1e4
MAX_FIT_CASES = 300  # other coefficients may move this factor either way from their prior
JOB_PRIOR_WEIGHT = 0.3  # pull of a job's own coefficients towards its device class's fitted ones (log space)
MIN_JOB_FIT_CASES = 2  # a job gets its own coefficients once it has this many ok cases
# Pull towards the priors in a class whose fit holds public runs: their step alone (one residual where a run of ours
# gives three) must not let every coefficient wander; a prior good to a factor of about e against a residual of about 0.3.
PUBLIC_PRIOR_WEIGHT = 0.3
FIT_RUN_NOISE = 0.03  # run-to-run noise (log) every run carries beside its own step spread; see case_fit_weight
SANDBOX_SOFT_MIN_POWER = 4.0
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "float32": 4.0, "bfloat16": 2.0}


class Features:
    """Vectorised access to the settings of many setups; values are memoised numpy arrays."""

    def __init__(self, setups: Sequence[Setup]):
        self.setups = list(setups)
        self.n = len(self.setups)
        self._settings = [s.settings() for s in self.setups]
        self._memo: dict[tuple, np.ndarray] = {}

    def num(self, name: str, default: float) -> np.ndarray:
        key = ("num", name, default)
        if key not in self._memo:
            values = []
            for s in self._settings:
                v = s.get(name, default)
                values.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default)
            self._memo[key] = np.asarray(values, dtype=float)
        return self._memo[key]

    def flag(self, name: str, default: bool) -> np.ndarray:
        key = ("flag", name, default)
        if key not in self._memo:
            self._memo[key] = np.asarray([1.0 if _truthy(s.get(name, default)) else 0.0 for s in self._settings])
        return self._memo[key]

    def equals(self, name: str, value: str, default: str) -> np.ndarray:
        key = ("eq", name, value, default)
        if key not in self._memo:
            self._memo[key] = np.asarray([1.0 if str(s.get(name, default)) == value else 0.0 for s in self._settings])
        return self._memo[key]

    def text(self, name: str, default: str) -> list[str]:
        return [str(s.get(name, default)) for s in self._settings]

    def fact(self, name: str, default: float) -> np.ndarray:
        """A model or workload fact of each setup (``job.yaml``'s model facts are facts, not settings: the
        similarity distance never reads them), ``default`` where a setup lacks it."""
        key = ("fact", name, default)
        if key not in self._memo:
            values = []
            for s in self.setups:
                v = s.facts.get(name, default)
                values.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default)
            self._memo[key] = np.asarray(values, dtype=float)
        return self._memo[key]

    def derived(self, name: str, fn: Callable[[Features], np.ndarray]) -> np.ndarray:
        key = ("derived", name)
        if key not in self._memo:
            self._memo[key] = fn(self)
        return self._memo[key]


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.lower() in ("true", "1", "yes", "on")
    return bool(v)


# ---- shared derived quantities -------------------------------------------------------------------

def samples(f: Features) -> np.ndarray:
    return np.maximum(f.num("batch", 1.0), 1.0)


def sandboxed(f: Features) -> np.ndarray:
    """1 where trials run in sandboxes over several model turns (tool use, coding), else 0."""
    return f.derived("sandboxed", lambda f: np.asarray([1.0 if w in SANDBOXED_WORKLOADS else 0.0 for w in f.text("workload", "math")]))


def has_rollout(f: Features) -> np.ndarray:
    """0 for a trainer benchmark (no rollout and no weight sync), else 1."""
    return 1.0 - f.equals("workload", TRAINER_ONLY_WORKLOAD, "math")


def turns(f: Features) -> np.ndarray:
    def compute(f: Features) -> np.ndarray:
        cap = np.maximum(answer_cap(f), 1.0)
        by_context = np.maximum(f.num("context_limit_tokens", 4096.0) / cap, 1.0)
        return 1.0 + sandboxed(f) * (np.minimum(3.0, by_context) - 1.0)
    return f.derived("turns", compute)


def answer_cap(f: Features) -> np.ndarray:
    """Generated tokens a model turn may take: the answer cap; where only a cap on prompt + answer is known, that."""
    def compute(f: Features) -> np.ndarray:
        known = f.num("answer_cap_tokens", 0.0)
        total = f.num("context_limit_tokens", 0.0)
        return np.where(known > 0, known, np.where(total > 0, total, 256.0))
    return f.derived("answer_cap", compute)


def gen_len(f: Features) -> np.ndarray:
    return answer_cap(f) * turns(f)


def seq_len(f: Features) -> np.ndarray:
    return np.minimum(f.num("context_limit_tokens", 1e9), 1.5 * gen_len(f))


def sequence_tokens(f: Features) -> np.ndarray:
    """Mean tokens of one trained sequence: what the source measured where it says, else the theory's ``seq_len``."""
    return f.derived("sequence_tokens", lambda f: np.where(f.fact("sequence_tokens", 0.0) > 0, f.fact("sequence_tokens", 0.0),
                                                           seq_len(f)))


def active_params(f: Features) -> np.ndarray:
    """Parameters active per token; the total where the source does not say (a dense model)."""
    return f.derived("active_params", lambda f: np.where(f.num("active_params", 0.0) > 0, f.num("active_params", 0.0),
                                                         f.num("total_params", 1e9)))


def moe(f: Features) -> np.ndarray:
    """1 for a mixture-of-experts model: fewer parameters active per token than it holds."""
    return f.derived("moe", lambda f: (active_params(f) < f.num("total_params", 0.0) * 0.999).astype(float))


def width_depth(f: Features) -> np.ndarray:
    """layers x hidden: from the model's facts, else estimated from its active parameters (:data:`WIDTH_DEPTH_SCALE`)."""
    def compute(f: Features) -> np.ndarray:
        known = f.fact("layers", 0.0) * f.fact("hidden", 0.0)
        return np.where(known > 0, known, WIDTH_DEPTH_SCALE * active_params(f) ** WIDTH_DEPTH_POWER)
    return f.derived("width_depth", compute)


def kv_bytes_per_token(f: Features) -> np.ndarray:
    """Key/value cache bytes of one token: from the model's shape where known, else :data:`KV_BYTES_SCALE`."""
    def compute(f: Features) -> np.ndarray:
        element = 1.0 + 1.0 * f.equals("kv_cache_dtype", "auto", "auto")  # fp8 cache: 1 byte
        shape = 2.0 * f.fact("layers", 0.0) * f.fact("kv_heads", 0.0) * f.fact("head_dim", 0.0)
        return np.where(shape > 0, shape * element, KV_BYTES_SCALE * np.sqrt(active_params(f)) * element / 2.0)
    return f.derived("kv_bytes_per_token", compute)


def _sheet(f: Features, column: int) -> np.ndarray:
    ref = GPU_DATASHEET[REFERENCE_GPU][column]
    return np.asarray([GPU_DATASHEET.get(d, GPU_DATASHEET[REFERENCE_GPU])[column] / ref if d.lower() != "cpu" else 1.0
                       for d in f.text("device", "cpu")])


def flops_ratio(f: Features, dtype_knob: str | None = None) -> np.ndarray:
    """Dense FLOP/s of each setup's GPU over the reference GPU's: bf16, or fp8 where the setting ``dtype_knob``
    says fp8; 1 on a CPU."""
    def compute(f: Features) -> np.ndarray:
        fp8 = f.equals(dtype_knob, "fp8", "bf16") if dtype_knob else np.zeros(f.n)
        return _sheet(f, 0) * (1.0 - fp8) + _sheet(f, 1) * fp8 * (GPU_DATASHEET[REFERENCE_GPU][0] / GPU_DATASHEET[REFERENCE_GPU][1])
    return f.derived(f"flops_ratio_{dtype_knob}", compute)


def hbm_ratio(f: Features) -> np.ndarray:
    """HBM bandwidth of each setup's GPU over the reference GPU's; 1 on a CPU."""
    return f.derived("hbm_ratio", lambda f: _sheet(f, 2))


def gpu_memory(f: Features) -> np.ndarray:
    """Memory bytes of one GPU (0 on a CPU or an unknown type)."""
    return f.derived("gpu_memory", lambda f: np.asarray([GPU_DATASHEET[d][3] if d in GPU_DATASHEET else 0.0
                                                         for d in f.text("device", "cpu")]))


def scale_up_domain(f: Features) -> np.ndarray:
    """GPUs one scale-up link (NVLink) joins: a node of 8, an NVL72 rack of 72."""
    return f.derived("scale_up_domain", lambda f: np.asarray([float(GPU_DATASHEET.get(d, GPU_DATASHEET[REFERENCE_GPU])[5])
                                                              for d in f.text("device", "cpu")]))


def gpu_speed(f: Features, c: dict[str, float]) -> np.ndarray:
    """The fitted factor of each setup's GPU type on its datasheet speed (1 for a CPU or an unlisted type)."""
    out = np.ones(f.n)
    for name in GPU_DATASHEET:
        mask = f.equals("device", name, "cpu")
        if mask.any():
            out = out * (1.0 + mask * (c[f"gpu_speed_{name}"] - 1.0))
    return out


def trainer_devices(f: Features) -> np.ndarray:
    def compute(f: Features) -> np.ndarray:
        gpus = f.num("gpus", 0.0)
        half = np.maximum(gpus / 2.0, 1.0)
        base = np.where(f.num("trainer_gpus", 0.0) > 0, f.num("trainer_gpus", 0.0), half)
        return np.where(gpus > 0, np.maximum(base, 1.0), 1.0)
    return f.derived("trainer_devices", compute)


def engines(f: Features) -> np.ndarray:
    """Engines serving the rollout: the setting; else the rollout GPUs over each engine's tensor parallelism."""
    def compute(f: Features) -> np.ndarray:
        set_ = f.num("num_engines", 0.0)
        by_gpus = f.num("rollout_gpus", 0.0) / engine_tp(f)
        return np.maximum(np.where(set_ > 0, set_, np.where(by_gpus >= 1, np.floor(by_gpus), 1.0)), 1.0)
    return f.derived("engines", compute)


def trainer_layout(f: Features) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tensor, pipeline, context, expert, data) parallel degrees of the trainer; data = trainer GPUs / (tp x pp x cp)."""
    def degree(name: str) -> np.ndarray:
        return np.maximum(f.num(name, 1.0), 1.0)

    tp, pp, cp, ep = degree("trainer_tp"), degree("trainer_pp"), degree("trainer_cp"), degree("trainer_ep")
    dp = f.derived("trainer_dp", lambda f: np.maximum(trainer_devices(f) / (tp * pp * cp), 1.0))
    return tp, pp, cp, ep, dp


def micro_batches_per_rank(f: Features) -> np.ndarray:
    """Micro-batches one data-parallel rank runs per step: its share of the batch over the micro-batch size; the
    stated count where the job gives one (``micro_batches``); 1 where neither is known."""
    def compute(f: Features) -> np.ndarray:
        *_, dp = trainer_layout(f)
        mb = np.maximum(f.num("micro_batch_size", 0.0), 0.0)
        stated = f.num("micro_batches", 0.0)
        by_size = np.ceil(samples(f) / np.maximum(dp * np.maximum(mb, 1.0), 1.0) - 1e-9)
        return np.where(mb > 0, np.maximum(by_size, 1.0), np.where(stated > 0, stated, 1.0))
    return f.derived("micro_batches_per_rank", compute)


def pipeline_bubble(f: Features) -> np.ndarray:
    """Idle share of a pipeline-parallel step (1F1B): (pp - 1) / (m + pp - 1) for m micro-batches per optimizer step."""
    def compute(f: Features) -> np.ndarray:
        _, pp, _, _, dp = trainer_layout(f)
        per_optimizer_step = np.where(f.num("train_batch_samples", 0.0) > 0, f.num("train_batch_samples", 0.0), samples(f))
        m = np.maximum(per_optimizer_step / (dp * np.maximum(f.num("micro_batch_size", 1.0), 1.0)), 1.0)
        return (pp - 1.0) / (m + pp - 1.0)
    return f.derived("pipeline_bubble", compute)


def engine_tp(f: Features) -> np.ndarray:
    return np.maximum(f.num("engine_tp", 1.0), 1.0)


def weight_bytes(f: Features) -> np.ndarray:
    def compute(f: Features) -> np.ndarray:
        dtypes = f.text("weight_dtype", "")
        model = f.text("model_dtype", "bf16")
        per = np.asarray([BYTES_PER_WEIGHT.get(d or m, 2.0) for d, m in zip(dtypes, model, strict=True)])
        return f.num("total_params", 1e9) * per
    return f.derived("weight_bytes", compute)


def concurrency_per_engine(f: Features) -> np.ndarray:
    """Sequences one engine decodes at once: its setting, capped by KV-cache capacity on a GPU.

    Where trials run in sandboxes (a job that sets ``sandbox_pool_size``, other than math), a trial
    holds its sandbox from setup to teardown, model turns included: no more trials than the pool's
    slots generate at once, so an engine sees at most its share of the slots.
    """
    def compute(f: Features) -> np.ndarray:
        on_gpu = f.num("gpus", 0.0) > 0
        default = np.where(on_gpu, DEFAULT_GPU_CONCURRENCY, 16.0)
        stated = f.num("engine_max_concurrency", 0.0)
        wanted = np.maximum(np.where(stated > 0, stated, default), 1.0)
        slots = f.num("sandbox_pool_size", math.inf) * np.maximum(f.num("sandbox_hosts", 1.0), 1.0) / engines(f)
        wanted = np.where(sandboxed(f) > 0, np.minimum(wanted, np.maximum(slots, 1.0)), wanted)
        memory = gpu_memory(f)
        share = np.minimum(np.maximum(f.num("engine_memory_fraction", 0.9), 0.05), 1.0)
        free = np.maximum(memory * engine_tp(f) * share - weight_bytes(f), 0.05 * memory * engine_tp(f))
        capacity = free / np.maximum(kv_bytes_per_token(f) * sequence_tokens(f), 1.0)
        return np.where(memory > 0, np.maximum(np.minimum(wanted, capacity), 1.0), wanted)
    return f.derived("concurrency_per_engine", compute)


def decode_steps(f: Features, fill: float | np.ndarray, rounds: float | np.ndarray = 1.0) -> np.ndarray:
    """Decode iterations of the busiest engine: whole waves (static) or refilled slots (continuous).

    ``rounds``: batches' worth of samples generated together (a generation batch of several
    optimizer steps' samples).
    """
    per_engine = samples(f) * rounds / engines(f)
    waves = per_engine / concurrency_per_engine(f)
    static = f.equals("engine_batching", "static", "continuous")
    continuous_waves = np.maximum(1.0, waves * fill)
    return gen_len(f) * (static * np.ceil(np.maximum(waves, 1.0)) + (1 - static) * continuous_waves)


def _setup_per_trial(f: Features, c: dict[str, float]) -> np.ndarray:
    """A trial's image set-up: a build, or a copy of the task's pre-built image."""
    return c["sandbox_build_s"] * (1.0 - (1.0 - c["prebuilt_factor"]) * f.flag("prebuilt_image", False))


def _exec_per_trial(f: Features, c: dict[str, float]) -> np.ndarray:
    """A trial's commands: one round per model turn."""
    return c["sandbox_exec_s"] * turns(f)


# Measured counts a theory quantity predicts directly: the fit matches them where a case has them, which pins
# coefficients the times alone cannot (how much continuous batching refills freed slots).
COUNT_COLUMNS: dict[str, Callable[[Features, dict[str, float]], np.ndarray]] = {
    # forward steps of all engines per optimizer step (a generation round's, shared by the steps it feeds)
    "engine_decode_steps": lambda f, c: decode_steps(f, c["continuous_fill"], generation_rounds(f)) * engines(f)
    / generation_cadence(f),
    "sandbox_setup_s": _setup_per_trial,  # mean image set-up of a trial
    "sandbox_exec_s": _exec_per_trial,  # mean run time of a trial's commands
}
COUNT_COEFFICIENTS = {"engine_decode_steps": ("continuous_fill",), "sandbox_setup_s": ("sandbox_build_s", "prebuilt_factor"),
                      "sandbox_exec_s": ("sandbox_exec_s",)}  # the coefficients each count column pins


def pinned_coefficients(cases: Sequence[CaseRecord]) -> set[str]:
    """Coefficients a measured column of their own identifies, whatever settings the cases ran.

    A term with a ``column`` (the old-logprob pass) is timed on its own, and a count column (decode
    steps) measures what continuous batching refills: once some case measured the column, the fit
    knows these coefficients from that case alone, so they need no change of the setting to be known.
    Likewise a mode's overlap factors, once some case ran in that mode.
    """
    present = {name for c in cases if c.usable for name, v in c.measured.items() if _number(v)}
    out = {coef for term in TERMS if term.column in present for coef in term.priors}
    out |= {coef for col, coefs in COUNT_COEFFICIENTS.items() if col in present for coef in coefs}
    # An RL mode's overlap factors are measured by the runs in that mode, whatever else they ran: a micro-batch
    # no case ran is priced by the priors, but the cores it shares with the rollout stay as contended as measured.
    modes = {c.rl_mode for c in cases if c.usable}
    out |= {f"overlap_{mode}_{stage}" for mode in OVERLAP_MODES if mode in modes for stage in OVERLAPPED_STAGES}
    return out


def with_pinned(base: TheoryModel, fitted: TheoryModel, pinned: set[str]) -> TheoryModel:
    """``base`` (the priors) with the fitted values of the ``pinned`` coefficients, per device class and job."""
    classes = {cls: {**base.coefficients.get(cls, {}), **{k: v for k, v in coeffs.items() if k in pinned}}
               for cls, coeffs in fitted.coefficients.items()}
    jobs = {key: {k: v for k, v in coeffs.items() if k in pinned} for key, coeffs in fitted.job_coefficients.items()}
    return TheoryModel({**base.coefficients, **classes}, dict(base.fitted_on), {**base.job_coefficients, **jobs})


def batch_per_step(f: Features) -> np.ndarray:
    return np.minimum(concurrency_per_engine(f), samples(f) / engines(f))


def train_tokens(f: Features) -> np.ndarray:
    """Tokens one step trains: as the source states it, else samples x their mean length (measured or the theory's)."""
    return f.derived("train_tokens", lambda f: np.where(f.num("tokens_per_step", 0.0) > 0, f.num("tokens_per_step", 0.0),
                                                        samples(f) * sequence_tokens(f)))


# ---- the term registry ---------------------------------------------------------------------------

@dataclass
class Term:
    """One additive contribution to a stage's time."""

    stage: str
    name: str
    reads: tuple[str, ...]
    priors: dict[str, tuple[float, float]]  # coefficient -> (cpu prior, gpu prior)
    compute: Callable[[Features, dict[str, float]], np.ndarray]
    doc: str = ""
    column: str | None = None  # a measured column that times this term alone; the fit matches it where a case has it


TERMS: list[Term] = []


def register_term(stage: str, name: str, reads: Sequence[str], priors: dict[str, tuple[float, float]],
                  compute: Callable[[Features, dict[str, float]], np.ndarray], doc: str = "", column: str | None = None) -> Term:
    """Add a term for an effect the formulas miss (e.g. a CPU copy profiling found).

    ``column``: a stage-table column that times this term on its own (``old_logprob_s``); where a
    case measured it, the fit matches the term to it, which pins the term's coefficients apart from
    the rest of its stage.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    if any(t.name == name and t.stage == stage for t in TERMS):
        raise ValueError(f"a {stage} term named {name!r} is already registered")
    term = Term(stage, name, tuple(reads), dict(priors), compute, doc, column)
    TERMS.append(term)
    return term


def attention_flops(f: Features) -> np.ndarray:
    """FLOPs of attention over the sequence in one step: 6 x layers x hidden x sequence per token (the causal half
    of QK^T and AV, forward and backward) -- what grows faster than the tokens as sequences lengthen."""
    return f.derived("attention_flops", lambda f: train_tokens(f) * 6.0 * width_depth(f) * sequence_tokens(f))


def training_flops(f: Features) -> np.ndarray:
    """FLOPs of one step's forward and backward passes: 6 x active x tokens, plus attention (:func:`attention_flops`)."""
    return f.derived("training_flops", lambda f: train_tokens(f) * 6.0 * active_params(f) + attention_flops(f))


def _training_compute(f: Features, c: dict[str, float]) -> np.ndarray:
    padding = 1.0 + c["padding_overhead"] * (1.0 - f.flag("packing", False))
    ac = f.text("activation_checkpointing", "none")
    full = np.maximum(f.flag("grad_checkpointing", False), np.asarray([1.0 if a == "full" else 0.0 for a in ac]))
    checkpoint = 1.0 + c["checkpoint_overhead"] * full + c["selective_overhead"] * np.asarray([a == "selective" for a in ac], dtype=float) \
        + c["offload_overhead"] * np.asarray([a == "offload" for a in ac], dtype=float)
    # LoRA trains adapters only: the backward pass skips the weight gradients of the frozen weights
    lora = 1.0 - (1.0 - c["lora_factor"]) * (f.num("lora_rank", 0.0) > 0)
    fp8 = 1.0 - (1.0 - c["fp8_train_factor"]) * f.equals("train_dtype", "fp8", "bf16")
    speed = trainer_devices(f) * flops_ratio(f) * gpu_speed(f, c)
    # attention kernels run at their own share of the datasheet (FlashAttention-3 about 1.5-2x FlashAttention-2 on Hopper)
    fa3 = np.asarray([k == "flash_attention_3" for k in f.text("attention_kernel", "")], dtype=float)
    attention = attention_flops(f) * c["attention_factor"] * (1.0 - (1.0 - c["fa3_attention_factor"]) * fa3)
    flops = train_tokens(f) * 6.0 * active_params(f) + attention
    return c["s_per_train_flop"] * flops * padding * checkpoint * lora * fp8 / speed


def _training_layout(f: Features, c: dict[str, float]) -> np.ndarray:
    """What splitting the trainer over GPUs adds to its compute: tensor/context-parallel collectives on every layer
    (dearer once they leave the scale-up domain), the pipeline's idle share, and for a mixture of experts its routing
    and expert-parallel all-to-all. Zero on one GPU with a dense model."""
    tp, pp, cp, ep, dp = trainer_layout(f)
    compute = _training_compute(f, c)
    group = tp * cp
    collective = c["tp_comm"] * np.log2(group) * (1.0 + c["inter_node_comm"] * (group > scale_up_domain(f)))
    experts = moe(f) * (c["moe_overhead"] + c["ep_comm"] * np.log2(ep))
    return compute * (collective + c["pipeline_bubble_weight"] * pipeline_bubble(f) / (1.0 - pipeline_bubble(f)) + experts)


def _training_data_parallel(f: Features, c: dict[str, float]) -> np.ndarray:
    """The exposed part of the gradient reduce-scatter and parameter all-gather over data-parallel ranks (FSDP / ZeRO):
    2 x bf16 bytes of each rank's parameter shard, over the scale-up link or, past its domain, the network."""
    tp, pp, cp, ep, dp = trainer_layout(f)
    shard = 2.0 * 2.0 * f.num("total_params", 1e9) / (tp * pp)
    inside = trainer_devices(f) <= scale_up_domain(f)
    link = np.where(inside, _sheet(f, 4) * GPU_DATASHEET[REFERENCE_GPU][4], INTER_NODE_BYTES_PER_S)
    return (dp > 1) * c["dp_exposed"] * shard * (dp - 1.0) / dp / link


def _training_microbatches(f: Features, c: dict[str, float]) -> np.ndarray:
    _, pp, _, _, _ = trainer_layout(f)
    return c["s_per_micro_batch"] * (micro_batches_per_rank(f) + pp - 1.0)


def _old_logprob(f: Features, c: dict[str, float]) -> np.ndarray:
    separate = (1.0 - f.flag("reuse_rollout_logprobs", False)) * has_rollout(f)
    flops = 2.0 * active_params(f) * train_tokens(f)
    return separate * c["s_per_logprob_flop"] * flops / (trainer_devices(f) * flops_ratio(f) * gpu_speed(f, c))


def run_ahead(f: Features) -> np.ndarray:
    """Batches the engines generate at once: 1, but in fully async mode up to the sample-age cap + 1.

    Fully async rollout runs ahead of training by up to ``max_sample_age`` weight versions, so
    while a batch trains the engines already generate the next ones -- as many as their slots hold
    (engines x concurrency / samples per batch), and no more than the cap allows.
    """
    def compute(f: Features) -> np.ndarray:
        fully = f.equals("rl_mode", "fully_async", "sync")
        cap = np.maximum(f.num("max_sample_age", 1.0), 0.0) + 1.0
        room = engines(f) * concurrency_per_engine(f) / samples(f)
        return 1.0 + fully * (np.maximum(np.minimum(cap, room), 1.0) - 1.0)
    return f.derived("run_ahead", compute)


def generation_rounds(f: Features) -> np.ndarray:
    """Optimizer steps' samples one generation round makes (``generation_batch_size`` / samples per step, at least 1)."""
    return f.derived("generation_rounds", lambda f: np.maximum(f.num("generation_batch_size", 0.0) / samples(f), 1.0))


def generation_cadence(f: Features) -> np.ndarray:
    """Optimizer steps one generation round feeds: its steps' worth of samples times the steps trained on
    each batch (``batch_reuse``). Rollout happens once per that many steps; a step carries that share."""
    return generation_rounds(f) * np.maximum(f.num("batch_reuse", 1.0), 1.0)


def _decode(f: Features, c: dict[str, float]) -> np.ndarray:
    """Decode time per batch; with rollout running ahead, ``run_ahead`` batches share each decode step,
    so one batch costs their joint time over their number -- to the power of a fitted efficiency,
    since engines on one device (or on a CPU's cores) slow each other."""
    ahead = run_ahead(f)
    tp = engine_tp(f)
    # an engine split over GPUs all-reduces on every layer of every decode step: dearer past the scale-up domain
    collective = c["s_per_engine_allreduce"] * np.log2(tp) * (1.0 + c["inter_node_comm"] * (tp > scale_up_domain(f)))
    overhead = c["s_per_decode_step"] * (1.0 - (1.0 - c["compile_factor"]) * f.flag("engine_compile", False)) + collective
    rounds = generation_rounds(f)
    batch = np.minimum(concurrency_per_engine(f), ahead * rounds * samples(f) / engines(f))
    # each decode step reads the weights and, on a GPU, the key/value cache of the sequences in flight
    on_gpu = (f.num("gpus", 0.0) > 0).astype(float)
    cache = on_gpu * batch * 0.5 * sequence_tokens(f) * kv_bytes_per_token(f)
    speed = gpu_speed(f, c)
    weights = c["s_per_weight_byte"] * (weight_bytes(f) + cache) / (tp * hbm_ratio(f) * speed)
    compute = c["s_per_decode_flop"] * 2.0 * active_params(f) * batch / (tp * flops_ratio(f, "weight_dtype") * speed)
    per_round = decode_steps(f, c["continuous_fill"], rounds) * (overhead + weights + compute) / ahead ** c["run_ahead_efficiency"]
    return has_rollout(f) * per_round * engines_sharing_cores(f, c) / generation_cadence(f)


def engines_sharing_cores(f: Features, c: dict[str, float]) -> np.ndarray:
    """Factor on the busiest engine's decode where all engines run on one host's cores (a job without GPUs).

    Splitting the batch over engines shortens each engine's share only where each has its own
    device. Engines on the same cores take turns on them: ``engines ** engine_core_sharing``, whose
    prior 1 says a second engine gains nothing (half the sequences each, at half the cores); the fit
    learns from runs with several engines whether processes overlapping their Python overhead gain
    a little (< 1) or their contention costs (> 1).
    """
    shared = f.num("gpus", 0.0) <= 0
    return np.where(shared, engines(f) ** c["engine_core_sharing"], 1.0)


def sandbox_parallelism(f: Features, cores_per_host: float) -> np.ndarray:
    """Sandboxes that really run at once: the pool, but no more than the hosts' cores can run.

    A sandbox is CPU work; past one per core, more slots only queue for the same cores (on a
    CPU-only job they also compete with the engine and the trainer). A soft minimum
    (``(pool^-k + cores^-k)^(-1/k)``) keeps the fit smooth where the pool nears the core count.
    """
    hosts = np.maximum(f.num("sandbox_hosts", 1.0), 1.0)
    pool = np.maximum(f.num("sandbox_pool_size", 8.0) * hosts, 1.0)
    cores = np.maximum(cores_per_host * hosts, 1e-3)
    k = SANDBOX_SOFT_MIN_POWER
    return (pool ** -k + cores ** -k) ** (-1.0 / k)


def _sandbox(f: Features, c: dict[str, float]) -> np.ndarray:
    tool = sandboxed(f)
    per_trial = _setup_per_trial(f, c) + _exec_per_trial(f, c)
    return tool * per_trial * samples(f) / sandbox_parallelism(f, c["sandbox_cores"])


def _weight_sync(f: Features, c: dict[str, float]) -> np.ndarray:
    """Fixed cost + bytes / bandwidth per transport. The reference workload's transports (files, in-process copies,
    sparse deltas) serve the engines one after another; a collective broadcast (NCCL, the default of jobs that do not
    say) reaches every engine at once, each of its GPUs receiving its tensor-parallel shard."""
    fs = f.equals("sync_transport", "filesystem", "broadcast")
    inproc = f.equals("sync_transport", "inprocess", "broadcast")
    delta = f.equals("sync_transport", "sparse_delta", "broadcast")
    other = 1.0 - fs - inproc - delta
    per_byte = (fs * c["s_per_byte_filesystem"] + inproc * c["s_per_byte_inprocess"] + delta * c["s_per_byte_filesystem"] * c["delta_fraction"]) \
        * engines(f) + other * c["s_per_byte_broadcast"] * np.where(f.num("gpus", 0.0) > 1, 1.0, engines(f)) / engine_tp(f)
    fixed = fs * c["sync_fixed_filesystem_s"] + inproc * c["sync_fixed_inprocess_s"] + other * c["sync_fixed_broadcast_s"] \
        + delta * c["sync_fixed_delta_s"]
    return has_rollout(f) * (fixed + per_byte * weight_bytes(f))


def _colocation_handover(f: Features, c: dict[str, float]) -> np.ndarray:
    """Where trainer and engines share GPUs (``colocated``), each step hands the GPUs over twice: the trainer's
    weights, gradients and optimizer state (16 bytes a parameter) leave for host memory and come back."""
    state = 16.0 * f.num("total_params", 1e9) / trainer_devices(f)
    return has_rollout(f) * f.flag("colocated", False) * c["s_per_handover_byte"] * state


def _routing_replay(f: Features, c: dict[str, float]) -> np.ndarray:
    return f.flag("routing_replay", False) * c["s_per_routing_token"] * train_tokens(f) * f.num("layers", 32.0) / trainer_devices(f)


GPU_SPEED_PRIORS = {f"gpu_speed_{name}": (1.0, 1.0) for name in GPU_DATASHEET}
TRAINING_READS = ("batch", "answer_cap_tokens", "context_limit_tokens", "active_params", "total_params", "gpus", "trainer_gpus",
                  "device", "sequence_tokens", "tokens_per_step", "workload")
register_term("training", "compute", (*TRAINING_READS, "packing", "grad_checkpointing", "activation_checkpointing", "lora_rank",
                                      "train_dtype", "attention_kernel"),
              {"s_per_train_flop": (3e-11, 3e-15), "padding_overhead": (0.3, 0.3), "checkpoint_overhead": (0.33, 0.33),
               "selective_overhead": (0.1, 0.1), "offload_overhead": (0.15, 0.15), "lora_factor": (0.7, 0.7),
               "fp8_train_factor": (0.75, 0.75), "attention_factor": (1.0, 1.0), "fa3_attention_factor": (0.6, 0.6), **GPU_SPEED_PRIORS},
              _training_compute, "(6 x active + attention) x tokens / (trainer GPUs x datasheet FLOP/s), with padding, recompute, LoRA, fp8")
register_term("training", "layout", (*TRAINING_READS, "trainer_tp", "trainer_pp", "trainer_cp", "trainer_ep", "micro_batch_size",
                                     "train_batch_samples"),
              {"tp_comm": (0.1, 0.1), "inter_node_comm": (2.0, 2.0), "pipeline_bubble_weight": (1.0, 1.0), "moe_overhead": (0.5, 0.5),
               "ep_comm": (0.1, 0.1)},
              _training_layout, "tensor/context-parallel collectives, the pipeline bubble, MoE routing and all-to-all")
register_term("training", "data_parallel", ("total_params", "gpus", "trainer_gpus", "device", "trainer_tp", "trainer_pp", "trainer_cp"),
              {"dp_exposed": (0.3, 0.3)}, _training_data_parallel, "exposed gradient reduce-scatter + parameter all-gather")
register_term("training", "micro_batches", ("micro_batch_size", "micro_batches", "batch", "trainer_gpus", "trainer_tp", "trainer_pp",
                                            "trainer_cp"),
              {"s_per_micro_batch": (0.01, 0.05)}, _training_microbatches, "fixed cost per micro-batch, and per pipeline stage")
register_term("training", "old_logprob_pass", ("reuse_rollout_logprobs", "batch", "active_params", "device", "workload"),
              {"s_per_logprob_flop": (3e-11, 3e-15)}, _old_logprob, "separate forward pass for old log-probs", column="old_logprob_s")
register_term("training", "fixed", (), {"training_fixed_s": (0.02, 1.0)}, lambda f, c: np.full(f.n, c["training_fixed_s"]))
register_term("rollout", "decode", ("batch", "answer_cap_tokens", "context_limit_tokens", "engine_max_concurrency", "num_engines",
                                    "gpus", "engine_batching", "engine_compile", "engine_tp", "kv_cache_dtype", "weight_dtype", "total_params",
                                    "active_params", "workload", "device", "sandbox_pool_size", "sandbox_hosts",
                                    "max_sample_age", "generation_batch_size", "batch_reuse", "rollout_gpus", "sequence_tokens",
                                    "engine_memory_fraction"),
              # CPU: small-batch decode in eager kernels runs at a few GFLOP/s, an order of magnitude below the dense
              # matmuls of training, so each sequence in the batch adds a real share to a decode step.
              # compile_factor on a GPU: CUDA graphs cut the H200 small job's rollout 8.4 -> 0.9 s a step
              # (bench/results/graph-decode-h200-*/); on a CPU torch.compile saves less of a step's fixed cost.
              {"s_per_decode_step": (2e-3, 0.01), "compile_factor": (0.7, 0.15), "s_per_weight_byte": (1e-10, 2.5e-13),
               "s_per_decode_flop": (3e-10, 3e-15), "continuous_fill": (0.7, 0.7), "run_ahead_efficiency": (0.5, 1.0),
               "engine_core_sharing": (1.0, 1.0), "s_per_engine_allreduce": (1e-4, 1e-4), "inter_node_comm": (2.0, 2.0),
               **GPU_SPEED_PRIORS},
              _decode, "decode steps over the longest trial per wave x cost of one step, over the batches generated at once")
register_term("rollout", "sandbox", ("workload", "sandbox_pool_size", "sandbox_hosts", "prebuilt_image", "batch"),
              {"sandbox_build_s": (0.5, 120.0), "prebuilt_factor": (0.2, 0.2), "sandbox_exec_s": (0.05, 5.0), "sandbox_cores": (2.0, 64.0),
               "sandbox_overlap": (0.5, 0.5)},
              _sandbox, "sandbox setup and execution per trial, over the pool, capped by the cores that run it")
register_term("rollout", "fixed", ("workload",), {"rollout_fixed_s": (0.02, 1.0)}, lambda f, c: has_rollout(f) * c["rollout_fixed_s"])
register_term("weight_sync", "transfer", ("sync_transport", "total_params", "weight_dtype", "num_engines", "engine_tp", "rollout_gpus",
                                          "gpus", "workload"),
              {"s_per_byte_filesystem": (1e-9, 1e-9), "s_per_byte_inprocess": (2e-10, 1e-10), "s_per_byte_broadcast": (2e-10, 2e-11),
               "delta_fraction": (0.1, 0.1), "sync_fixed_filesystem_s": (0.02, 1.0), "sync_fixed_inprocess_s": (0.005, 0.5),
               "sync_fixed_broadcast_s": (0.01, 0.5), "sync_fixed_delta_s": (0.02, 1.0)},
              _weight_sync, "fixed cost + bytes / bandwidth per transport")
register_term("weight_sync", "colocation_handover", ("colocated", "total_params", "gpus", "trainer_gpus"),
              {"s_per_handover_byte": (4e-11, 4e-11)}, _colocation_handover,
              "trainer state to host memory and back where trainer and engines share GPUs")
register_term("training", "routing_replay_copy", ("routing_replay",), {"s_per_routing_token": (1e-9, 2e-10)}, _routing_replay,
              "CPU copy of rollout routing data per token and layer (the seed's routing-replay cost)")


# ---- stages that share devices -------------------------------------------------------------------

OVERLAPPED_STAGES = ("rollout", "training")
OVERLAP_MODES = ("one_step_async", "fully_async")
PARTNER = {"rollout": "training", "training": "rollout"}
# (cpu prior, gpu prior) of the factor on the part of a stage that overlaps the other. The prior is the
# RL-mode rule's own assumption, free overlap; runs in that mode teach the fit how far shared cores stretch it.
OVERLAP_PRIORS = {f"overlap_{mode}_{stage}": (1.0, 1.0) for mode in OVERLAP_MODES for stage in OVERLAPPED_STAGES}


def overlap_slowdown(f: Features, c: dict[str, float], stage: str, own: dict[str, np.ndarray]) -> np.ndarray:
    """Factor on a stage's time for the RL mode: 1 in sync mode; where stages overlap, the fitted contention.

    ``own`` holds each stage's seconds as the terms price it alone (sync mode). The RL-mode rule
    assumes rollout and training overlap for free. Where they share devices (the reference workload
    on a CPU runs both on the same cores) a stage runs slower for as long as the other runs beside
    it: the overlapped part, ``min(own stage, own partner)``, is stretched by the mode's fitted
    ``overlap_<mode>_<stage>``, the rest runs at its own speed. So a cheaper trainer step shortens
    the overlapped rollout too, and a stage far longer than its partner is stretched only by the
    partner's share. The fit learns the factors from runs in each mode, so one mode's stage times
    can be moved to another's and no async run distorts the coefficients of the work itself.
    """
    if stage not in OVERLAPPED_STAGES:
        return np.ones(f.n)
    alone = own[stage]
    overlapped = np.divide(np.minimum(alone, own[PARTNER[stage]]), alone, out=np.zeros(f.n), where=alone > 0)
    overlapped = overlapped * shares_devices(f)
    factor = np.ones(f.n)
    for mode in OVERLAP_MODES:
        factor = factor + f.equals("rl_mode", mode, "sync") * (c[f"overlap_{mode}_{stage}"] - 1.0) * overlapped
    return factor


def shares_devices(f: Features) -> np.ndarray:
    """1 where rollout and training run on the same devices (a CPU's cores, one GPU, or GPUs the job says the trainer
    and engines share), 0 where the job gives each its own GPUs: there the overlapped stages do not slow each other."""
    def compute(f: Features) -> np.ndarray:
        gpus = f.num("gpus", 0.0)
        separate = np.asarray([s.get("colocated") is False for s in f._settings], dtype=bool) & (gpus > 1)
        return np.where(separate, 0.0, 1.0)
    return f.derived("shares_devices", compute)


def device_class(device: str) -> str:
    return "cpu" if device.lower() == "cpu" else "gpu"


def prior_coefficients(device: str) -> dict[str, float]:
    column = 0 if device_class(device) == "cpu" else 1
    out = {name: prior[column] for term in TERMS for name, prior in term.priors.items()}
    out.update({name: prior[column] for name, prior in OVERLAP_PRIORS.items()})
    return out


def modelled_settings() -> set[str]:
    """Settings at least one term reads: the ones theory can estimate a change of."""
    return {name for term in TERMS for name in term.reads}


def stages_reading() -> dict[str, set[str]]:
    """Modelled setting -> the stages whose terms read it (``rl_mode`` reads none: it recombines them all)."""
    out: dict[str, set[str]] = {}
    for term in TERMS:
        for name in term.reads:
            out.setdefault(name, set()).add(term.stage)
    return out


@dataclass
class TheoryModel:
    """Coefficients per device class ('cpu' / 'gpu'), and per job where :meth:`fit` gave a job its own; missing ones use the priors."""

    coefficients: dict[str, dict[str, float]] = field(default_factory=dict)
    fitted_on: dict[str, int] = field(default_factory=dict)
    job_coefficients: dict[str, dict[str, float]] = field(default_factory=dict)  # job_key -> that job's fitted set

    def coefficients_for(self, device: str, job: str | None = None) -> dict[str, float]:
        out = {**prior_coefficients(device), **self.coefficients.get(device_class(device), {})}
        if job is not None and job in self.job_coefficients:
            out.update(self.job_coefficients[job])
        return out

    def stages_many(self, setups: Sequence[Setup]) -> dict[str, np.ndarray]:
        """Theory seconds per stage for many setups (grouped by device class and, where it has its own coefficients, job)."""
        out = {stage: np.zeros(len(setups)) for stage in STAGES}
        groups: dict[tuple[str, str | None], list[int]] = {}
        for i, s in enumerate(setups):
            key = job_key(s) if self.job_coefficients else None
            groups.setdefault((device_class(s.device), key if key in self.job_coefficients else None), []).append(i)
        for (cls, key), idx in groups.items():
            f = Features([setups[i] for i in idx])
            coeffs = self.coefficients_for("cpu" if cls == "cpu" else "gpu", key)
            for stage, values in _stage_sums(f, coeffs).items():
                out[stage][idx] = values
        return out

    def stages(self, setup: Setup) -> dict[str, float]:
        many = self.stages_many([setup])
        return {stage: float(values[0]) for stage, values in many.items()}

    def ratio(self, target: Setup, case: Setup) -> dict[str, float]:
        """theory(target) / theory(case) per stage: how the seed scales a case to the target."""
        both = self.stages_many([target, case])
        return {stage: float(v[0] / v[1]) if v[1] > 0 else 1.0 for stage, v in both.items()}

    def fit(self, cases: Sequence[CaseRecord], prior_weight: float = 0.1, *, setups: Sequence[Setup] | None = None) -> TheoryModel:
        """A new model with coefficients fitted to the ok cases (least squares on log-times).

        One fit per device class. Where the class holds several jobs (:func:`job_key`), each job
        with :data:`MIN_JOB_FIT_CASES` ok cases gets its own coefficients, the class's set times a
        per-job factor that costs :data:`JOB_PRIOR_WEIGHT` per unit of log: what a job's runs
        measured (a tool-use trainer's longer sequences) becomes its own, so it no longer bends the
        coefficients the other jobs share, and what its runs cannot tell apart (a micro-batch cost
        when the job never changed its micro-batch) stays where all jobs' runs put it. The class's
        set is pulled weakly towards the physical priors. Each case's residuals are weighted by how
        precisely it measured its stages (:func:`case_fit_weight`). ``setups`` (``setup_from_case``
        of each case, in order) saves rebuilding them when the caller has them.

        A public run (measured by another project, with its stages often unknown) enters the
        residuals with its step or whichever stages it published; a class holding public runs pulls
        harder towards the priors (:data:`PUBLIC_PRIOR_WEIGHT`).
        """
        fitted = TheoryModel(dict(self.coefficients), dict(self.fitted_on), dict(self.job_coefficients))
        groups: dict[str, list[tuple[CaseRecord, Setup]]] = {}
        for index, case in enumerate(cases):
            if case.usable:
                setup = setups[index] if setups is not None else setup_from_case(case)
                groups.setdefault(device_class(case.device), []).append((case, setup))
        for cls, pairs in groups.items():
            device = "cpu" if cls == "cpu" else "gpu"
            pairs = _spread_over_time(pairs)
            by_job: dict[str, list[int]] = {}
            for i, (_, setup) in enumerate(pairs):
                by_job.setdefault(job_key(setup), []).append(i)
            public = {key for key, rows in by_job.items() if any(pairs[i][0].public for i in rows)}
            own = [key for key, rows in by_job.items() if len(rows) >= MIN_JOB_FIT_CASES and key not in public] if len(by_job) > 1 else []
            target = prior_coefficients(device)
            start = self.coefficients_for(device)
            weight = max(prior_weight, PUBLIC_PRIOR_WEIGHT) if public else prior_weight
            pooled, per_job = _fit_jobs(pairs, by_job, own, start, target, weight,
                                        {key: self.job_coefficients[key] for key in own if key in self.job_coefficients})
            fitted.coefficients[cls] = pooled
            fitted.fitted_on[cls] = len(pairs)
            fitted.job_coefficients.update(per_job)
        return fitted


def job_key(setup: Setup) -> str:
    """The key of a setup's job (its identity) in :attr:`TheoryModel.job_coefficients`."""
    return json.dumps([None if v is None else (v if isinstance(v, (int, float)) else str(v)) for v in setup.identity()])


def median_error(case: CaseRecord) -> float:
    """Relative standard error of a case's step median: ``1.2533 x step spread / sqrt(measured steps)`` (0 if unknown).

    ``step_spread`` is the case's robust relative spread of its step times (``step_noise_frac``);
    1.2533 is the large-sample ratio of a median's standard error to a mean's.
    """
    frac = case.step_noise_frac
    if frac is None or not math.isfinite(frac) or frac <= 0:
        return 0.0
    return 1.2533 * frac / math.sqrt(max(int(case.measured_steps or 0), 1))


def case_fit_weight(case: CaseRecord) -> float:
    """Relative weight of a case's residuals in the fit: 1 for a precisely measured run, less for a noisy one.

    Every run carries the machine's run-to-run noise (:data:`FIT_RUN_NOISE`) plus the sampling
    error of its medians (:func:`median_error`); the weight is the run-to-run noise over the two
    together, so a run whose steps spread 50 % over three steps counts a fraction of a steady one.
    """
    se = median_error(case)
    return FIT_RUN_NOISE / math.sqrt(FIT_RUN_NOISE ** 2 + se ** 2)


def _spread_over_time(pairs: list[tuple[CaseRecord, Setup]]) -> list[tuple[CaseRecord, Setup]]:
    if len(pairs) <= MAX_FIT_CASES:
        return pairs
    step = len(pairs) / MAX_FIT_CASES  # an even spread over time bounds the cost on large libraries
    return [pairs[int(i * step)] for i in range(MAX_FIT_CASES)]


def _fit_jobs(pairs: list[tuple[CaseRecord, Setup]], by_job: dict[str, list[int]], own: list[str], start: dict[str, float],
              prior: dict[str, float], prior_weight: float, job_start: dict[str, dict[str, float]]
              ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Fit a class's coefficients and, for the jobs in ``own``, a log factor on each (see :meth:`TheoryModel.fit`).

    Parameters: the class's log coefficients, pulled towards ``prior`` by ``prior_weight``, then
    one offset vector per job of ``own``, pulled towards 0 by :data:`JOB_PRIOR_WEIGHT`. A job's
    coefficients are ``exp(class + offset)``, kept inside :data:`BOUNDS`.
    Returns (class coefficients, job_key -> that job's coefficients).
    """
    from scipy.optimize import least_squares

    names = _active_coefficients(pairs, start)
    fixed = {name: start[name] for name in start if name not in names}
    n = len(names)
    theta_prior = np.log([prior[name] for name in names])
    low = np.asarray([math.log(BOUNDS[name][0]) if name in BOUNDS else theta_prior[i] - math.log(FREE_RANGE) for i, name in enumerate(names)])
    high = np.asarray([math.log(BOUNDS[name][1]) if name in BOUNDS else theta_prior[i] + math.log(FREE_RANGE) for i, name in enumerate(names)])
    theta0 = np.clip(np.log([start[name] for name in names]), low + 1e-9, high - 1e-9)
    # Row groups: each job of `own` on its own, the rest of the cases together on the class's coefficients.
    shared = [i for key, rows in by_job.items() if key not in own for i in rows]
    blocks = [(key, by_job[key]) for key in own] + ([(None, shared)] if shared else [])
    columns = sorted({t.column for t in TERMS if t.column})
    prepared = []
    for key, rows in blocks:
        group = [pairs[i][0] for i in rows]
        f = Features([pairs[i][1] for i in rows])
        weight = np.asarray([case_fit_weight(c) for c in group])
        per_case = [known_stages(c) for c in group]
        # stage -> (rows of the cases that measured it, their log values); a public run publishes some stages or none
        measured = {stage: (np.asarray([i for i, m in enumerate(per_case) if m[stage] is not None], dtype=int),
                            np.log(np.asarray([m[stage] for m in per_case if m[stage] is not None], dtype=float) + EPS_S))
                    for stage in STAGES}
        # where a stage is unknown, the step the case measured is fitted by the RL-mode rule instead
        step_only = [(i, case_step(c)) for i, (c, m) in enumerate(zip(group, per_case, strict=True))
                     if any(m[stage] is None for stage in STAGES) and case_step(c) is not None]
        steps = (np.asarray([i for i, _ in step_only], dtype=int), np.log(np.asarray([v for _, v in step_only], dtype=float) + EPS_S))
        # column -> (rows of the cases that measured it, their log values)
        finer = {col: (np.asarray([i for i, c in enumerate(group) if _number(c.measured.get(col))], dtype=int),
                       np.log(np.asarray([float(c.measured[col]) for c in group if _number(c.measured.get(col))]) + EPS_S))
                 for col in columns}
        counts = {col: (np.asarray([i for i, c in enumerate(group) if _number(c.measured.get(col)) and c.measured[col] > 0], dtype=int),
                        np.log(np.asarray([float(c.measured[col]) for c in group if _number(c.measured.get(col)) and c.measured[col] > 0])))
                  for col in sorted(COUNT_COLUMNS)}
        size = sum(len(r) for r, _ in measured.values()) + len(steps[0]) + sum(len(r) for r, _ in finer.values()) \
            + sum(len(r) for r, _ in counts.values())
        prepared.append((key, f, weight, measured, steps, finer, counts, size))
    offset_of = {key: n * (1 + j) for j, key in enumerate(own)}

    def block_residuals(theta: np.ndarray, block: tuple) -> np.ndarray:
        _, f, weight, measured, steps, finer, counts, _ = block
        coeffs = {**fixed, **dict(zip(names, np.exp(np.clip(theta, low, high)), strict=True))}
        sums, factors = _with_overlap(f, coeffs, _own_stage_sums(f, coeffs))
        parts = [weight[rows] * (np.log(sums[s][rows] + EPS_S) - values) for s, (rows, values) in measured.items()]
        if len(steps[0]):
            parts.append(weight[steps[0]] * (np.log(combine_many(f, sums)[steps[0]] + EPS_S) - steps[1]))
        by_column = _column_terms(f, coeffs, factors)
        parts += [weight[rows] * (np.log(by_column[col][rows] + EPS_S) - values) for col, (rows, values) in finer.items()]
        parts += [weight[rows] * (np.log(np.maximum(COUNT_COLUMNS[col](f, coeffs)[rows], 1e-9)) - values)
                  for col, (rows, values) in counts.items() if len(rows)]
        return np.concatenate(parts)

    def thetas(x: np.ndarray) -> list[np.ndarray]:
        return [x[:n] if key is None else x[:n] + x[offset_of[key]:offset_of[key] + n] for key, *_ in prepared]

    def residuals(x: np.ndarray) -> np.ndarray:
        parts = [block_residuals(theta, block) for theta, block in zip(thetas(x), prepared, strict=True)]
        parts.append(prior_weight * (x[:n] - theta_prior))
        parts += [JOB_PRIOR_WEIGHT * x[offset_of[key]:offset_of[key] + n] for key in own]
        return np.concatenate(parts)

    def jacobian(x: np.ndarray) -> np.ndarray:
        # A block's rows depend on its log coefficients (class + offset) only, and equally on both parts: one
        # forward difference per coefficient and block gives both columns, as cheap as a fit without jobs.
        out = np.zeros((rows_total, n * (1 + len(own))))
        row = 0
        for theta, block in zip(thetas(x), prepared, strict=True):
            size = block[-1]
            r0 = block_residuals(theta, block)
            part = np.empty((size, n))
            for i in range(n):
                h = 1e-6 * max(1.0, abs(theta[i]))
                moved = theta.copy()
                moved[i] += h
                part[:, i] = (block_residuals(moved, block) - r0) / h
            out[row:row + size, :n] = part
            if block[0] is not None:
                out[row:row + size, offset_of[block[0]]:offset_of[block[0]] + n] = part
            row += size
        out[row:row + n, :n] = prior_weight * np.eye(n)
        for j, key in enumerate(own):
            out[row + n * (1 + j):row + n * (2 + j), offset_of[key]:offset_of[key] + n] = JOB_PRIOR_WEIGHT * np.eye(n)
        return out

    rows_total = sum(b[-1] for b in prepared) + n * (1 + len(own))
    x0 = np.concatenate([theta0, *[np.log([job_start.get(key, {}).get(name, start[name]) for name in names]) - theta0 for key in own]])
    x_low = np.concatenate([low, *[np.full(n, -np.inf) for _ in own]])
    x_high = np.concatenate([high, *[np.full(n, np.inf) for _ in own]])
    result = least_squares(residuals, x0, jac=jacobian, bounds=(x_low, x_high), method="trf", tr_solver="lsmr", x_scale=1.0,
                           max_nfev=50 * n)
    out = [{**fixed, **dict(zip(names, (float(v) for v in np.exp(np.clip(theta, low, high))), strict=True))} for theta in thetas(result.x)]
    per_job = {block[0]: coeffs for block, coeffs in zip(prepared, out, strict=True) if block[0] is not None}
    return {**fixed, **dict(zip(names, (float(v) for v in np.exp(result.x[:n])), strict=True))}, per_job


def _active_coefficients(pairs: list[tuple[CaseRecord, Setup]], start: dict[str, float]) -> list[str]:
    """The coefficients that move some case's theory: the fit leaves the rest where they start (a GPU type no case
    ran, the sandbox of a library of math runs), which keeps its cost to what the cases can tell."""
    f = Features([setup for _, setup in pairs])
    base = _own_stage_sums(f, start)
    active = []
    for name in sorted(start):
        moved = _own_stage_sums(f, {**start, name: start[name] * 1.01})
        changed = any(np.any(moved[s] != base[s]) for s in STAGES)
        if not changed:
            changed = any(np.any(col(f, {**start, name: start[name] * 1.01}) != col(f, start)) for col in COUNT_COLUMNS.values()) \
                or name.startswith("overlap_") or any(t.column and name in t.priors for t in TERMS)
        if changed:
            active.append(name)
    return active


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def measured_stages(case: CaseRecord) -> dict[str, float]:
    """A case's stage times as the forecast uses them.

    'training' is the trainer's whole time per step: ``training_s`` plus ``old_logprob_s`` when the
    source timed the separate old-logprob pass on its own (the reference workload does), because
    that pass runs on the trainer and the RL-mode rule must see it there.

    In fully async mode rollout overlaps the step: what it costs the step is its generation time
    per batch, never more than the step (a batch's groups may have started several steps before
    and run while earlier batches trained), so the rollout is the smaller of ``rollout_s`` and
    ``step_s`` there.
    """
    m = case.measured
    rollout = float(m.get("rollout_s", 0.0))
    if case.rl_mode == "fully_async" and _number(m.get("step_s")):
        rollout = min(rollout, float(m["step_s"]))
    return {
        "rollout": rollout,
        "training": float(m.get("training_s", 0.0)) + float(m.get("old_logprob_s", 0.0) or 0.0),
        "weight_sync": float(m.get("weight_sync_s", 0.0)),
    }


def known_stages(case: CaseRecord) -> dict[str, float | None]:
    """The stage times a case measured, None for a stage its source did not publish.

    A run rltune recorded measured all three (:func:`measured_stages`). An imported public run
    (``origin: public``) has what its source published: a trainer benchmark (workload
    ``trainer_only``) has no rollout and no weight sync (0 s each), and its training is the step
    where only the step is published, or ``tokens_per_step`` over its throughput where only that is
    (torchtitan publishes tokens/s/GPU alone).
    """
    if not case.public:
        return dict(measured_stages(case))
    m = case.measured
    out: dict[str, float | None] = {stage: (float(m[column]) if _number(m.get(column)) else None) for stage, column in STAGE_COLUMN.items()}
    if case.workload == TRAINER_ONLY_WORKLOAD:
        out["rollout"], out["weight_sync"] = 0.0, 0.0
        if out["training"] is None:
            out["training"] = float(m["step_s"]) if _number(m.get("step_s")) else throughput_seconds(case)
    elif case.rl_mode == "fully_async" and out["rollout"] is not None and _number(m.get("step_s")):
        out["rollout"] = min(out["rollout"], float(m["step_s"]))
    return out


def throughput_seconds(case: CaseRecord) -> float | None:
    """Seconds of one step from a published throughput: tokens_per_step / (tokens/s per GPU x GPUs, or tokens/s of all)."""
    tokens = case.facts.get("tokens_per_step")
    m = case.measured
    if not _number(tokens) or tokens <= 0:
        return None
    if _number(m.get("tokens_per_s_per_gpu")) and m["tokens_per_s_per_gpu"] > 0 and case.gpus > 0:
        return float(tokens) / (float(m["tokens_per_s_per_gpu"]) * case.gpus)
    if _number(m.get("tokens_per_s_all_gpus")) and m["tokens_per_s_all_gpus"] > 0:
        return float(tokens) / float(m["tokens_per_s_all_gpus"])
    return None


def case_step(case: CaseRecord) -> float | None:
    """The step time a case measured; a trainer benchmark's step is its training; None where neither is known."""
    if _number(case.measured.get("step_s")) and case.measured["step_s"] > 0:
        return float(case.measured["step_s"])
    if case.public and case.workload == TRAINER_ONLY_WORKLOAD:
        return known_stages(case)["training"]
    return None


def combine_many(f: Features, sums: dict[str, np.ndarray]) -> np.ndarray:
    """:func:`rltune.steps.combine` for many setups at once: each one's stages under its RL mode."""
    r, t, w = sums["rollout"], sums["training"], sums["weight_sync"]
    one_step = f.equals("rl_mode", "one_step_async", "sync")
    fully = f.equals("rl_mode", "fully_async", "sync")
    sync = 1.0 - one_step - fully
    return sync * (r + t + w) + one_step * (np.maximum(r, t) + w) + fully * np.maximum(r, t + w)


def _own_stage_sums(f: Features, coeffs: dict[str, float]) -> dict[str, np.ndarray]:
    """Each stage's seconds as its terms price it alone, before the RL mode's overlap."""
    sums = {stage: np.zeros(f.n) for stage in STAGES}
    decode = sandbox = None
    for term in TERMS:
        values = term.compute(f, coeffs)
        sums[term.stage] = sums[term.stage] + values
        if term.stage == "rollout" and term.name == "decode":
            decode = values
        elif term.stage == "rollout" and term.name == "sandbox":
            sandbox = values
    if decode is not None and sandbox is not None:
        # trials in sandboxes are in different phases at once: while some run tools, the engine decodes
        # the others' turns, so part of the shorter of the two hides under the longer
        sums["rollout"] = sums["rollout"] - coeffs["sandbox_overlap"] * np.minimum(decode, sandbox)
    return sums


def _stage_sums(f: Features, coeffs: dict[str, float]) -> dict[str, np.ndarray]:
    return _with_overlap(f, coeffs, _own_stage_sums(f, coeffs))[0]


def _with_overlap(f: Features, coeffs: dict[str, float], own: dict[str, np.ndarray]
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(stage seconds under the RL mode, the factor each stage's own seconds took)."""
    factors = {stage: overlap_slowdown(f, coeffs, stage, own) for stage in STAGES}
    return {stage: own[stage] * factors[stage] for stage in STAGES}, factors


def _column_terms(f: Features, coeffs: dict[str, float], factors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Seconds of each term that a measured column times on its own, column -> values (its stage's RL-mode factor applied)."""
    out: dict[str, np.ndarray] = {}
    for term in TERMS:
        if term.column:
            values = term.compute(f, coeffs) * factors[term.stage]
            out[term.column] = out.get(term.column, 0.0) + values
    return out


def systematic_miss(cases: Sequence[CaseRecord], *, last: int = 10, min_bias: float = 0.05, share: float = 0.7) -> dict[str, float]:
    """Stages whose stored forecasts missed in one direction: stage -> median log(measured/forecast).

    Looks at the ``last`` ok cases that carry a forecast; a stage is reported when the median miss
    exceeds ``min_bias`` and at least ``share`` of the misses have its sign -- a systematic miss,
    the cue to refit the coefficients or add a term.
    """
    with_forecast = [c for c in cases if c.usable and c.forecast][-last:]
    out: dict[str, float] = {}
    for stage in STAGES:
        column = STAGE_COLUMN[stage]
        misses = [math.log((c.measured[column] + EPS_S) / (c.forecast[column] + EPS_S))
                  for c in with_forecast if c.forecast.get(column) is not None and column in c.measured]
        if len(misses) < 3:
            continue
        median = float(np.median(misses))
        same_sign = sum(1 for m in misses if m * median > 0) / len(misses)
        if abs(median) > min_bias and same_sign >= share:
            out[stage] = median
    return out


__all__ = ["COUNT_COLUMNS", "GPU_DATASHEET", "STAGES", "TERMS", "Features", "Term", "TheoryModel", "case_fit_weight", "case_step",
           "combine_many", "device_class", "job_key", "known_stages", "throughput_seconds",
           "median_error", "modelled_settings", "pinned_coefficients", "prior_coefficients", "register_term", "stages_reading",
           "systematic_miss", "with_pinned"]
