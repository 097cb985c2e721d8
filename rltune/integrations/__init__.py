"""What a framework's own process imports to give rltune per-step stage times.

- :mod:`rltune.integrations.trl` -- a ``TrainerCallback`` for TRL's ``GRPOTrainer`` that writes
  TRL's profiling timers, the stage times rltune derives from them and the samples' age into the
  trainer's logged metrics (console, ``trainer_state.json``, trackers).
- :mod:`rltune.integrations.trl_grpo` -- a real TRL GRPO job on a randomly initialised Qwen3 with
  a shipped character tokenizer, arithmetic prompts and reward (nothing is downloaded):
  ``python -m rltune.integrations.trl_grpo [GRPOConfig flags] [job flags]``.

These modules run inside the framework's process: they never import ``rltune.tune`` (or anything
else above ``rltune.profile``), and they load the framework itself only when imported.
"""
