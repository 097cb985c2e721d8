"""Detectors: each looks at the medians of one run and names a problem with its evidence, or nothing.

A detector's severity is the seconds per step the problem costs *now*: the stage time it wastes
(its "excess") run through the RL-mode rule (:func:`rltune.steps.combine`), so waste in a stage
that is not on the critical path costs 0 s today. The excess itself is kept in the evidence
(``stage_excess_s``) because the next bottleneck matters too: a candidate that fixes rollout
should also fix the trainer problem that will limit the step once rollout is faster.

Problem ids are stable; knowledge.yaml refers to them. Thresholds are named constants below,
each with the reason for its value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rltune.contracts.diagnosis import Problem
from rltune.steps import combine

# trainer_underbusy: the seed's example trainer was "busy only about half the time"; a trainer fed
# well-sized micro-batches keeps its device busy >= 85 % of the training stage, so below 60 % the
# gap is the micro-batch size rather than noise.
TRAINER_BUSY_MIN = 0.60
TRAINER_BUSY_TARGET = 0.85
# padding_waste: sequence packing or length bucketing keeps padding under ~5 %; above 15 % it costs
# more training time than a packing change risks.
PADDING_FRAC_MAX = 0.15
# old_logprob_pass_costly: the extra forward pass is ~1/3 of a forward+backward; above 15 % of the
# trainer stage it is worth reusing the engine's log-probs or fusing the pass into training.
OLD_LOGPROB_SHARE_MAX = 0.15
# decode_interrupted_by_prefill: RL generation is decode-heavy (short prompts, long answers), so
# prefill normally takes ~10 % of a request's engine time; above 25 % prefills of new or
# multi-turn prompts keep pausing the running decodes.
PREFILL_SHARE_EXPECTED = 0.10
PREFILL_SHARE_MAX = 0.25
# A p90 inter-token latency 3x its median means decode iterations regularly stall (on prefill chunks).
ITL_SPREAD_MAX = 3.0
# requests_queued: a request that waits more than 20 % of its engine time before reaching the GPU
# shows the engines have no free slot (too few engines or too small max_num_seqs).
QUEUE_SHARE_MAX = 0.20
# kv_cache_saturated: vLLM preempts once usage reaches ~100 %; a median at or above 95 % leaves no
# room for the longest answers of a batch.
KV_USAGE_MAX = 0.95
# long_tail_trials: in a synchronous group the slowest trial sets the rollout; a slowest trial 3x
# the typical one means most of the batch idles while a few finish.
LONG_TAIL_RATIO = 3.0
# A batch with more than 2 % of trials cut off at the time-out is waiting on trials that never finish.
CUT_OFF_FRAC_MAX = 0.02
# sandbox_setup_dominant: setting up a sandbox should be small next to running the trial in it;
# when setup is over half of the sandbox time, pooling or pre-warming pays.
SANDBOX_SETUP_SHARE_MAX = 0.50
SANDBOX_SETUP_SHARE_OK = 0.20
# sandbox_hosts_overloaded: more than one runnable process per core on the busiest sandbox host
# (while its sandboxes run), trials waiting for a sandbox more than 20 % of their sandbox time, or
# the hosts' own file-system work (writing images, copying, removing) over half of it: the seed's
# hosts whose shared disk made set-up and tests twice as slow while their CPUs sat idle. Below 20 %
# of the sandbox time file-system work is what any set-up costs.
SANDBOX_HOST_LOAD_MAX = 1.0
SANDBOX_QUEUE_SHARE_MAX = 0.20
SANDBOX_FS_SHARE_MAX = 0.50
SANDBOX_FS_SHARE_OK = 0.20
# Setup times whose p90 is 3x their median vary with contention, not with the task.
SANDBOX_SETUP_SPREAD_MAX = 3.0
# weight_sync_on_critical_path: below 5 % of the step a faster transport is not worth a change.
WEIGHT_SYNC_SHARE_MAX = 0.05
# unaccounted_step_time: more than 10 % of the step outside the measured stages (validation,
# checkpointing, data loading) deserves a look before tuning the stages.
UNACCOUNTED_SHARE_MAX = 0.10


@dataclass
class RunFacts:
    """What the detectors see: medians (and p10/p90) over the steps used, and the step rule."""

    rl_mode: str
    median: dict[str, float]
    p90: dict[str, float]
    rollout: float
    training: float  # training_s + old_logprob_s: everything the trainer does in a step
    weight_sync: float
    step_median: float
    step_model: float

    def get(self, *names: str) -> float | None:
        for name in names:
            value = self.median.get(name)
            if value is not None and not math.isnan(value):
                return value
        return None

    def saving(self, stage: str, seconds: float) -> float:
        """Step seconds saved if ``stage`` were ``seconds`` shorter (0 when it is off the critical path)."""
        stages = {"rollout": self.rollout, "training": self.training, "weight_sync": self.weight_sync}
        stages[stage] = max(0.0, stages[stage] - max(0.0, seconds))
        faster, _ = combine(self.rl_mode, stages["rollout"], stages["training"], stages["weight_sync"])
        return max(0.0, self.step_model - faster)


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def _problem(facts: RunFacts, pid: str, stage: str, component: str, summary: str, excess: float,
             evidence: dict[str, float | None]) -> Problem:
    severity = facts.saving(stage, excess) if stage in ("rollout", "training", "weight_sync") else max(0.0, excess)
    shown = {k: _round(v) for k, v in evidence.items() if v is not None}
    shown["stage_excess_s"] = _round(max(0.0, excess))
    return Problem(id=pid, stage=stage, component=component, summary=summary, severity=_round(severity),
                   evidence=shown)


def trainer_underbusy(f: RunFacts) -> Problem | None:
    busy = f.get("trainer_busy_frac")
    if busy is None or busy >= TRAINER_BUSY_MIN:
        return None
    excess = f.training * (1.0 - busy / TRAINER_BUSY_TARGET)
    micro = f.get("micro_batch_size", "trainer/micro_batch_size")
    return _problem(f, "trainer_underbusy", "training", "trainer",
                    f"trainer device busy only {busy:.0%} of the training stage: micro-batches too small to fill it",
                    excess, {"trainer_busy_frac": busy, "training_s": f.training, "micro_batch_size": micro,
                             "busy_target": TRAINER_BUSY_TARGET})


def padding_waste(f: RunFacts) -> Problem | None:
    pad = f.get("padding_frac")
    if pad is None or pad <= PADDING_FRAC_MAX:
        return None
    return _problem(f, "padding_waste", "training", "trainer",
                    f"{pad:.0%} of trained tokens are padding", f.training * pad,
                    {"padding_frac": pad, "training_s": f.training})


def old_logprob_pass_costly(f: RunFacts) -> Problem | None:
    old = f.get("old_logprob_s")
    if old is None or f.training <= 0 or old / f.training <= OLD_LOGPROB_SHARE_MAX:
        return None
    return _problem(f, "old_logprob_pass_costly", "training", "trainer",
                    f"separate old/ref log-prob pass takes {old / f.training:.0%} of the trainer's step time",
                    old, {"old_logprob_s": old, "trainer_stage_s": f.training, "share": old / f.training})


def decode_interrupted_by_prefill(f: RunFacts) -> Problem | None:
    prefill, decode = f.get("engine_prefill_s"), f.get("engine_decode_s")
    share = prefill / (prefill + decode) if prefill is not None and decode and prefill + decode > 0 else None
    itl50 = f.get("vllm:inter_token_latency_seconds/p50", "vllm:time_per_output_token_seconds/p50")
    itl90 = f.get("vllm:inter_token_latency_seconds/p90", "vllm:time_per_output_token_seconds/p90")
    spread = itl90 / itl50 if itl50 and itl90 is not None else None
    by_share = share is not None and share > PREFILL_SHARE_MAX
    by_spread = spread is not None and spread > ITL_SPREAD_MAX
    if not (by_share or by_spread):
        return None
    excess = f.rollout * max(0.0, (share or 0.0) - PREFILL_SHARE_EXPECTED)
    what = f"prefill takes {share:.0%} of engine time per request" if by_share else \
        f"p90 inter-token latency is {spread:.1f}x its median"
    return _problem(f, "decode_interrupted_by_prefill", "rollout", "engine",
                    f"decode keeps pausing to prefill new prompts: {what}", excess,
                    {"engine_prefill_s": prefill, "engine_decode_s": decode, "prefill_share": share,
                     "itl_p90_over_p50": spread, "rollout_s": f.rollout})


def requests_queued(f: RunFacts) -> Problem | None:
    queue = f.get("engine_queue_s")
    if queue is None:
        return None
    service = (f.get("engine_prefill_s") or 0.0) + (f.get("engine_decode_s") or 0.0)
    if queue + service <= 0:
        return None
    share = queue / (queue + service)
    if share <= QUEUE_SHARE_MAX:
        return None
    return _problem(f, "requests_queued", "rollout", "engine",
                    f"requests wait {share:.0%} of their engine time in the queue before reaching the GPU",
                    f.rollout * share,
                    {"engine_queue_s": queue, "engine_service_s": service, "queue_share": share,
                     "requests_waiting": f.get("vllm:num_requests_waiting"), "rollout_s": f.rollout})


def kv_cache_saturated(f: RunFacts) -> Problem | None:
    usage = f.get("kv_cache_usage")
    preempt = f.get("engine_preemptions")
    if not ((usage is not None and usage >= KV_USAGE_MAX) or (preempt is not None and preempt > 0)):
        return None
    prefill = f.get("engine_prefill_s")
    # A preempted request is recomputed from its prompt: each preemption costs about one prefill.
    excess = (preempt or 0.0) * (prefill or 0.0)
    return _problem(f, "kv_cache_saturated", "rollout", "engine",
                    "KV cache full" + (f": {preempt:g} preemptions per step" if preempt else f" ({usage:.0%} used)"),
                    excess, {"kv_cache_usage": usage, "engine_preemptions": preempt, "engine_prefill_s": prefill})


def long_tail_trials(f: RunFacts) -> Problem | None:
    slowest = f.get("trial_s_max", "rollout/trial_s_max")
    typical = f.get("trial_s_median", "trial_s_p50", "rollout/trial_s_median")
    unit = "trial time"
    if slowest is None or not typical:
        slowest, typical = f.get("response_length/max"), f.get("response_length/mean")
        unit = "response length"
    ratio = slowest / typical if slowest is not None and typical else None
    total, cut = f.get("trials_total"), f.get("trials_cut_off")
    cut_frac = cut / total if cut is not None and total else None
    by_ratio = ratio is not None and ratio > LONG_TAIL_RATIO
    by_cut = cut_frac is not None and cut_frac > CUT_OFF_FRAC_MAX
    if not (by_ratio or by_cut):
        return None
    excess = f.rollout * (1.0 - LONG_TAIL_RATIO / ratio) if by_ratio else 0.0
    what = f"slowest {unit} is {ratio:.1f}x the typical" if by_ratio else f"{cut_frac:.0%} of trials cut off"
    return _problem(f, "long_tail_trials", "rollout", "orchestrator",
                    f"a few long trials hold the group: {what}", excess,
                    {"tail_ratio": ratio, "trials_cut_off_frac": cut_frac, "rollout_s": f.rollout})


def sandbox_setup_dominant(f: RunFacts) -> Problem | None:
    setup, run = f.get("sandbox_setup_s"), f.get("sandbox_exec_s")
    if setup is None or run is None or setup + run <= 0:
        return None
    share = setup / (setup + run)
    if share <= SANDBOX_SETUP_SHARE_MAX:
        return None
    excess = min(f.rollout, setup - SANDBOX_SETUP_SHARE_OK * (setup + run))
    return _problem(f, "sandbox_setup_dominant", "rollout", "sandbox",
                    f"setting up a trial's sandbox takes {setup:.3g} s, {share:.0%} of its sandbox time",
                    excess, {"sandbox_setup_s": setup, "sandbox_exec_s": run, "setup_share": share})


def sandbox_hosts_overloaded(f: RunFacts) -> Problem | None:
    load = f.get("sandbox_host_load")
    queue = f.get("sandbox_queue_s")
    fs = f.get("sandbox_fs_s")
    setup, run = f.get("sandbox_setup_s"), f.get("sandbox_exec_s")
    setup_p90 = f.p90.get("sandbox_setup_s")
    spread = setup_p90 / setup if setup and setup_p90 is not None else None
    busy = (setup or 0.0) + (run or 0.0)
    by_load = load is not None and load > SANDBOX_HOST_LOAD_MAX
    by_queue = queue is not None and busy > 0 and queue / (queue + busy) > SANDBOX_QUEUE_SHARE_MAX
    by_fs = fs is not None and busy > 0 and fs / busy > SANDBOX_FS_SHARE_MAX
    by_spread = spread is not None and spread > SANDBOX_SETUP_SPREAD_MAX
    if not (by_load or by_queue or by_fs or by_spread):
        return None
    # What each finding costs a trial: its wait, the share of its sandbox time lost to crowded
    # cores, or file-system time beyond what a set-up needs; the worst of those found.
    excess = max([queue if by_queue else 0.0,
                  busy * (1.0 - SANDBOX_HOST_LOAD_MAX / load) if by_load else 0.0,
                  fs - SANDBOX_FS_SHARE_OK * busy if by_fs else 0.0])
    what = (f": {load:.2g} runnable processes per core" if by_load else
            ": trials wait for sandboxes" if by_queue else
            f": file-system work is {fs / busy:.0%} of the sandbox time" if by_fs else
            f": setup p90 is {spread:.1f}x its median")
    hosts = f.get("sandbox_hosts")
    return _problem(f, "sandbox_hosts_overloaded", "rollout", "sandbox", "sandbox hosts overloaded" + what,
                    min(excess, f.rollout),
                    {"sandbox_host_load": load, "sandbox_queue_s": queue, "sandbox_fs_s": fs, "sandbox_setup_s": setup,
                     "sandbox_exec_s": run, "setup_p90_over_median": spread, "sandbox_hosts": hosts})


def weight_sync_on_critical_path(f: RunFacts) -> Problem | None:
    ws = f.weight_sync
    if ws <= 0 or f.step_model <= 0 or ws / f.step_model <= WEIGHT_SYNC_SHARE_MAX:
        return None
    if f.saving("weight_sync", ws) <= 0:
        return None  # fully async and rollout-bound: the sync overlaps and costs nothing now
    return _problem(f, "weight_sync_on_critical_path", "weight_sync", "sync",
                    f"weight sync adds {ws:.3g} s ({ws / f.step_model:.0%}) to every step under {f.rl_mode}",
                    ws, {"weight_sync_s": ws, "step_model_s": f.step_model, "share": ws / f.step_model})


def unaccounted_step_time(f: RunFacts) -> Problem | None:
    gap = f.step_median - f.step_model
    if f.step_median <= 0 or f.step_model <= 0 or gap / f.step_median <= UNACCOUNTED_SHARE_MAX:
        return None
    return _problem(f, "unaccounted_step_time", "step", "orchestrator",
                    f"{gap:.3g} s ({gap / f.step_median:.0%}) of the step is outside the measured stages "
                    "(validation, checkpointing, data loading?)", gap,
                    {"step_median_s": f.step_median, "step_model_s": f.step_model})


DETECTORS: tuple[Callable[[RunFacts], Problem | None], ...] = (
    trainer_underbusy, padding_waste, old_logprob_pass_costly, decode_interrupted_by_prefill, requests_queued,
    kv_cache_saturated, long_tail_trials, sandbox_setup_dominant, sandbox_hosts_overloaded,
    weight_sync_on_critical_path, unaccounted_step_time,
)
PROBLEM_IDS = tuple(d.__name__ for d in DETECTORS)


def detect(facts: RunFacts) -> list[Problem]:
    """Every problem the detectors find, worst first (severity, then the stage time wasted)."""
    found = [p for d in DETECTORS if (p := d(facts)) is not None]
    return sorted(found, key=lambda p: (-p.severity, -p.evidence.get("stage_excess_s", 0.0), p.id))
