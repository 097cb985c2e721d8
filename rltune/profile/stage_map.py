"""The stage map: which of each log format's own metrics fill which core column of the stage table.

One data table, :data:`STAGE_MAP`: format -> core column -> rules tried in order. A rule is a
formula over the source's metric names, ``"a - b + c"``: the FIRST name must be present for the
rule to apply; the others are added or subtracted when present (a missing optional part counts as
0). ``sum(prefix)`` adds every metric whose name starts with ``prefix``. The first rule that applies
fills the column; no rule applies -> the column is null (never 0). Every source metric is also
kept under its own name as an extra column.

Choices that need a reason:

- verl's ``timing_s/gen`` contains ``timing_s/reshard`` (the FSDP -> vLLM weight hand-over in the
  hybrid engine), so rollout = gen - reshard (+ reward scoring) and weight sync = reshard.
- ``old_logprob_s`` is the separate recompute of old and reference log-probs; it runs on the
  trainer, so diagnosis counts it in the training stage (training_s + old_logprob_s).
- verl's oldest generation has no step timer: its step is the sum of its ``timing/*`` phases,
  which run one after another in that trainer (the report marks the column as derived).
- TRL: the ``rltune/`` names come from :class:`rltune.integrations.trl.TrlStageTimers` (per optimizer
  step, derived from TRL's own profiling timers); TRL's ``step_time`` covers only the micro-steps'
  ``training_step`` calls, and its ``compute_loss`` timer only the forward pass, so neither is
  a training time. The gap is TRL's ``sampling/sampling_logp_difference/mean`` (mean |trainer -
  vLLM log-prob| over completion tokens), logged only when vLLM generates.
- prime-rl's orchestrator step is rollout-bound: its console ``Time`` is the step, and the
  ``Generating rollouts`` bar's elapsed time is the rollout.
- current verl times the weight hand-over after the update (``timing_s/update_weights``; the
  one-step-off trainer ``timing_s/sync_rollout_weights``), not inside ``timing_s/gen``; the rollout
  rule subtracts ``timing_s/reshard`` only where the log has it. ``timing_s/generate_sequences`` and
  ``timing_s/agent_loop/*`` are per-sample figures inside ``timing_s/gen``, kept as extras.
- NeMo-RL's asynchronous GRPO logs ``exposed_generation``: the trainer's wait for the replay
  buffer while generation runs alongside. It fills ``wait_s``, never ``rollout_s``; such a log has
  no rollout time. ``prepare_for_generation/total`` already contains
  ``prepare_for_generation/transfer_and_update_weights``, and ``policy_and_reference_logprobs``
  contains ``policy_logprobs`` / ``reference_logprobs``: only the outer timers are summed.
- SkyRL: ``timer/<name>`` come from its ``Finished: '<name>', time cost: Xs`` lines,
  ``timing/<name>`` from its tracker dict (the same timers). ``fwd_logprobs_values_reward`` (old
  and reference log-probs, critic values, reward-model scores) is the separate forward pass; the
  update is ``train_critic_and_policy`` (it contains ``policy_train`` and ``critic_train``).
- ms-swift's ``logging.jsonl`` has no stage timers. Its GRPO rows carry TRL's ``step_time``: the
  sum of the optimizer step's ``training_step`` calls (generation, forward, backward); the
  optimizer update and logging fall outside it. Without ``step_time`` the step is derived from
  ``elapsed_time`` (whole seconds) between logged rows (``elapsed/step_s``, marked derived).
- AReaL's trainer runs its ``timeperf/*`` phases one after another and has no step timer: the step
  is their sum (marked derived). ``timeperf/rollout`` is the trainer's wait in ``prepare_batch``
  for a full batch, the rollout stage as the trainer sees it.

:func:`describe_stage_map` renders the table for docs/artifacts.md.
"""

from __future__ import annotations

import re

from rltune.contracts.stages import CORE_COLUMNS

# Columns every format maps by hand; the rest of the core columns map only from the rltune format.
_NUMERIC_CORE = [name for name, kind, _ in CORE_COLUMNS if kind == "float64"]

STAGE_MAP: dict[str, dict[str, tuple[str, ...]]] = {
    "rltune": {name: (name,) for name in _NUMERIC_CORE},
    "verl": {
        "step_s": ("timing_s/step", "timing/step", "perf/time_per_step", "time_per_step", "sum(timing/)",
                   "progress/step_s"),
        "rollout_s": ("timing_s/gen - timing_s/reshard + timing_s/reward", "timing/gen + timing/reward"),
        "weight_sync_s": ("timing_s/reshard", "timing_s/update_weights", "timing_s/sync_rollout_weights",
                          "timing_s/sync_weights"),
        "old_logprob_s": ("timing_s/old_log_prob + timing_s/ref", "timing_s/ref",
                          "timing/old_log_prob + timing/ref", "timing/ref"),
        "training_s": ("timing_s/update_actor + timing_s/update_critic + timing_s/values + timing_s/adv",
                       "timing/update_actor + timing/update_critic + timing/values + timing/adv"),
        "wait_s": ("timing_s/wait_for_enough_samples",),
        "reward": ("critic/score/mean", "critic/rewards/mean"),
    },
    "prime-rl": {
        "step_s": ("time/step", "orchestrator/time/step", "Time", "step_time/mean"),
        "rollout_s": ("orchestrator/time/generate_completions", "orchestrator/time/generate",
                      "rollout_progress/elapsed_s"),
        "training_s": ("time/forward_backward + time/optimizer", "step_time/mean"),
        "weight_sync_s": ("time/broadcast_weights + orchestrator/time/update_weights",
                          "orchestrator/time/update_weights"),
        "wait_s": ("time/wait_for_batch",),
        "reward": ("orchestrator/reward/mean", "Reward"),
        "sample_age_max": ("orchestrator/off_policy_level/max", "Max. Off-Policy Level"),
    },
    "slime": {
        "step_s": ("perf/step_time",),
        "rollout_s": ("perf/rollout_time",),
        "training_s": ("perf/actor_train_time", "perf/train_time - perf/log_probs_time - perf/ref_log_probs_time"),
        "old_logprob_s": ("perf/log_probs_time + perf/ref_log_probs_time", "perf/ref_log_probs_time"),
        "weight_sync_s": ("perf/update_weights_time",),
        "wait_s": ("perf/train_wait_time",),
        "reward": ("rollout/raw_reward", "rollout/rewards"),
    },
    "openrlhf": {
        "step_s": ("timing/step", "step_time"),
        "rollout_s": ("timing/generate_samples", "timing/generate", "generate_time"),
        "old_logprob_s": ("timing/make_experience", "make_experience_time"),
        "training_s": ("timing/ppo_train", "timing/train", "ppo_train_time"),
        "weight_sync_s": ("timing/broadcast", "broadcast_time"),
        "reward": ("reward",),
    },
    "trl": {
        "step_s": ("rltune/step_s", "step_time"),
        "rollout_s": ("rltune/rollout_s", "profiling/Time taken: GRPOTrainer._generate_and_score_completions",
                      "profiling/Time taken: GRPOTrainer.vLLM.generate + profiling/Time taken: GRPOTrainer._calculate_rewards",
                      "profiling/Time taken: GRPOTrainer.transformers.generate"
                      " + profiling/Time taken: GRPOTrainer._calculate_rewards",
                      "profiling/Time taken: GRPOTrainer.transformers.generate_batch"
                      " + profiling/Time taken: GRPOTrainer._calculate_rewards"),
        "weight_sync_s": ("rltune/weight_sync_s", "profiling/Time taken: GRPOTrainer.sync_weights",
                          "profiling/Time taken: GRPOTrainer._move_model_to_vllm"),
        "training_s": ("rltune/training_s",),
        "old_logprob_s": ("rltune/old_logprob_s",),
        "gap": ("sampling/sampling_logp_difference/mean",),
        "sample_age_mean": ("rltune/sample_age_mean",),
        "sample_age_max": ("rltune/sample_age_max",),
        "reward": ("reward",),
    },
    "nemo-rl": {
        "step_s": ("timing/total_step_time",),
        "rollout_s": ("timing/generation + timing/reward_calculation",),
        "wait_s": ("timing/exposed_generation",),
        "weight_sync_s": ("timing/weight_sync", "timing/prepare_for_generation/total",
                          "timing/prepare_for_generation", "timing/refit"),
        "old_logprob_s": ("timing/policy_and_reference_logprobs + timing/logprob_inference_prep",),
        "training_s": ("timing/policy_training + timing/training_prep",),
        "reward": ("Avg Reward", "Avg Total Reward"),
        "sample_age_mean": ("Avg Trajectory Age",),
    },
    "skyrl": {
        "step_s": ("timing/step", "timer/step"),
        "rollout_s": ("timing/generate + timing/postprocess_generator_output",
                      "timer/generate + timer/postprocess_generator_output"),
        "old_logprob_s": ("timing/fwd_logprobs_values_reward", "timer/fwd_logprobs_values_reward"),
        "training_s": ("timing/train_critic_and_policy + timing/compute_advantages_and_returns",
                       "timer/train_critic_and_policy + timer/compute_advantages_and_returns",
                       "timer/policy_train + timer/critic_train"),
        "weight_sync_s": ("timing/sync_weights", "timer/sync_weights"),
        "reward": ("reward/avg_raw_reward", "avg_final_rewards"),
    },
    "ms-swift": {
        "step_s": ("iteration_time_s", "step_time", "elapsed/step_s"),
        "reward": ("reward",),
    },
    "areal": {
        "step_s": ("sum(timeperf/)",),
        "rollout_s": ("timeperf/rollout",),
        "old_logprob_s": ("timeperf/recompute_logp + timeperf/ref_logp + timeperf/teacher_logp",
                          "timeperf/ref_logp + timeperf/teacher_logp"),
        "training_s": ("timeperf/train_step + timeperf/critic_train_step + timeperf/critic_values"
                       " + timeperf/compute_advantage",),
        "weight_sync_s": ("timeperf/update_weights",),
        "reward": ("ppo_actor/task_reward/avg", "rollout/reward"),
    },
    "vllm": {
        "engine_queue_s": ("vllm:request_queue_time_seconds/mean",),
        "engine_prefill_s": ("vllm:request_prefill_time_seconds/mean",),
        "engine_decode_s": ("vllm:request_decode_time_seconds/mean",),
        "engine_preemptions": ("vllm:num_preemptions_total",),
        "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "gen_tokens": ("vllm:generation_tokens_total",),
    },
}
# Formats the auto-detector knows; 'vllm' is a snapshot format, accepted but not a step log.
FORMATS = tuple(STAGE_MAP)

_TERM = re.compile(r"\s([+-])\s")


def parse_rule(rule: str) -> list[tuple[int, str]]:
    """'a - b + c' -> [(+1, 'a'), (-1, 'b'), (+1, 'c')]."""
    parts = _TERM.split(f" + {rule}")
    return [(1 if sign == "+" else -1, name.strip()) for sign, name in zip(parts[1::2], parts[2::2], strict=True)]


def apply_rule(rule: str, metrics: dict[str, float]) -> float | None:
    """The rule's value over ``metrics``, or None when its first name is absent."""
    if rule.startswith("sum(") and rule.endswith(")"):
        prefix = rule[4:-1]
        values = [v for k, v in metrics.items() if k.startswith(prefix)]
        return sum(values) if values else None
    terms = parse_rule(rule)
    if terms[0][1] not in metrics:
        return None
    return sum(sign * metrics[name] for sign, name in terms if name in metrics)


def map_metrics(fmt: str, metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """Core column values from one step's source metrics, and the rule that filled each."""
    values: dict[str, float] = {}
    used: dict[str, str] = {}
    for column, rules in STAGE_MAP[fmt].items():
        for rule in rules:
            value = apply_rule(rule, metrics)
            if value is not None:
                values[column] = value
                used[column] = rule
                break
    return values, used


def describe_stage_map() -> str:
    """Markdown: one table per format, column -> rules in the order they are tried."""
    lines = [
        "Rules are tried in order; the first whose first metric is present fills the column (later",
        "terms are added or subtracted when present; `sum(p)` adds all metrics starting with `p`).",
        "Unmapped source metrics are kept as extra columns under their own names.",
        "",
        "| format | column | rules (first that applies wins) |",
        "|---|---|---|",
    ]
    for fmt, columns in STAGE_MAP.items():
        if fmt == "rltune":
            lines.append("| rltune | every numeric core column | the key of the same name |")
            continue
        for column, rules in columns.items():
            shown = " ; ".join(f"`{r}`" for r in rules)
            lines.append(f"| {fmt} | `{column}` | {shown} |")
    return "\n".join(lines)
