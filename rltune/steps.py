"""How stage times combine into a step time under each RL mode (the seed's rule).

- sync:            step = rollout + training + weight_sync
- one_step_async:  step = max(rollout, training) + weight_sync
- fully_async:     step = max(rollout, training + weight_sync)

Profile uses it to name the limiting stage, predict to combine forecast stages, trial to explain
a verdict. One definition, so the three can never disagree.
"""

from __future__ import annotations

RL_MODES = ("sync", "one_step_async", "fully_async")


def combine(rl_mode: str, rollout: float, training: float, weight_sync: float) -> tuple[float, str]:
    """Return (step seconds, limiting stage) for one set of stage times.

    The limiting stage is the one that sets the step: for sync the largest of the three; for
    one-step async the larger of rollout and training; for fully async 'rollout' or
    'training+weight_sync'.
    """
    if rl_mode == "sync":
        step = rollout + training + weight_sync
        limiting = max((rollout, "rollout"), (training, "training"), (weight_sync, "weight_sync"))[1]
    elif rl_mode == "one_step_async":
        step = max(rollout, training) + weight_sync
        limiting = "rollout" if rollout >= training else "training"
    elif rl_mode == "fully_async":
        step = max(rollout, training + weight_sync)
        limiting = "rollout" if rollout >= training + weight_sync else "training+weight_sync"
    else:
        raise ValueError(f"unknown RL mode {rl_mode!r}; expected one of {', '.join(RL_MODES)}")
    return step, limiting
